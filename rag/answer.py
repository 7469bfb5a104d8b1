"""The RAG baseline's answer path: chunk, retrieve top-k, lay out, prefill, decode.

Fairness with `cag`/`full` is by construction: the prompt is built with the same
`build_prefix`/`build_suffix` and the same chat layout, the retrieved passages simply take
the place of the documents, and decoding goes through the same `Engine.answer_prompt` with the
same DecodeConfig and stop tokens. Put differently, a RAG prompt is exactly the `full` prompt
of a corpus made only of the retrieved passages:

* passages are listed in corpus order (documents in corpus order, then passage index), not
  in score order, just as `full` lists whole documents;
* a passage is named after its document with the passage index before the suffix
  (``handbook/leave.md`` passage 2 -> ``handbook/leave#2.md``), so a folder holding the
  passages under those names, asked in `full` mode, gives the same tokens and the same answer
  (tests/test_rag_answer.py pins this).

Passages are cut with the model's own tokenizer (`DEFAULT_PASSAGE_TOKENS` = 384 tokens,
no overlap). The chunked passages and the built retriever are cached per corpus content
(document names + content hashes, tokenizer, passage size, retriever kind), so repeated
questions do not re-index; an edited document changes the key and the index is rebuilt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cag.errors import BadInput, CagError, TooLarge
from cag.model.prompt import build_prefix
from cag.results import Mode
from cag.runtime.generate import stop_at

from .hybrid import HYBRID_K, answer_hybrid
from .index import DEFAULT_PASSAGE_TOKENS, PassageIndex, clear_indexes, get_index, index_key, passage_name  # noqa: F401 - also used from here

RAG_K = 3  # passages a `rag` answer reads by default (docs/comparison.md)


def answer_rag(engine, q, k: int = 3, retriever: str = "bm25", on_text: Callable[[str], None] | None = None,
               should_stop: Callable[[], bool] | None = None, passage_tokens: int = DEFAULT_PASSAGE_TOKENS):
    """Answer a checked question `q` (cag.engine.Question) from the top-k passages of its corpus."""
    if k < 1:
        raise BadInput("k must be at least 1")
    docs, _ = engine.read_corpus(Path(q.row["source"]), q.corpus)

    t0 = time.perf_counter()
    idx, _cached = get_index(engine, docs, retriever, passage_tokens)
    hits = idx.retriever.search(q.search_text, k)
    retrieval_ms = (time.perf_counter() - t0) * 1e3

    order = {d.name: i for i, d in enumerate(docs)}
    chosen = sorted(hits, key=lambda h: (order[h[0].doc_id], h[0].index))  # corpus order, like `full`
    prefix = build_prefix(engine.lm.tokenizer, engine.layout(), [(passage_name(p.doc_id, p.index), p.text) for p, _ in chosen])
    if not engine.lm.fits(len(prefix.ids), engine.room):
        raise TooLarge(f"{len(chosen)} passages are {len(prefix.ids)} tokens; too large for the model's context of "
                       f"{engine.lm.max_context} with {engine.room} reserved for question and answer; use a smaller k")
    passages = [{"doc_id": p.doc_id, "index": p.index, "score": round(s, 4), "name": passage_name(p.doc_id, p.index),
                 "n_tokens": p.n_tokens} for p, s in hits]
    return engine.answer_prompt(q, prefix.ids, on_text, should_stop, retrieval_ms=round(retrieval_ms, 2), passages=passages)


def ask(engine, corpus: str, question: str | None, mode: str = "cag", max_tokens: int | None = None,
        on_text: Callable[[str], None] | None = None, should_stop: Callable[[], bool] | None = None,
        on_stale: str = "serve", decoding=None, k: int | None = None, retriever: str = "bm25", shards: int = 1,
        messages: list | None = None, scope: str | None = None):
    """Answer in any mode: `cag` and `full` are the engine's own; `rag` and `cag+rag` are built here, above it.
    The one entry point for the CLI, the API and the comparison runner. `messages`: a conversation
    (cag.answering.chat) in place of `question`; RAG retrieves by its latest user messages and answers with the
    whole conversation after the passages, as `cag` and `full` do after the knowledge. `scope`: whose kept
    conversations a `cag` answer may reuse (an API key's; cag.runtime.kept_conversations)."""
    k = k if k is not None else HYBRID_K if mode == Mode.HYBRID.value else RAG_K
    if mode == Mode.HYBRID.value:
        a = answer_hybrid(engine, corpus, question, k, retriever, messages, max_tokens=max_tokens, on_text=on_text,
                          should_stop=should_stop, on_stale=on_stale, decoding=decoding, shards=shards, scope=scope)
    elif mode != Mode.RAG.value:
        a = engine.ask(corpus, question, mode=mode, max_tokens=max_tokens, on_text=on_text,
                       should_stop=should_stop, on_stale=on_stale, decoding=decoding, shards=shards, messages=messages,
                       scope=scope)
    else:
        q = engine.check(corpus, question, mode, max_tokens, on_stale, decoding, messages)
        a = answer_rag(engine, q, k, retriever, on_text, should_stop)
    if decoding is not None and decoding.stop:  # the decoder cut the text there and decoded no further
        a.stopped = stop_at(engine.lm.tokenizer.decode(a.token_ids, skip_special_tokens=True), decoding.stop) is not None
    return a


def ask_many(engine, corpus: str, questions: list[str], workers: int | None = None, **kw) -> Iterator:
    """Answer many questions on one corpus, decoded together (cag.runtime.decoder): yields (question, Answer or
    the CagError it raised) in input order. `workers` questions are in flight at once (default
    CAG_MAX_BATCH); the others wait. `kw` are `ask`'s options."""
    from concurrent.futures import ThreadPoolExecutor

    def one(question: str):
        try:
            return question, ask(engine, corpus, question, **kw)
        except CagError as e:  # this question's failure; the others go on
            return question, e

    engine.lm  # noqa: B018 - load the model once, before the threads ask for it
    with ThreadPoolExecutor(max_workers=max(1, workers or engine.settings.max_batch), thread_name_prefix="cag-ask") as pool:
        yield from pool.map(one, questions)
