"""Warmed cag+rag quotes (cag.answering.quotes, Engine.warm_quotes): each passage's quote prefilled after its shard and
kept, so a question quoting it prefills only its own tokens; exact (== the same prompt with no cache), shared across API
keys, bounded by CAG_QUOTE_BYTES; and cag+rag on shards answers from the shard holding its passages."""

from __future__ import annotations

import json

import pytest

from cag.answering import quotes, retrieval
from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.errors import NotFound
from cag.knowledge import shards
from cag.rag.index import retrieve
from tests.test_hybrid import Q, quoted_messages, with_no_cache
from tests.test_shards import ASKS, DOCS, _shard_tokens


def keeping_engine(model_dir, monkeypatch, **env) -> Engine:
    """An engine that keeps conversations (int4 on cag's kernels), skipped where those do not run."""
    monkeypatch.setenv("CAG_MODEL", str(model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    e = Engine(get_settings(), retrieval=retrieve)
    if not e.decoder.keeps:
        pytest.skip(f"cag's kernels do not run here: {e.lm.kernels_why}")
    return e


def test_the_question_free_prefix_ends_where_the_question_begins(tiny_engine):
    tok = tiny_engine.lm.tokenizer
    ids = quotes.question_free(tok, "a#0.md", "The keeper is Mara.")
    for question in ("Who keeps it?", "what, and why?", "Z"):
        full = retrieval.quoted([("a#0.md", "The keeper is Mara.")], question)
        assert tok.encode(full, add_special_tokens=False)[: len(ids)] == ids
    assert tok.decode(ids).rstrip().endswith("Question:")


def test_a_warmed_quote_is_reused_and_the_answer_is_exact(tiny64_model_dir, small_corpus, monkeypatch):
    e = keeping_engine(tiny64_model_dir, monkeypatch)
    e.ingest(str(small_corpus))
    cold = e.answer(Query("corpus", Q, mode="cag+rag", k=1, max_tokens=12))  # before warming: the quote prefilled
    e.kept.clear()  # its kept conversation: the warmed quote is what is reused below
    w = e.warm_quotes("corpus")
    assert w.passages >= 2 and w.cold == 0 and w.tokens > 0 and w.reason is None
    assert e.quotes.nbytes == w.kept_bytes == e.lm.kv_bytes(w.tokens, e.lm.attn_dtype)
    seen = quoted_messages(monkeypatch)
    warm = e.answer(Query("corpus", Q, mode="cag+rag", k=1, max_tokens=12))
    assert warm.token_ids == cold.token_ids  # the same tokens, warmed or not
    # every token before the question's own was kept: only the question and the template's tail are prefilled
    question_tokens = len(e.lm.tokenizer.encode(" " + Q, add_special_tokens=False))
    assert cold.conversation_tokens == 0 and warm.prompt_tokens == cold.prompt_tokens
    assert warm.prompt_tokens - warm.cached_tokens <= question_tokens + 12 < warm.conversation_tokens
    none = with_no_cache(e, "corpus", Q, seen, max_tokens=12)
    assert none.token_ids == warm.token_ids and none.conversation_tokens == 0
    scoped = e.answer(Query("corpus", Q, mode="cag+rag", k=1, max_tokens=12, scope="key-b"))
    assert scoped.token_ids == warm.token_ids and scoped.conversation_tokens > 40  # no user's words: shared


def test_k3_reuses_the_first_quoted_passage(tiny64_model_dir, small_corpus, monkeypatch):
    e = keeping_engine(tiny64_model_dir, monkeypatch)
    e.ingest(str(small_corpus))
    e.warm_quotes("corpus")
    seen = quoted_messages(monkeypatch)
    a = e.answer(Query("corpus", Q, mode="cag+rag", k=3, max_tokens=12))
    assert a.conversation_tokens > 16 and a.token_ids == with_no_cache(e, "corpus", Q, seen, max_tokens=12).token_ids


def test_the_budget_leaves_passages_cold_and_says_so(tiny64_model_dir, small_corpus, monkeypatch):
    e = keeping_engine(tiny64_model_dir, monkeypatch)
    e.ingest(str(small_corpus))
    one = e.warm_quotes("corpus")
    e.quotes.clear(), e.kept.clear()  # run 1's quotes and its questions' kept conversations
    e.quotes.budget_bytes = one.kept_bytes - 1  # every passage but (at least) the last
    w = e.warm_quotes("corpus")
    assert 0 < w.passages < one.passages and w.cold == one.passages - w.passages
    assert "CAG_QUOTE_BYTES" in (w.reason or "") and e.quotes.nbytes <= e.quotes.budget_bytes


def test_warming_refuses_unknown_and_unbuilt_corpora_and_keeps_nothing_off_the_flat_path(
        tiny_engine, tiny_model_dir, small_corpus, monkeypatch):
    with pytest.raises(NotFound):
        tiny_engine.warm_quotes("nosuch")
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "fp32")
    e = Engine(get_settings(), retrieval=retrieve)
    e.ingest(str(small_corpus))
    w = e.warm_quotes("corpus")
    assert w.passages == 0 and "cag's kernels" in (w.reason or "") and e.quotes.nbytes == 0


def test_on_shards_each_quote_is_warmed_after_its_own_shard_and_routes_there(tiny64_model_dir, town, monkeypatch):
    e = keeping_engine(tiny64_model_dir, monkeypatch)
    e.ingest(str(town), name="town", shard_tokens=_shard_tokens(e, town, 1))
    owner = shards.owners(e.index, "town")
    assert sorted(owner) == sorted(DOCS) and len(set(owner.values())) == 4
    w = e.warm_quotes("town")
    assert w.passages == 4 and w.cold == 0
    seen = quoted_messages(monkeypatch)
    for doc, q in ASKS.items():
        a = e.answer(Query("town", q, mode="cag+rag", k=1, max_tokens=8))
        top = a.passages[0]["doc_id"]
        assert a.shards[0]["shard"] == owner[top] and a.conversation_tokens > 16, doc
        shard_row = e.index.shards("town")[owner[top]]
        assert a.snapshot == shard_row["snapshot"]
        assert a.token_ids == with_no_cache(e, "town", q, seen, max_tokens=8).token_ids


def test_routes_count_passages_per_shard_ties_to_the_better_ranked():
    class P:
        def __init__(self, doc_id):
            self.doc_id = doc_id

    owner = {"a": 0, "b": 1, "c": 1, "d": 2}
    hits = [(P("d"), 3.0), (P("b"), 2.0), (P("c"), 1.0), (P("gone"), 0.5)]
    assert [(r.shard, r.score) for r in quotes.routes(owner, hits)] == [(1, 2.0), (2, 1.0)]
    assert [r.shard for r in quotes.routes(owner, hits[:1] + hits[3:])] == [2]
    assert quotes.routes(owner, hits[3:]) is None and quotes.routes({}, hits) is None


def _metric(c, name: str) -> float:
    line = next(x for x in c.get("/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_serve_warms_at_start_and_after_a_refresh(tiny64_model_dir, small_corpus, monkeypatch):
    """CAG_WARM_QUOTES: `cag serve`'s engine warms every corpus once the model is loaded (in a thread of its own) and a
    refreshed corpus's new snapshot after its job; a cag+rag question over HTTP then reuses the quote."""
    import time

    from tests.test_api import app_client, wait_job

    e = keeping_engine(tiny64_model_dir, monkeypatch, CAG_WARM_QUOTES="1")
    e.ingest(str(small_corpus))

    def wait_quotes(c, at_least: float) -> float:
        deadline = time.monotonic() + 60
        while (n := _metric(c, "cag_quotes_kept")) < at_least:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return n

    with app_client(e) as c:
        first = wait_quotes(c, 2)
        r = c.post("/v1/ask", json={"corpus": "corpus", "question": Q, "mode": "cag+rag", "k": 1, "max_tokens": 8})
        assert r.status_code == 200 and r.json()["usage"]["conversation_tokens"] > 40, r.text
        assert _metric(c, "cag_quote_hits_total") >= 1 and _metric(c, "cag_quote_bytes") > 0
        (small_corpus / "a.md").write_text((small_corpus / "a.md").read_text() + "\nThe lamp is lit at dusk.\n")
        job = wait_job(c, c.post("/v1/corpora/corpus/refresh").json())
        assert job["status"] == "done"
        wait_quotes(c, first + 1)  # the new snapshot's quotes beside the old ones (LRU)
        r = c.post("/v1/ask", json={"corpus": "corpus", "question": Q, "mode": "cag+rag", "k": 1, "max_tokens": 8})
        assert r.json()["usage"]["conversation_tokens"] > 40


def test_compare_warms_each_set_before_its_first_question(tiny64_model_dir, monkeypatch, tmp_path):
    """`cag compare` with CAG_WARM_QUOTES warms a set's quotes just before its first question: with room for one
    set's quotes only, every set's cag+rag questions still find theirs warm (warming every set first would have
    evicted the early sets' quotes before their questions)."""
    from cag.compare.run_config import CompareConfig
    from cag.compare.runner import run_compare
    from tests.test_compare import _hotpot_file, _one_question_size

    path = _hotpot_file(tmp_path / "hot.json")
    probe = keeping_engine(tiny64_model_dir, monkeypatch, CAG_HOME=str(tmp_path / "probe"))
    size = _one_question_size(probe, path)
    e = keeping_engine(tiny64_model_dir, monkeypatch, CAG_HOME=str(tmp_path / "home"), CAG_WARM_QUOTES="true")
    lines: list[str] = []
    res = run_compare(e, CompareConfig(str(path), tmp_path / "out", sizes=[size], questions=3, modes=["cag+rag"],
                                       ks=[1], k_main=1, max_tokens=2), log=lines.append, progress=False)
    assert res.complete and len(res.sets) == 3
    warmed = [s.rag_index["cag+rag"]["warmed"] for s in res.sets]
    assert all(w["passages"] > 0 and w["cold"] == 0 for w in warmed)
    e.quotes.clear(), e.kept.clear()  # run 1's quotes and its questions' kept conversations
    e.quotes.budget_bytes = max(w["bytes"] for w in warmed)  # room for the largest set's quotes, not two sets'
    res = run_compare(e, CompareConfig(str(path), tmp_path / "out2", sizes=[size], questions=3, modes=["cag+rag"],
                                       ks=[1], k_main=1, max_tokens=2), log=lines.append, progress=False)
    rows = [json.loads(r) for r in res.out.joinpath("results.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and not any(r.get("error") for r in rows)
    question = {r["qid"]: len(e.lm.tokenizer.encode(r["question"], add_special_tokens=False)) for r in rows}
    for r in rows:  # each question prefilled its own words (and the turn's closing tokens), not its quote
        assert r["prompt_tokens"] - r["cached_tokens"] <= question[r["qid"]] + 12, r
    assert sum(line.count("cag+rag quotes warmed") for line in lines) == 6
