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
