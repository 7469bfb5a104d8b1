"""The exactness invariant on CUDA (marked `gpu`, skipped without one): the model, the request
buffers and the resident snapshot live on the GPU, and a cached answer still equals the uncached
one token for token, in float32 and in bfloat16 (CUDA's default compute dtype)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from tests.conftest import _tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]

QUESTIONS = ["Who keeps the lighthouse?", "When does the ferry leave?", "What does the bakery sell on Tuesdays?"]


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """SmolLM2's widths (hidden 576, 9 heads over 3 K/V heads of 64), random, 2 layers: products wide
    enough that cuBLAS picks its kernels by the number of rows (the tiny model's are not)."""
    return _tiny(tmp_path_factory, "wide-model", hidden=576, heads=9, kv_heads=3, init=0.06)


@pytest.fixture
def cuda_engine(tiny_model_dir, wide_model_dir, small_corpus, monkeypatch, request):
    dtype, model = request.param.split("-") if "-" in request.param else (request.param, "tiny")
    if model == "eager":  # CAG_CUDA_GRAPHS=false: each kernel launched from Python
        model = "tiny"
        monkeypatch.setenv("CAG_CUDA_GRAPHS", "false")
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir if model == "tiny" else wide_model_dir))
    monkeypatch.setenv("CAG_DEVICE", "cuda")
    monkeypatch.setenv("CAG_DTYPE", dtype)
    if dtype == "float32":
        monkeypatch.setenv("CAG_KV_DTYPE", "float32")  # bit-identical state: the random model is chaotic
    engine = Engine(get_settings())
    engine.ingest(str(small_corpus))
    return engine


@pytest.mark.parametrize("cuda_engine", ["float32", "bfloat16", "bfloat16-wide", "bfloat16-eager"], indirect=True)
def test_cag_equals_full_on_cuda(cuda_engine):
    lm = cuda_engine.lm
    assert lm.device.type == "cuda" and lm.kernels == "torch" and lm.weights == "fp32"
    cached = [cuda_engine.answer(Query("corpus", q, max_tokens=16)) for q in QUESTIONS]
    resident = cuda_engine.resident.values()  # the prefix every request reads lives on the GPU
    assert resident and all(r.prefix.kv[0][0].device.type == "cuda" for r in resident)
    full = [cuda_engine.answer(Query("corpus", q, max_tokens=16, mode="full")).token_ids for q in QUESTIONS]
    assert all(len(a.token_ids) == 16 and a.decode_tok_s for a in cached)
    assert [a.token_ids for a in cached] == full
    graphs = cuda_engine.decoder.graphs
    assert (graphs is None) == (not cuda_engine.settings.cuda_graphs)
    assert graphs is None or graphs.captures > 0  # every decode step was a replayed CUDA graph


@pytest.mark.parametrize("cuda_engine", ["float32", "bfloat16", "float32-wide", "bfloat16-wide"], indirect=True)
def test_batched_equals_alone_on_cuda(cuda_engine):
    alone = [cuda_engine.answer(Query("corpus", q, max_tokens=12)).token_ids for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: cuda_engine.answer(Query("corpus", q, max_tokens=12)).token_ids, QUESTIONS))
    assert together == alone
