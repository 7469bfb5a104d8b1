"""`cag+rag` (cag.answering.retrieval, Engine.answer): the snapshot as the prefix, the top-k passages quoted before the
question; exact (== the same prompt with no cache) alone, batched and in a conversation, on one snapshot and on shards,
and what does not fit is said."""

from __future__ import annotations

import threading

import pytest

from cag.answering import retrieval
from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.errors import BadInput
from cag.rag.index import retrieve

Q = "Who keeps the lighthouse?"


def ask(engine, corpus, question, **kw):
    return engine.answer(Query(corpus, question, **kw))


def quoted_messages(monkeypatch) -> list:
    """The conversations cag+rag answers (its quote in the last user message), as they are made."""
    seen: list = []
    real = retrieval.messages_with_quote
    monkeypatch.setattr(retrieval, "messages_with_quote", lambda *a: seen.append(real(*a)) or seen[-1])
    return seen


def with_no_cache(engine, corpus, question, seen: list, **kw):
    """The prompt cag+rag answered last (`seen`: quoted_messages), prefilled again with no cache (`full`),
    routed by the question as cag+rag routes."""
    return ask(engine, corpus, None, mode="full", messages=seen[-1], search=question, **kw)


@pytest.fixture
def engine(tiny_engine, small_corpus):
    tiny_engine.ingest(str(small_corpus))
    return tiny_engine


def test_the_quote_is_the_top_passages_before_the_question(engine):
    a = ask(engine, "corpus", Q, mode="cag+rag", k=2, max_tokens=12)
    assert a.mode == "cag+rag" and a.snapshot and a.retrieval_ms > 0
    assert [p["quoted"] for p in a.passages] == [True, True] and a.passages[0]["doc_id"] == "a.md"
    plain = ask(engine, "corpus", Q, mode="cag", max_tokens=12)
    assert a.cached_tokens == plain.cached_tokens  # the snapshot stays the prefix
    assert a.prompt_tokens > plain.prompt_tokens + sum(p["n_tokens"] for p in a.passages)  # the quote is prefilled


def test_cag_rag_equals_the_same_prompt_with_no_cache_alone_batched_and_in_a_conversation(engine, monkeypatch):
    seen = quoted_messages(monkeypatch)
    one = ask(engine, "corpus", Q, mode="cag+rag", k=2, max_tokens=12)
    none = with_no_cache(engine, "corpus", Q, seen, max_tokens=12)
    assert one.token_ids == none.token_ids and none.cached_tokens == 0
    out: dict = {}
    threads = [
        threading.Thread(
            target=lambda i=i: out.update({i: ask(engine, "corpus", Q, mode="cag+rag", k=2, max_tokens=12)})
        )
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i].token_ids for i in range(3)] == [one.token_ids] * 3
    messages = [{"role": "user", "content": Q}, {"role": "assistant", "content": one.answer or "..."},
                {"role": "user", "content": "And when does the ferry leave?"}]
    turn = ask(engine, "corpus", None, mode="cag+rag", k=2, max_tokens=12, messages=messages)
    again = with_no_cache(engine, "corpus", "\n".join([Q, messages[2]["content"]]), seen, max_tokens=12)
    assert turn.token_ids == again.token_ids and "b.txt" in [p["doc_id"] for p in turn.passages]  # the follow-up's


def test_the_quote_goes_in_the_last_user_message_only(engine, monkeypatch):
    seen = quoted_messages(monkeypatch)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q},
                {"role": "assistant", "content": "Mara."}, {"role": "user", "content": "And the ferry?"}]
    ask(engine, "corpus", None, mode="cag+rag", k=1, max_tokens=4, messages=messages)
    sent = seen[0]
    assert sent[:3] == messages[:3] and sent[3]["content"].startswith(retrieval.QUOTE_HEAD)
    assert sent[3]["content"].endswith("Question: And the ferry?") and messages[3]["content"] == "And the ferry?"


