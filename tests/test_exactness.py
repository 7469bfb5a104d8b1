"""The exactness invariant on the tiny model: cached answer == uncached answer, token for token,
for several questions in a row on one loaded snapshot, which is never modified by a question."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from tests.cpu import formats

QUESTIONS = [
    "Who keeps the lighthouse?",
    "When does the ferry leave?",
    "What does the bakery sell on Tuesdays?",
    "Who keeps the lighthouse?",  # asked again: must not see the previous questions
]


def test_cag_equals_full_for_questions_in_a_row(tiny_model_dir, small_corpus, monkeypatch):
    """float32 snapshots: bit-identical state, so identical tokens even on a chaotic random model.
    (float16, the default, is pinned token-for-token on the real model in test_real.py.)"""
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_KV_DTYPE", "float32")
    engine = Engine(get_settings())
    engine.ingest(str(small_corpus))
    cached = [engine.answer(Query("corpus", q, max_tokens=24)).token_ids for q in QUESTIONS]
    full = [engine.answer(Query("corpus", q, max_tokens=24, mode="full")).token_ids for q in QUESTIONS]
    assert all(len(ids) == 24 for ids in cached)  # long enough to mean something
    assert cached == full
    assert cached[0] == cached[3]
    assert len({tuple(ids) for ids in cached[:3]}) > 1  # different questions, different answers


def test_float16_snapshot_is_prefilled_over_float16_keys(tiny_model_dir, small_corpus, monkeypatch):
    """A float16 snapshot's rows are computed attending to float16 keys and values before them (what a
    refresh reads back from the old snapshot: kv_cache.prefill_knowledge): the first layer, before any
    attention, is the float32 state rounded; later layers differ from it by about float16's rounding."""
    from cag.store import snapshots

    paths = {}
    for dtype in ("float32", "float16"):
        monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
        monkeypatch.setenv("CAG_KV_DTYPE", dtype)
        paths[dtype] = Path(Engine(get_settings()).ingest(str(small_corpus)).path)
    s32, s16 = (snapshots.load(paths[d]) for d in ("float32", "float16"))
    assert s16.kv[0][0].dtype == torch.float16 and s32.kv[0][0].dtype == torch.float32
    (k32, v32), (k16, v16) = s32.kv[0], s16.kv[0]
    assert torch.equal(k32.half(), k16) and torch.equal(v32.half(), v16)
    for (k32, v32), (k16, v16) in zip(s32.kv[1:], s16.kv[1:]):
        assert not torch.equal(k32.half(), k16)  # attention read the rounded keys
        torch.testing.assert_close(k16.float(), k32, rtol=0.02, atol=0.02)
        torch.testing.assert_close(v16.float(), v32, rtol=0.02, atol=0.02)
    assert paths["float32"].stat().st_size > 1.9 * paths["float16"].stat().st_size


def test_each_question_alone_equals_in_a_row(tiny_engine, small_corpus):
    tiny_engine.ingest(str(small_corpus))
    in_a_row = [tiny_engine.answer(Query("corpus", q, max_tokens=16)).token_ids for q in QUESTIONS[:3]]
    alone = []
    for q in QUESTIONS[:3]:
        tiny_engine.evict()  # drop the resident snapshot: load from the file again
        alone.append(tiny_engine.answer(Query("corpus", q, max_tokens=16)).token_ids)
    assert in_a_row == alone


def test_asking_never_mutates_the_loaded_snapshot(tiny_engine, small_corpus):
    """The resident prefix is shared by every request on it, alone or batched: nobody writes it."""
    from concurrent.futures import ThreadPoolExecutor

    tiny_engine.ingest(str(small_corpus))
    tiny_engine.answer(Query("corpus", "warm up", max_tokens=4))
    (res,) = tiny_engine.resident.values()
    before = [(k.clone(), v.clone()) for k, v in res.prefix.kv]
    for q in QUESTIONS:
        tiny_engine.answer(Query("corpus", q, max_tokens=8))
    with ThreadPoolExecutor(4) as pool:  # decoded together
        list(pool.map(lambda q: tiny_engine.answer(Query("corpus", q, max_tokens=8)), QUESTIONS))
    assert tiny_engine.resident.values()[0] is res
    for (k0, v0), (k1, v1) in zip(before, res.prefix.kv):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_matches_transformers_generate(tiny_engine, small_corpus):
    """An independent reference: HF generate with its own DynamicCache on the same prompt ids."""
    from cag.model.prompt import build_prefix, build_suffix

    tiny_engine.ingest(str(small_corpus))
    ans = tiny_engine.answer(Query("corpus", QUESTIONS[1], max_tokens=12))
    lm = tiny_engine.lm
    docs, _ = tiny_engine.read_corpus(small_corpus, "corpus")
    ids = build_prefix(lm.tokenizer, tiny_engine.layout(), [(d.name, d.text) for d in docs]).ids
    ids += build_suffix(lm.tokenizer, tiny_engine.layout(), QUESTIONS[1])
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert out[0, len(ids):].tolist()[: len(ans.token_ids)] == ans.token_ids


