"""The figures of docs/performance.md's "By CPU class" table, in one run on the CPU at hand.

The table has a row per class of CPU (AVX2 only; AVX-512 with BF16 and VNNI; AMX) and the classes differ
between machines: this runs, one after another, what a row needs and names every results file after the class
(`-avx2`, `-avx512`, `-amx`; `-avx512f` for AVX-512 without BF16, which runs the AVX2 library), so that a machine
of a class not yet measured fills its row in one command:

  * `one-call-CLASS`: bench_one_call at 0.5B, 1B and 3B on the class's kernels, beside the read bound;
  * `anchor-SHAPE-CLASS`: bench_anchor beside llama.cpp on the same Q4_0 file, 1K and 4K tokens, 5 rounds
    (skipped, saying why, where llama-cpp-python is not installed: `pip install -e '.[anchor]'` builds it for
    this CPU, ~15-25 minutes on 2 cores);
  * `models-8b-CLASS`: the 8B shape's ingest, TTFT, decode and memory (~15 GB of disk for its bf16 folder);
  * `exactness-CLASS`: the exactness harness, 5 generated scenarios on `auto`.

20 minutes on 2 cores (AMD EPYC Zen 4, 2026-12-07) with the random-weight models already built under
/tmp/cag-bench-models, more the first time (building them, the 8B's 15 GB folder most); `--only` picks steps,
`--dry-run` prints the commands. A step that fails is reported and the others still run; the exit code is 1 if
any failed. Run: `python -m bench.bench_class` (or `make bench-class`).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time

from .common import cpu_class, cpu_tag

SHAPES = ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.2-3b")
STEPS = ("one-call", "anchor", "models-8b", "exactness")
# the decode kernels each class runs bench_one_call on: its own (`auto`'s), and AMX's attention beside AVX-512's
KERNELS = {"avx2": "avx2", "avx512f": "avx2", "avx512": "avx512", "amx": "avx512,amx"}


def plan(cls_tag: str, steps: tuple[str, ...], anchor: bool) -> list[tuple[str, list[str] | str]]:
    """(step, argv of `python -m ...`, or why it is skipped) in the order they run."""
    out: list[tuple[str, list[str] | str]] = []
    if "one-call" in steps:
        out.append(("one-call", ["bench.bench_one_call", "--shapes", ",".join(SHAPES), "--kernels", KERNELS[cls_tag],
                                 "--name", f"one-call-{cls_tag}"]))
    if "anchor" in steps:
        for shape in SHAPES:
            out.append((f"anchor {shape}", ["bench.bench_anchor", "--model", shape, "--sizes", "1000,4000", "--rounds",
                                            "5", "--repeat", "3", "--name", f"anchor-{shape}-{cls_tag}"]
                        if anchor else "llama-cpp-python is not installed (pip install -e '.[anchor]')"))
    if "models-8b" in steps:
        out.append(("models-8b", ["bench.bench_models", "--shapes", "8b", "--formats", "int4", "--name",
                                  f"models-8b-{cls_tag}"]))
    if "exactness" in steps:
        out.append(("exactness", ["bench.bench_exactness", "--configs", "auto/auto:5", "--no-cost", "--name",
                                  f"exactness-{cls_tag}"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(STEPS), help=f"steps, comma-separated: {', '.join(STEPS)}")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args()
    steps = tuple(s.strip() for s in a.only.split(",") if s.strip())
    if bad := [s for s in steps if s not in STEPS]:
        sys.exit(f"error: unknown step {bad[0]!r}; use {', '.join(STEPS)}")
    if (t := cpu_tag()) is None:
        sys.exit(f"error: this CPU ({cpu_class()}) runs none of cag's kernels: no class row to fill")
    print(f"CPU class: {cpu_class()} -> results named *-{t}", flush=True)
    failed = []
    for name, cmd in plan(t, steps, importlib.util.find_spec("llama_cpp") is not None):
        if isinstance(cmd, str):
            print(f"== {name}: skipped, {cmd}", flush=True)
            continue
        print(f"== {name}: {sys.executable} -m {' '.join(cmd)}", flush=True)
        if a.dry_run:
            continue
        start = time.monotonic()
        rc = subprocess.call([sys.executable, "-m", *cmd])
        print(f"== {name}: {'done' if rc == 0 else f'FAILED (exit {rc})'} in {(time.monotonic() - start) / 60:.1f} min",
              flush=True)
        if rc:
            failed.append(name)
    if failed:
        sys.exit(f"error: {len(failed)} step(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