def test_passages_that_do_not_fit_are_left_out_and_said(tiny_model_dir, small_corpus, monkeypatch):
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    e = Engine(get_settings(), retrieval=retrieve)
    e.ingest(str(small_corpus))
    plain = e.answer(Query("corpus", Q, max_tokens=4))
    # room for one passage or two, not three
    monkeypatch.setattr(e.lm, "max_context", plain.prompt_tokens + 4 + 8 + 100)
    a = ask(e, "corpus", Q, mode="cag+rag", k=3, max_tokens=4)
    assert 0 < sum(p["quoted"] for p in a.passages) < 3 and "fit the context" in a.warnings[-1]


def test_bad_k_and_an_engine_with_no_retriever_refuse_it(engine, tiny_model_dir, monkeypatch):
    with pytest.raises(BadInput, match="k must be at least 1"):
        ask(engine, "corpus", Q, mode="cag+rag", k=0)
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    for mode in ("cag+rag", "rag"):
        with pytest.raises(BadInput, match="needs a retriever"):
            Engine(get_settings()).answer(Query("corpus", Q, mode=mode))


def test_quote_tokens_sets_the_quoted_passages_size(tiny_model_dir, small_corpus, monkeypatch):
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_QUOTE_TOKENS", "8")
    e = Engine(get_settings(), retrieval=retrieve)
    e.ingest(str(small_corpus))
    a = ask(e, "corpus", Q, mode="cag+rag", k=3, max_tokens=4)
    assert all(p["n_tokens"] <= 8 for p in a.passages) and any(p["index"] > 0 for p in a.passages)


def test_on_shards_it_answers_from_its_best_passages_shard_and_quotes_from_any_shard(tiny_engine, tmp_path,
                                                                                      monkeypatch):
    """A sharded corpus: the shard holding most retrieved passages answers (here one each: the best ranked's, which
    is the question's own shard), and the quote brings passages of the other shards; == the same prompt with no
    cache (cag.answering.quotes.routes; tests/test_quotes.py has the rule itself)."""
    from tests.test_shards import ASKS, DOCS, _shard_tokens

    town = tmp_path / "town"
    town.mkdir()
    for name, text in DOCS.items():
        (town / name).write_text(text + "\n")
    tiny_engine.ingest(str(town), name="town", shard_tokens=_shard_tokens(tiny_engine, town, 1))
    seen = quoted_messages(monkeypatch)
    for doc, q in ASKS.items():
        plain = tiny_engine.answer(Query("town", q, max_tokens=4))
        a = ask(tiny_engine, "town", q, mode="cag+rag", k=4, max_tokens=8)
        assert a.shards[0]["shard"] == plain.shards[0]["shard"], doc
        assert sum(p["quoted"] for p in a.passages) == 4  # every document: three from other shards
        assert a.token_ids == with_no_cache(tiny_engine, "town", q, seen, max_tokens=8).token_ids


def test_bad_and_edge_inputs_answer_or_refuse_in_one_line(engine, tiny_engine, tmp_path):
    """k past the passages quotes them all; a one-document corpus and a question of stopwords only (every passage
    scores 0: the first ones in corpus order) still answer; the quote is deterministic, ties in passage order."""
    many = ask(engine, "corpus", Q, mode="cag+rag", k=50, max_tokens=4)
    assert len(many.passages) == 3 and all(p["quoted"] for p in many.passages)
    one = tmp_path / "one"
    one.mkdir()
    (one / "only.md").write_text("The lighthouse keeper is Mara Voss.\n")
    tiny_engine.ingest(str(one))
    a = ask(tiny_engine, "one", Q, mode="cag+rag", max_tokens=4)
    assert [p["doc_id"] for p in a.passages] == ["only.md"]
    stop = [ask(engine, "corpus", "what is it?", mode="cag+rag", k=2, max_tokens=4) for _ in range(2)]
    assert [p["score"] for p in stop[0].passages] == [0.0, 0.0]
    assert [p["doc_id"] for p in stop[0].passages] == ["a.md", "b.txt"]  # ties: passage order (rag.retrieve)
    assert stop[0].passages == stop[1].passages and stop[0].token_ids == stop[1].token_ids
