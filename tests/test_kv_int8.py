"""int8 snapshots (CAG_KV_DTYPE=int8): the quantization error bound, stable re-quantization (so an
incremental refresh stores what a rebuild stores), the file (int8 + fp16 scales under the
checksum, about half the bytes), and the engine answering from it with its own key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.store import kv_int8
from cag.store import snapshots as snapfiles

Q = "When does the ferry leave?"


def _kv(seed: int = 0, t: int = 50, d: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, t, d, generator=g)
    x[..., 5] *= 40  # an outlier channel, as keys have
    return x


@pytest.mark.parametrize("d,block", [(64, 32), (16, 16), (48, 48)])
def test_round_trip_error_is_within_half_a_step_of_its_block(d, block):
    x = _kv(d=d)
    assert kv_int8.block_for(d) == block
    q, scale = kv_int8.quantize(x, block)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (1, 3, 50, d // block)
    back = kv_int8.dequantize(q, scale, torch.float32)
    step = scale.float().repeat_interleave(block, dim=-1)  # each element's own block scale
    err = (back - x).abs()
    assert (err <= 0.5 * step * 1.002 + 1e-6).all()  # half a step (x 1.002: the fp16-rounded scale)
    assert err.max() > 0  # it is a real quantization, not a copy
    rel = err.max() / x.abs().max()
    assert rel < 1 / 254 * 1.01


def test_requantizing_a_dequantized_block_gives_back_its_bytes():
    x = _kv(seed=1)
    q, scale = kv_int8.quantize(x, 32)
    q2, scale2 = kv_int8.quantize(kv_int8.dequantize(q, scale, torch.float32), 32)
    assert torch.equal(q, q2) and torch.equal(scale, scale2)


def test_zero_blocks_quantize_to_zero():
    q, scale = kv_int8.quantize(torch.zeros(1, 1, 4, 32), 32)
    assert not q.any() and not scale.any()
    assert not kv_int8.dequantize(q, scale).any()


def _engine(tiny_model_dir, monkeypatch, home: Path, kv_dtype: str) -> Engine:
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    return Engine(get_settings(home=home, kv_dtype=kv_dtype))


def test_int8_snapshot_file_engine_and_bound_against_fp16(tiny_model_dir, small_corpus, tmp_path, monkeypatch):
    fp16 = _engine(tiny_model_dir, monkeypatch, tmp_path / "fp16", "float16")
    int8 = _engine(tiny_model_dir, monkeypatch, tmp_path / "int8", "int8")
    a, b = fp16.ingest(str(small_corpus), name="c"), int8.ingest(str(small_corpus), name="c")
    assert a.snapshot != b.snapshot  # the codec is part of the key
    pa, pb = Path(a.path), Path(b.path)
    with safe_open(str(pb), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("layers.0.keys").dtype == torch.int8
        assert f.get_tensor("layers.0.keys.scale").dtype == torch.float16
    assert {"layers.0.keys.scale", "layers.1.values.scale"} <= names
    lm = int8.lm
    block = kv_int8.block_for(lm.head_dim)
    payload = 2 * lm.n_layers * lm.n_kv_heads * b.n_tokens * (lm.head_dim + 2 * lm.head_dim // block)
    header = pb.stat().st_size - payload
    assert 0 < header < 16_384  # tensors are int8 + one fp16 scale per block, nothing else
    assert pb.stat().st_size < pa.stat().st_size
    sa, sb = snapfiles.load(pa), snapfiles.load(pb)
    assert sb.meta["dtype"] == "int8" and sb.meta["codec"] == kv_int8.CODEC and sb.ids == sa.ids
    for layer, ((ka, va), (kb, vb)) in enumerate(zip(sa.kv, sb.kv)):
        for x, y in ((ka, kb), (va, vb)):
            assert y.dtype == torch.float16 and y.shape == x.shape
            step = x.float().abs().reshape(*x.shape[:-1], -1, block).amax(-1, keepdim=True) / 127
            err = (y.float() - x.float()).abs().reshape(*x.shape[:-1], -1, block)
            if layer == 0:  # before any attention: the fp16 state quantized, within half a step
                assert (err <= 0.5 * step * 1.01 + 2e-3 * x.float().abs().reshape(err.shape) + 1e-6).all()
            # later rows attended to the int8 keys before them (kv_cache.prefill_knowledge): close, not within a step
            else:
                assert float((y.float() - x.float()).norm() / x.float().norm()) < 0.05
    got = int8.answer(Query("c", Q, max_tokens=8))
    assert got.snapshot == b.snapshot and got.cached_tokens == b.n_tokens and got.completion_tokens > 0
    assert int8.answer(Query("c", Q, max_tokens=8)).token_ids == got.token_ids  # deterministic, snapshot unpolluted


def test_int8_refresh_stores_what_a_rebuild_stores_for_the_kept_documents(
    tiny_model_dir, small_corpus, tmp_path, monkeypatch
):
    eng = _engine(tiny_model_dir, monkeypatch, tmp_path / "h", "int8")
    eng.ingest(str(small_corpus), name="c")
    (small_corpus / "c.md").write_text("The bakery on Quay Street sells rye bread on Fridays now.\n")
    refreshed = eng.ingest("c")
    assert refreshed.status == "refreshed" and refreshed.reused_tokens > 0
    kept = refreshed.reused_tokens
    with safe_open(refreshed.path, framework="pt") as f:
        inc = {n: f.get_tensor(n) for n in f.keys() if n.startswith("layers.")}
    rebuilt = _engine(tiny_model_dir, monkeypatch, tmp_path / "h2", "int8").ingest(str(small_corpus), name="c")
    with safe_open(rebuilt.path, framework="pt") as f:
        full = {n: f.get_tensor(n) for n in f.keys() if n.startswith("layers.")}
    for n in full:  # positions before the first changed document: the same int8 bytes and scales
        assert torch.equal(inc[n][:, :, :kept], full[n][:, :, :kept]), n
