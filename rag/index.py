"""The retrieval index of a corpus: its passages (cut with the model's tokenizer) and a built retriever,
cached per content (document names + content hashes, tokenizer, passage size, retriever kind), so
repeated questions do not re-index and an edited document rebuilds it. Used by `rag` and `cag+rag`."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import PurePosixPath

from cag.errors import BadInput
from cag.hashing import hash_obj
from cag.model.prompt import encode_text

from .chunking import DEFAULT_TARGET_TOKENS, Passage, chunk_documents
from .retrieve import RETRIEVER_KINDS, Retriever, RetrieverUnavailable, make_retriever

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


def passage_name(doc_id: str, index: int) -> str:
    """``dir/a.md`` passage 2 -> ``dir/a#2.md``: doc id + passage index, suffix kept last."""
    p = PurePosixPath(doc_id)
    if not p.suffix:
        return f"{doc_id}#{index}"
    return str(p.with_name(f"{p.stem}#{index}{p.suffix}"))


def index_key(docs: list[tuple[str, str]], kind: str, passage_tokens: int, tokenizer_fingerprint: str) -> str:
    """docs: (name, content hash) in corpus order."""
    return hash_obj({"docs": [list(d) for d in docs], "kind": kind, "passage_tokens": passage_tokens,
                     "tokenizer": tokenizer_fingerprint})


def get_index(engine, docs, kind: str = "bm25", passage_tokens: int = DEFAULT_PASSAGE_TOKENS) -> tuple[PassageIndex, bool]:
    """The retriever for these documents (engine `Document`s), built once per content; (index, was_cached)."""
    if kind not in RETRIEVER_KINDS:
        raise BadInput(f"unknown retriever {kind!r}; use one of {', '.join(RETRIEVER_KINDS)}")
    lm = engine.lm
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