def test_prefill_chunking_does_not_change_the_answer(tiny_model_dir, small_corpus, monkeypatch):
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    answers = []
    for chunk in (7, 512):
        monkeypatch.setenv("CAG_CHUNK_TOKENS", str(chunk))
        monkeypatch.setenv("CAG_HOME", str(small_corpus.parent / f"home-{chunk}"))
        engine = Engine(get_settings())
        engine.ingest(str(small_corpus))
        answers.append(engine.answer(Query("corpus", QUESTIONS[0], max_tokens=16)).token_ids)
    assert answers[0] == answers[1]


def test_bfloat16_compute_with_bfloat16_snapshots_is_exact(tiny_model_dir, small_corpus, monkeypatch):
    """The snapshot stores exactly the computed state when both dtypes match: identical tokens."""
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_DTYPE", "bfloat16")
    monkeypatch.setenv("CAG_KV_DTYPE", "bfloat16")
    engine = Engine(get_settings())
    assert engine.lm.dtype == torch.bfloat16
    engine.ingest(str(small_corpus))
    for q in QUESTIONS[:2]:
        assert (
            engine.answer(Query("corpus", q, max_tokens=16)).token_ids
            == engine.answer(Query("corpus", q, max_tokens=16, mode="full")).token_ids
        )


def test_index_and_engine_work_from_other_threads(tiny_engine, small_corpus):
    """The server calls the engine from worker threads: each gets its own SQLite connection."""
    from concurrent.futures import ThreadPoolExecutor

    tiny_engine.ingest(str(small_corpus))
    alone = [tiny_engine.answer(Query("corpus", q, max_tokens=8)).token_ids for q in QUESTIONS]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda q: tiny_engine.answer(Query("corpus", q, max_tokens=8)).token_ids, QUESTIONS))
    assert together == alone
    pieces: list[str] = []
    answer = tiny_engine.answer(Query("corpus", QUESTIONS[0], max_tokens=8), on_text=pieces.append)
    assert "".join(pieces).strip() == answer.answer and answer.token_ids == alone[0]


@pytest.mark.parametrize("weights", formats("fp32", "bf16", "int8", "int4"))
def test_cag_equals_full_in_every_weights_format(tiny_model_dir, small_corpus, monkeypatch, weights):
    """Decode runs on packed weights in each format; the snapshot path and the no-cache path decode
    through the same modules, so they agree token for token within a format."""
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_KV_DTYPE", "float32")
    monkeypatch.setenv("CAG_WEIGHTS", weights)
    engine = Engine(get_settings())
    assert engine.lm.weights == weights and (engine.lm.packed_bytes > 0) == (weights != "fp32")
    engine.ingest(str(small_corpus))
    for q in QUESTIONS[:3]:
        cached = engine.answer(Query("corpus", q, max_tokens=16))
        assert len(cached.token_ids) == 16 and cached.decode_tok_s
        assert cached.token_ids == engine.answer(Query("corpus", q, max_tokens=16, mode="full")).token_ids


@pytest.mark.parametrize("weights", formats("fp32", "bf16"))
def test_cag_equals_full_over_a_snapshot_stored_in_another_dtype(tiny_model_dir, small_corpus, monkeypatch, weights):
    """A snapshot stored as float16 while the setting now means bfloat16 (CAG_KV_DTYPE changed, or
    `auto` resolves otherwise) is stale but served as stored: `full` must hold its fresh K/V at the
    precision `cag` reads (float16, then what decode attends in), not at the setting's, or a double
    rounding on one side moves the answer."""
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", weights)
    monkeypatch.setenv("CAG_KV_DTYPE", "float16")
    Engine(get_settings()).ingest(str(small_corpus))
    monkeypatch.setenv("CAG_KV_DTYPE", "bfloat16")
    engine = Engine(get_settings())
    assert any("float16" in r for r in engine.status("corpus").reasons)
    questions = QUESTIONS[:3] + ["Where is the harbour?", "What is sold at the market?", "Who rings the bell?"]
    for q in questions:
        cached = engine.answer(Query("corpus", q, max_tokens=24))
        assert cached.token_ids == engine.answer(Query("corpus", q, max_tokens=24, mode="full")).token_ids, q
