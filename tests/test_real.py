"""Tier 2: the real embedded SmolLM2-135M on corpora/handbook (float16 snapshots, the default)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cag.answering.query import Query

from .conftest import HANDBOOK

pytestmark = pytest.mark.real

QUESTIONS = [json.loads(line)["question"] for line in (HANDBOOK / "questions.jsonl").read_text().splitlines()[:4]]


def test_real_model_cag_equals_full_token_for_token(real_engine):
    r = real_engine.ingest(str(HANDBOOK))
    assert 2000 <= r.n_tokens <= 4000 and r.skipped == ["questions.jsonl"]
    cached = [real_engine.answer(Query("handbook", q, max_tokens=24)) for q in QUESTIONS]
    full = [real_engine.answer(Query("handbook", q, max_tokens=24, mode="full")) for q in QUESTIONS]
    assert [a.token_ids for a in cached] == [a.token_ids for a in full]
    assert all(a.completion_tokens > 0 for a in cached)
    assert all(a.cached_tokens == r.n_tokens for a in cached)


def test_cli_end_to_end_in_a_subprocess(cag_home, models_dir):
    env = dict(os.environ, CAG_HOME=str(cag_home), CAG_MODELS_DIR=str(models_dir))
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "cag", *a], env=env, capture_output=True, text=True, timeout=600
    )
    ing = run("ingest", str(HANDBOOK), "--json")
    assert ing.returncode == 0, ing.stderr
    info = json.loads(ing.stdout)
    assert info["status"] == "built" and info["corpus"] == "handbook"
    ask = run("ask", "handbook", QUESTIONS[0], "--max-tokens", "16", "--json")
    assert ask.returncode == 0, ask.stderr
    ans = json.loads(ask.stdout)
    assert ans["mode"] == "cag" and ans["cached_tokens"] == info["n_tokens"] and ans["answer"]
    st = json.loads(run("status", "handbook", "--json").stdout)
    assert st["stale"] is False and st["n_tokens"] == info["n_tokens"]


def test_real_model_conversation_is_exact_kept_recomputed_full_and_batched(real_engine):
    """Three turns on the handbook, each answer the history's: the kept conversation, the same turn
    recomputed from the snapshot alone, `full`, and two conversations at once all agree token for token."""
    import threading

    real_engine.ingest(str(HANDBOOK))

    def converse(questions, mode="cag"):
        messages, out = [{"role": "system", "content": "Answer in one short sentence."}], []
        for q in questions:
            messages.append({"role": "user", "content": q})
            a = real_engine.answer(Query("handbook", None, mode=mode, max_tokens=16, messages=messages))
            out.append(a)
            messages.append({"role": "assistant", "content": a.answer})
        return out, messages

    kept, messages = converse(QUESTIONS[:3])
    keeps = real_engine.decoder.step.flat  # kept where every row is a decode row (cag's kernels)
    assert [a.conversation_tokens > 0 for a in kept] == [False, keeps, keeps]
    real_engine.kept.clear()
    again = real_engine.answer(Query("handbook", None, max_tokens=16, messages=messages[:-1]))
    full, _ = converse(QUESTIONS[:3], mode="full")
    assert again.conversation_tokens == 0 and again.token_ids == kept[-1].token_ids
    assert [a.token_ids for a in full] == [a.token_ids for a in kept]
    real_engine.kept.clear()
    together = {}
    threads = [threading.Thread(target=lambda i=i, qs=qs: together.__setitem__(i, converse(qs)[0]))
               for i, qs in enumerate([QUESTIONS[:3], QUESTIONS[1:4]])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [a.token_ids for a in together[0]] == [a.token_ids for a in kept]
    assert [a.token_ids for a in together[1]] == [a.token_ids for a in converse(QUESTIONS[1:4])[0]]


def test_real_model_cag_rag_is_exact_alone_batched_warmed_and_in_three_turns(real_engine, monkeypatch):
    """cag+rag on the handbook with the real model: == the same messages with no cache (`full`), alone, two at
    once, after its quotes are warmed, and on the third turn of a conversation (`full` prefills the handbook for
    each check: two questions and one conversation keep the test short)."""
    import threading

    from .test_hybrid import quoted_messages, with_no_cache

    real_engine.ingest(str(HANDBOOK))
    seen = quoted_messages(monkeypatch)
    qs = QUESTIONS[:2]
    alone = [real_engine.answer(Query("handbook", q, mode="cag+rag", max_tokens=12)) for q in qs]
    for q, a, sent in zip(qs, alone, list(seen)):
        assert a.passages[0]["quoted"] and a.token_ids == with_no_cache(real_engine, "handbook", q, [sent],
                                                                         max_tokens=12).token_ids
    real_engine.kept.clear()
    together: dict = {}
    threads = [threading.Thread(target=lambda i=i, q=q: together.__setitem__(
        i, real_engine.answer(Query("handbook", q, mode="cag+rag", max_tokens=12)))) for i, q in enumerate(qs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[i].token_ids for i in range(2)] == [a.token_ids for a in alone]
    real_engine.kept.clear()
    w = real_engine.warm_quotes("handbook")
    warm = [real_engine.answer(Query("handbook", q, mode="cag+rag", max_tokens=12)) for q in qs]
    assert [a.token_ids for a in warm] == [a.token_ids for a in alone]
    if real_engine.decoder.keeps:
        assert w.passages > 0 and all(a.conversation_tokens > 0 for a in warm)
    messages: list = []
    for q in QUESTIONS[:3]:
        messages.append({"role": "user", "content": q})
        a = real_engine.answer(Query("handbook", None, mode="cag+rag", max_tokens=12, messages=messages))
        messages.append({"role": "assistant", "content": a.answer})
    assert a.token_ids == with_no_cache(real_engine, "handbook", q, seen, max_tokens=12).token_ids  # one snapshot
