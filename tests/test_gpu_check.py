"""The GPU check script runs end to end; without a GPU it falls back to the CPU and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.common import ESSAYS
from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not ESSAYS.exists(), reason=f"the shared essays are not at {ESSAYS}")


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
])
def test_gpu_check_script(tiny_model_dir, tmp_path, device):
    env = dict(os.environ, CAG_WEIGHTS="auto", CAG_KV_DTYPE="float32")  # the random tiny model: bit-identical state
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--model", str(tiny_model_dir), "--tokens", "300",
                        "--questions", "2", "--max-tokens", "6", "--device", device, "--out", str(tmp_path)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["device"].startswith(device) and report["all_identical"] and report["batched_identical"]
    assert report["torch"] == torch.__version__ and report["prefill_tok_s"] > 0 and report["load_gb_s"] > 0
    assert (tmp_path / "gpu_check.md").read_text().count("|") > 10


def test_gpu_check_on_random_weights_of_a_shape(tiny_model_dir, tmp_path):
    """--shape (what bench/gpu_check.sh passes where the weights could not travel): the folder's config
    and tokenizer on random weights, named in the report, and still exact."""
    import shutil

    from bench.gpu_check import SHAPE_OF, random_weights

    shape = tmp_path / "shape"
    shape.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, shape / f.name)
    (shape / SHAPE_OF).write_text("tiny-chat\n")
    a, b = random_weights(shape, tmp_path / "a"), random_weights(shape, tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()  # seed 0: the same weights
    assert not (a / SHAPE_OF).exists() and (a / "tokenizer.json").exists()

    env = dict(os.environ, CAG_WEIGHTS="auto", CAG_KV_DTYPE="float32")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_check",
            "--shape",
            str(shape),
            "--tokens",
            "300",
            "--questions",
            "1",
            "--max-tokens",
            "4",
            "--exact-questions",
            "2",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["random_weights_of"] == "tiny-chat" and report["all_identical"] and report["batched_identical"]
    assert "Random weights (seed 0) of tiny-chat" in (tmp_path / "out" / "gpu_check.md").read_text()


@pytest.mark.real
def test_pack_shape_is_the_embedded_model_without_its_weights(models_dir, tmp_path, monkeypatch):
    from bench.gpu_check import SHAPE_OF, pack_shape
    from cag.config import DEFAULT_MODEL

    monkeypatch.setenv("CAG_MODELS_DIR", str(models_dir))
    shape = pack_shape(tmp_path / "shape")
    names = {f.name for f in shape.iterdir()}
    assert {"config.json", "tokenizer.json", SHAPE_OF} <= names and not any(n.endswith(".safetensors") for n in names)
    assert (shape / SHAPE_OF).read_text() == DEFAULT_MODEL
    assert sum(f.stat().st_size for f in shape.iterdir()) < 8 << 20  # small enough to travel


def test_each_part_saves_the_report_and_a_spent_budget_skips_the_rest(tmp_path):
    """A run cut off at a machine's time limit leaves every figure it measured (saved after each
    part); parts that would start past --budget are skipped and named, and a failing part is named."""
    import time
    from types import SimpleNamespace

    from bench.gpu_check import Check

    saved = []
    args = SimpleNamespace(deadline=time.monotonic() + 60)
    check = Check(SimpleNamespace(), args, tmp_path, primary=True, save=lambda r: saved.append(dict(r)))
    check.part("one", lambda: check.r.update(one=1))
    check.part("broken", lambda: 1 / 0)
    args.deadline = time.monotonic() - 1
    check.part("late", lambda: check.r.update(late=1))
    assert saved[0]["one"] == 1 and "ZeroDivisionError" in saved[1]["failed"]["broken"]
    assert check.r["skipped"] == ["late"] and "late" not in check.r and len(saved) == 2


def test_a_spent_budget_exits_3_with_a_report(tiny_model_dir, tmp_path):
    env = dict(os.environ, CAG_WEIGHTS="auto", CAG_KV_DTYPE="float32")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_check",
            "--model",
            str(tiny_model_dir),
            "--budget",
            "0.001",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 3, r.stdout + r.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert (
        report["skipped"] == ["ingest"]
        and "skipped, past the --budget: ingest" in (tmp_path / "gpu_check.md").read_text()
    )
