"""The RAG baseline's retriever, and `ask_many`: many questions on one corpus through the one entry point.

Every mode is answered by `Engine.answer(Query(...))` (cag.engine, cag.answering.query). `rag` (a `full` prompt
of the retrieved passages) and `cag+rag` (the snapshot, with the passages quoted before the question) are laid
out in cag.answering.retrieval; the passages come from the Retrieval the Engine was built with, which is
`retrieve` here (cag.rag.index: chunking with the model's tokenizer, BM25, dense where installed, an index
cached per corpus content).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from cag.answering.query import Query
from cag.answering.retrieval import HYBRID_K, QUOTE_HEAD, RAG_K  # noqa: F401 - also used from here
from cag.errors import CagError

from .index import DEFAULT_PASSAGE_TOKENS, PassageIndex, clear_indexes, get_index, index_key, passage_name, retrieve  # noqa: F401 - also used from here


def ask_many(engine, corpus: str, questions: list[str], workers: int | None = None, **kw) -> Iterator:
    """Answer many questions on one corpus, decoded together (cag.runtime.decoder): yields (question, Answer or
    the CagError it raised) in input order. `workers` questions are in flight at once (default
    CAG_MAX_BATCH); the others wait. `kw`: the Query's fields but `corpus` and `question`."""
    from concurrent.futures import ThreadPoolExecutor

    if engine.retrieval is None:
        engine.retrieval = retrieve
    query = Query(corpus, **kw)

    def one(question: str):
        try:
            return question, engine.answer(replace(query, question=question))
        except CagError as e:  # this question's failure; the others go on
            return question, e

    engine.lm  # noqa: B018 - load the model once, before the threads ask for it
    with ThreadPoolExecutor(
        max_workers=max(1, workers or engine.settings.max_batch), thread_name_prefix="cag-ask"
    ) as pool:
        yield from pool.map(one, questions)
