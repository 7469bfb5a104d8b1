"""The knowledge prefilled as decode rows (cag.runtime.knowledge_kv): where the step makes every row a decode row, a
row's K/V do not depend on how the rows were grouped, so a snapshot equals itself prefilled in any pieces, a refresh
equals a rebuild at any cut (not only at a block boundary), and `cag` == `full`; elsewhere the fixed blocks stay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.runtime import knowledge_kv, kv_cache
from cag.runtime.decoder import Decoder
from cag.store import snapshots
from tests.test_quotes import keeping_engine

Q = "When does the ferry leave the harbour?"
IDS = [i % 50 + 20 for i in range(100)]


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (ka, va), (kb, vb) in zip(a, b):
        assert ka.shape == kb.shape and torch.equal(ka, kb) and torch.equal(va, vb)


def test_rows_do_not_depend_on_pieces_or_the_cut(tiny64_model_dir, monkeypatch):
    e = keeping_engine(tiny64_model_dir, monkeypatch)
    how = e.prefill(300)
    assert knowledge_kv.as_rows(e.lm, e.kv_dtype, 300) and knowledge_kv.block(how) == 1
    # a row's bits follow the format, its arithmetic and the kernels: in the key
    assert how == f"rows {e.lm.backend.arithmetic('int4')}/{e.lm.backend.name}"
    vocab = e.lm.model.config.vocab_size
    ids = [(37 * i) % (vocab - 20) + 20 for i in range(300)]
    whole = knowledge_kv.compute(e.decoder, how, e.kv_dtype, ids)
    assert whole[0][0].shape == (1, e.lm.n_kv_heads, 300, e.lm.head_dim) and whole[0][0].dtype == e.lm.attn_dtype
    small = Decoder(e.lm, e.decoder.room, 4, chunk=7)  # pieces of 7 rows, not 512
    _same(knowledge_kv.compute(small, how, e.kv_dtype, ids), whole)
    for cut in (1, 101, 299):  # a refresh keeping rows 0..cut-1 prefills the rest after them: the same bits
        seed = [(k[:, :, :cut], v[:, :, :cut]) for k, v in whole]
        _same(knowledge_kv.compute(e.decoder, how, e.kv_dtype, ids, seed), whole)
    ticks: list[int] = []
    _same(knowledge_kv.compute(e.decoder, how, e.kv_dtype, ids, tick=ticks.append), whole)
    assert sum(ticks) == 300 and len(ticks) > 1


def test_refresh_equals_rebuild_at_a_document_boundary(tiny64_model_dir, small_corpus, monkeypatch, tmp_path):
    e = keeping_engine(tiny64_model_dir, monkeypatch, CAG_PREFILL_BLOCK="16")  # the block setting is the forward's only
    first = e.ingest(str(small_corpus))
    assert snapshots.load(Path(first.path)).meta["prefill_block"] == 1
    start = {s["path"]: s for s in e.index.snapshot_documents(first.snapshot)}["c.md"]["start"]
    (small_corpus / "c.md").write_text("The bakery on Quay Street sells rye bread on Fridays now.\n")
    r = e.ingest("corpus")
    assert r.status == "refreshed" and r.reused_tokens == start  # the document's own first token, no block to round to
    other = keeping_engine(tiny64_model_dir, monkeypatch, CAG_HOME=str(tmp_path / "other"))
    rebuilt = other.ingest(str(small_corpus))
    assert rebuilt.snapshot == r.snapshot and rebuilt.reused_tokens == 0
    a, b = snapshots.load(Path(r.path)), snapshots.load(Path(rebuilt.path))
    assert a.ids == b.ids
    _same(a.kv, b.kv)
    for mode in ("cag", "full"):  # and cag == full over it, `full` prefilling the same way
        assert e.answer(Query("corpus", Q, max_tokens=12, mode=mode)).token_ids == \
            other.answer(Query("corpus", Q, max_tokens=12)).token_ids


def test_a_stopped_prefill_stores_nothing(tiny64_model_dir, monkeypatch):
    e = keeping_engine(tiny64_model_dir, monkeypatch)
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) > 2  # after the second piece
    with pytest.raises(kv_cache.Cancelled):
        knowledge_kv.compute(Decoder(e.lm, e.decoder.room, 4, chunk=16), e.prefill(len(IDS)), e.kv_dtype, IDS,
                             should_stop=stop)
    assert e.decoder.slots is None or e.decoder.slots.in_use == 0


def test_a_failing_progress_callback_ends_its_prefill_only(tiny64_model_dir, monkeypatch):
    e = keeping_engine(tiny64_model_dir, monkeypatch)

    def tick(rows: int) -> None:
        raise RuntimeError("progress sink gone")
    with pytest.raises(RuntimeError, match="progress sink gone"):
        knowledge_kv.compute(e.decoder, e.prefill(len(IDS)), e.kv_dtype, IDS, tick=tick)
    assert e.decoder.slots is not None and e.decoder.slots.in_use == 0  # its slot given back
    assert len(knowledge_kv.compute(e.decoder, e.prefill(len(IDS)), e.kv_dtype, IDS)) == e.lm.n_layers  # still serving


@pytest.mark.parametrize("env", [{"CAG_KV_DTYPE": "float16"}, {"CAG_DECODE_KERNELS": "torch"}])
def test_elsewhere_the_knowledge_goes_in_fixed_blocks(tiny64_model_dir, small_corpus, monkeypatch, env):
    """A snapshot stored in another dtype than decode attends in (its rows must be what a load gives back), or no
    flat step (torch's kernels): fixed blocks through the forward, CAG_PREFILL_BLOCK's size."""
    monkeypatch.setenv("CAG_MODEL", str(tiny64_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    e = Engine(get_settings())
    assert not knowledge_kv.as_rows(e.lm, e.kv_dtype, 100) and e.prefill(100) == "blocks 16"  # conftest's block
    r = e.ingest(str(small_corpus))
    assert snapshots.load(Path(r.path)).meta["prefill_block"] == 16
    assert e.answer(Query("corpus", Q, max_tokens=12)).token_ids == \
        e.answer(Query("corpus", Q, max_tokens=12, mode="full")).token_ids


def test_a_snapshot_prefilled_another_way_is_sound_stale_and_full_still_matches(tiny64_model_dir, small_corpus,
                                                                                 monkeypatch):
    """A snapshot prefilled in blocks (here: torch's kernels; or built before the rows) is not corrupt where the
    knowledge now goes as rows: it is served, stale with its reason, `full` prefills as it was (cag == full), and
    `cag ingest` rebuilds it as rows."""
    monkeypatch.setenv("CAG_DECODE_KERNELS", "torch")
    blocks = _engine(tiny64_model_dir, monkeypatch)
    first = blocks.ingest(str(small_corpus))
    assert blocks.prefill(first.n_tokens) == "blocks 16"
    monkeypatch.delenv("CAG_DECODE_KERNELS")
    e = keeping_engine(tiny64_model_dir, monkeypatch)
    status = e.status("corpus")
    here = e.prefill(first.n_tokens)
    assert status.stale and status.reasons == [f"knowledge prefilled as blocks 16, here as {here}: "
                                               "`cag ingest` rebuilds it"]
    cag = e.answer(Query("corpus", Q, max_tokens=12))
    assert cag.snapshot == first.snapshot and cag.stale
    assert e.answer(Query("corpus", Q, max_tokens=12, mode="full")).token_ids == cag.token_ids
    r = e.ingest("corpus")
    assert r.status == "built" and r.reused_tokens == 0 and not e.status("corpus").stale
    assert snapshots.load(Path(r.path)).meta["prefill"] == e.prefill(r.n_tokens)


def _engine(model_dir, monkeypatch) -> Engine:
    monkeypatch.setenv("CAG_MODEL", str(model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    return Engine(get_settings())


def test_knowledge_longer_than_a_slot_prefills_in_blocks(tiny64_model_dir, small_corpus, monkeypatch, tmp_path):
    """A decoder's slot holds MAX_SUFFIX tokens at most: where a model's context is longer, knowledge that fits a
    slot is prefilled as rows and longer knowledge in blocks. The method is a function of the knowledge's length:
    the snapshot's key, its header, its freshness and `full` agree on it (cag == full), and a refresh across the
    limit rebuilds."""
    e = keeping_engine(tiny64_model_dir, monkeypatch)
    rows = e.ingest(str(small_corpus))
    how = e.prefill(rows.n_tokens)
    assert how.startswith("rows") and "prefill_rows_max" not in e.facts().info  # the whole context fits a slot
    # a slot of fewer tokens than this corpus, as a 128K model's 32K slot is for 40K tokens of knowledge
    monkeypatch.setattr(knowledge_kv, "MAX_SUFFIX", rows.n_tokens - 1)
    long = keeping_engine(tiny64_model_dir, monkeypatch, CAG_HOME=str(tmp_path / "long"))
    assert long.prefill(rows.n_tokens - 1) == how and long.prefill(rows.n_tokens) == "blocks 16"
    facts = long.facts()
    assert facts.rows_max == rows.n_tokens - 1 and facts.prefill_for(rows.n_tokens) == "blocks 16"
    assert facts.prefill_for(rows.n_tokens - 1) == facts.prefill == how
    r = long.ingest(str(small_corpus))
    meta = snapshots.load(Path(r.path)).meta
    assert meta["prefill"] == "blocks 16" and meta["prefill_block"] == 16 and r.snapshot != rows.snapshot
    assert not long.status("corpus").stale  # built as knowledge of its length is
    assert long.answer(Query("corpus", Q, max_tokens=12, mode="full")).token_ids == \
        long.answer(Query("corpus", Q, max_tokens=12)).token_ids
    (small_corpus / "c.md").write_text("Rye.\n")  # shorter: now within a slot, so rows, nothing reused
    again = long.ingest("corpus")
    assert again.n_tokens < rows.n_tokens - 1 and again.status == "built" and again.reused_tokens == 0
    assert snapshots.load(Path(again.path)).meta["prefill"] == how and not long.status("corpus").stale
    assert long.answer(Query("corpus", Q, max_tokens=12, mode="full")).token_ids == \
        long.answer(Query("corpus", Q, max_tokens=12)).token_ids
