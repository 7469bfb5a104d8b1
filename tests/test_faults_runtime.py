"""A request never sees another's state, and a snapshot holding NaN or inf is never built nor served
(issue: one non-finite snapshot poisoned every later answer of the process, on every corpus)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.errors import ModelError, SnapshotCorrupt
from cag.kernels import native
from cag.runtime import kv_cache
from cag.runtime.slots import Slots
from cag.store import snapshots as snapfiles

QUESTION = "Who keeps the lighthouse?"


def two_corpora(tmp_path: Path, small_corpus: Path) -> Path:
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.md").write_text("The museum opens at nine and closes at five, except on Mondays.\n")
    return other


def poison(engine: Engine, corpus: str) -> None:
    """Rewrite the corpus's snapshot with NaN in one layer's values and a checksum that matches."""
    row = engine.index.snapshot(engine.index.corpus(corpus)["current_snapshot"])
    path = Path(row["path"])
    snap = snapfiles.load(path, dequant=torch.float32)
    layers = [(k.float().clone(), v.float().clone()) for k, v in snap.kv]
    layers[-1][1][0, 0, 3:9] = float("nan")
    meta = {
        k: v
        for k, v in snap.meta.items()
        if k not in ("checksum", "format", "dtype", "n_layers", "n_tokens", "codec", "int8_block")
    }
    snapfiles.save(path, layers, snap.ids, meta, snapfiles.DTYPES[snap.meta["dtype"]])
    engine.evict()


CASES = [
    ("tiny", "torch", "auto"),
    ("tiny64", "avx512", "auto"),
    ("tiny64", "avx512", "int8"),
    ("tiny64", "torch", "int8"),
]


@pytest.mark.parametrize("model,kernels,kv_dtype", CASES)
def test_a_nan_snapshot_is_refused_and_never_reaches_another_corpus(request, tmp_path, small_corpus, monkeypatch,
                                                                    model, kernels, kv_dtype):
    if kernels != "torch" and native.load() is None:
        pytest.skip(f"cag's kernels do not run here: {native.reason()}")
    monkeypatch.setenv("CAG_MODEL", str(request.getfixturevalue(f"{model}_model_dir")))
    monkeypatch.setenv("CAG_DECODE_KERNELS", kernels)
    monkeypatch.setenv("CAG_KV_DTYPE", kv_dtype)
    if model == "tiny64":
        monkeypatch.setenv("CAG_WEIGHTS", "int4")
    engine = Engine(get_settings())
    engine.ingest(str(small_corpus), name="poisoned")
    engine.ingest(str(two_corpora(tmp_path, small_corpus)), name="clean")
    before = {m: engine.answer(Query("clean", QUESTION, mode=m, max_tokens=12)).token_ids for m in ("cag", "full")}
    poison(engine, "poisoned")
    with pytest.raises(SnapshotCorrupt, match="NaN or inf"):
        engine.answer(Query("poisoned", QUESTION, max_tokens=12))
    assert engine.index.snapshot(engine.index.corpus("poisoned")["current_snapshot"])["status"] == "corrupt"
    # served anyway (the check bypassed): its request's NaN stays its own
    monkeypatch.setattr(kv_cache, "nonfinite", lambda *a, **k: None)
    engine.index.set_snapshot_status(engine.index.corpus("poisoned")["current_snapshot"], "ready")
    engine.answer(Query("poisoned", QUESTION, max_tokens=12))
    for _ in range(2):
        assert {
            m: engine.answer(Query("clean", QUESTION, mode=m, max_tokens=12)).token_ids for m in ("cag", "full")
        } == before


def test_ingest_refuses_keys_and_values_its_storage_cannot_hold(tiny_model_dir, small_corpus, monkeypatch):
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_KV_DTYPE", "float16")
    engine = Engine(get_settings())
    with torch.no_grad():
        engine.lm.model.model.layers[0].self_attn.v_proj.weight.mul_(1e6)  # values past float16's 65504
    with pytest.raises(ModelError, match="past what float16 stores"):
        engine.ingest(str(small_corpus))
    assert not list(engine.settings.snapshots_dir.glob("*.safetensors")) and engine.index.corpus("corpus") is None
    with torch.no_grad():
        engine.lm.model.model.layers[0].self_attn.v_proj.weight.fill_(float("nan"))
    with pytest.raises(ModelError, match="NaN or inf"):
        engine.ingest(str(small_corpus))


def test_a_slot_given_back_is_zero_where_its_request_wrote():
    slots = Slots(2, 2, 16, 1024, 2, torch.bfloat16)
    s = slots.take()
    for t in slots.k + slots.v:
        t[s, :, :300] = float("nan")
    slots.give(s, 300)
    assert slots.take() == s and all(torch.equal(t, torch.zeros_like(t)) for t in slots.k + slots.v)


def test_nonfinite_names_the_layer():
    layers = [(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4)) for _ in range(3)]
    assert kv_cache.nonfinite(layers) is None
    layers[2][0][0, 1, 4, 3] = float("-inf")
    assert kv_cache.nonfinite(layers) == "layer 2 keys hold NaN or inf"
    layers[2][0][0, 1, 4, 3] = 1e6
    assert (
        kv_cache.nonfinite(layers) is None and "past what int8" in kv_cache.nonfinite(layers, torch.int8)
        if 1e6 > 65504 * 127
        else True
    )
    assert "past what float16" in kv_cache.nonfinite(layers, torch.float16)


def test_the_finite_scan_runs_once_per_unchanged_snapshot_file(tiny_engine, small_corpus, monkeypatch):
    """Opening a snapshot scans its values for NaN/inf once per unchanged file (as the checksum); a
    file changed since, even to the same size and times, is scanned again."""
    import os

    from cag.knowledge import verify
    from cag.store import stamps

    monkeypatch.setattr(stamps, "SETTLE_S", 0.0)  # the file was written just now; the race is tested in test_snapshots
    tiny_engine.ingest(str(small_corpus))
    row = tiny_engine.index.snapshot(tiny_engine.index.corpus("corpus")["current_snapshot"])
    scans = []
    real = kv_cache.nonfinite
    monkeypatch.setattr(kv_cache, "nonfinite", lambda *a, **k: scans.append(1) or real(*a, **k))
    verify.open_snapshot(tiny_engine.snapshots(), row)
    verify.open_snapshot(tiny_engine.snapshots(), row)
    assert len(scans) == 1
    st = os.stat(row["path"])
    os.utime(row["path"], ns=(st.st_atime_ns, st.st_mtime_ns))  # times put back: only the ctime moved
    verify.open_snapshot(tiny_engine.snapshots(), row)
    assert len(scans) == 2
