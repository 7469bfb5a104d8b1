"""bench/bench_class.py: the class each CPU's results are named after, and the commands that fill its row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.bench_class import KERNELS, plan
from bench.common import CPU_CLASSES, cpu_class, cpu_tag


def test_each_class_names_its_results_and_runs_its_own_kernels(monkeypatch):
    from cag.model import auto_weights

    def named(*flags: str) -> str | None:  # the class bench.common sees on a CPU with `flags`
        monkeypatch.setattr(auto_weights, "cpu_flags", lambda: set(flags))
        return cpu_tag()

    avx2 = ("avx2", "fma", "f16c")
    assert named(*avx2) == "avx2"
    assert named(*avx2, "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni") == "avx512"
    assert named(*avx2, "avx512f", "avx512bw", "avx512vl") == "avx512f"  # below the AVX-512 library's floor: AVX2's
    assert named(*avx2, "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16") == "amx"
    assert named("sse4_2") is None
    # the words machine() prints into every results file
    assert cpu_class() == "no AVX2" and CPU_CLASSES["avx512"] == "AVX-512 with BF16 and VNNI, no AMX"
    steps = dict(plan("avx2", ("one-call", "anchor", "models-8b", "exactness"), anchor=True))
    assert steps["one-call"][steps["one-call"].index("--kernels") + 1] == "avx2"
    assert KERNELS["avx512f"] == "avx2" and "amx" in KERNELS["amx"].split(",")
    names = [cmd[cmd.index("--name") + 1] for cmd in steps.values() if isinstance(cmd, list)]
    assert names == ["one-call-avx2", "anchor-qwen2.5-0.5b-avx2", "anchor-llama-3.2-1b-avx2",
                     "anchor-llama-3.2-3b-avx2", "models-8b-avx2", "exactness-avx2"]


def test_without_llama_cpp_the_anchor_steps_say_why_and_the_rest_run():
    steps = plan("avx512", ("anchor", "exactness"), anchor=False)
    assert [name for name, _ in steps] == ["anchor qwen2.5-0.5b", "anchor llama-3.2-1b", "anchor llama-3.2-3b",
                                           "exactness"]
    assert all(isinstance(cmd, str) and "pip install -e '.[anchor]'" in cmd for _, cmd in steps[:3])
    assert isinstance(steps[3][1], list)


def test_a_bad_step_is_one_line_and_exit_1():
    r = subprocess.run([sys.executable, "-m", "bench.bench_class", "--only", "one-call,bogus", "--dry-run"],
                       capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert r.returncode == 1
    assert r.stderr.strip() == "error: unknown step 'bogus'; use one-call, anchor, models-8b, exactness"
