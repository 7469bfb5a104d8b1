"""The retrieval index of a corpus: its passages (cut with the model's tokenizer) and a built retriever,
cached per content (document names + content hashes, tokenizer, passage size, retriever kind), so
repeated questions do not re-index and an edited document rebuilds it. `retrieve` is the Retrieval an Engine is
given for `rag` and `cag+rag` (cag.answering.retrieval lays out what it returns)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cag.answering.retrieval import Document, passage_name  # noqa: F401 - passage_name: also used from here
from cag.errors import BadInput
from cag.hashing import hash_obj
from cag.model.prompt import encode_text

from .chunking import DEFAULT_TARGET_TOKENS, Passage, chunk_documents
from .retrieve import RETRIEVER_KINDS, Retriever, RetrieverUnavailable, make_retriever

if TYPE_CHECKING:
    from cag.model.loading import LoadedModel

DEFAULT_PASSAGE_TOKENS = DEFAULT_TARGET_TOKENS  # 384 tokens of the model's tokenizer
MAX_CACHED_INDEXES = 8


@dataclass
class PassageIndex:
    """A built retriever over one corpus's passages, and what building it cost."""

    key: str
    passages: list[Passage]
    retriever: Retriever
    build_ms: float  # chunking + indexing (dense: + embedding every passage)
    kind: str
    passage_tokens: int


_indexes: OrderedDict[str, PassageIndex] = OrderedDict()
_indexes_lock = threading.Lock()


def index_key(docs: list[tuple[str, str]], kind: str, passage_tokens: int, tokenizer_fingerprint: str) -> str:
    """docs: (name, content hash) in corpus order."""
    return hash_obj({"docs": [list(d) for d in docs], "kind": kind, "passage_tokens": passage_tokens,
                     "tokenizer": tokenizer_fingerprint})


def retrieve(docs: Sequence[Document], query: str, k: int, kind: str, passage_tokens: int | None,
             lm: LoadedModel) -> list[tuple[Passage, float]]:
    """The k best passages of `docs` for `query`, best first: the Retrieval an Engine is given for `rag` and
    `cag+rag` (cag.answering.retrieval); passages of `passage_tokens` (None: DEFAULT_PASSAGE_TOKENS)."""
    idx, _ = index_for(lm, docs, kind, passage_tokens or DEFAULT_PASSAGE_TOKENS)
    return idx.retriever.search(query, k)


def get_index(
    engine, docs, kind: str = "bm25", passage_tokens: int = DEFAULT_PASSAGE_TOKENS
) -> tuple[PassageIndex, bool]:
    """The retriever for these documents (engine `Document`s) and `engine`'s model (index_for)."""
    return index_for(engine.lm, docs, kind, passage_tokens)


def index_for(lm: LoadedModel, docs: Sequence[Document], kind: str = "bm25",
              passage_tokens: int = DEFAULT_PASSAGE_TOKENS) -> tuple[PassageIndex, bool]:
    """The retriever for these documents, cut with `lm`'s tokenizer, built once per content; (index, was_cached)."""
    if kind not in RETRIEVER_KINDS:
        raise BadInput(f"unknown retriever {kind!r}; use one of {', '.join(RETRIEVER_KINDS)}")
    key = index_key([(d.name, d.content_hash) for d in docs], kind, passage_tokens, lm.tokenizer_fingerprint)
    with _indexes_lock:
        hit = _indexes.get(key)
        if hit is not None:
            _indexes.move_to_end(key)
            return hit, True
    t0 = time.perf_counter()
    tok = lm.tokenizer
    passages = chunk_documents([(d.name, d.text) for d in docs], lambda s: len(encode_text(tok, s)), passage_tokens)
    if not passages:
        raise BadInput("the corpus has no text to retrieve from")
    try:
        retriever = make_retriever(kind, passages)
    except RetrieverUnavailable as e:
        raise BadInput(str(e)) from None
    built = PassageIndex(key, passages, retriever, (time.perf_counter() - t0) * 1e3, kind, passage_tokens)
    with _indexes_lock:
        _indexes[key] = built
        _indexes.move_to_end(key)
        while len(_indexes) > MAX_CACHED_INDEXES:
            _indexes.popitem(last=False)
    return built, False


def clear_indexes() -> None:
    with _indexes_lock:
        _indexes.clear()
