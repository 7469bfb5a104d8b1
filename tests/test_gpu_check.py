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
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--shape", str(shape), "--tokens", "300", "--questions", "1",
                        "--max-tokens", "4", "--exact-questions", "2", "--device", "cpu", "--out", str(tmp_path / "out")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
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
