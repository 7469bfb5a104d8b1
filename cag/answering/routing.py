"""Which shard answers a question: BM25 (bm25s) over short passages of every shard's text; a shard
scores as its best passage. A question's evidence is usually one passage, so the best passage
ranks shards better than a whole-shard bag of words, where long shards dilute short answers."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

PASSAGE_WORDS = 120  # passages of about this many words (paragraphs merged or cut)
_cache: OrderedDict[str, Router] = OrderedDict()
_lock = threading.Lock()


@dataclass
class Route:
    shard: int
    score: float


class Router:
    def __init__(self, shard_texts: list[list[str]]):
        import bm25s

        self.n_shards = len(shard_texts)
        self.owner: list[int] = []
        passages: list[str] = []
        for shard, texts in enumerate(shard_texts):
            for text in texts:
                for p in _passages(text):
                    passages.append(p)
                    self.owner.append(shard)
        self._bm25s = bm25s
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(passages, stopwords="en", show_progress=False), show_progress=False)
        self.n_passages = len(passages)

    def route(self, question: str, k: int) -> list[Route]:
        """The k best shards, best first; ties go to the earlier shard."""
        terms = list(self._bm25s.tokenize([question], stopwords="en", return_ids=False, show_progress=False)[0])
        scores = self.retriever.get_scores(terms) if terms else np.zeros(self.n_passages)  # only stopwords: all 0
        best = np.zeros(self.n_shards)
        np.maximum.at(best, np.asarray(self.owner, dtype=int), np.asarray(scores, dtype=float))
        order = np.argsort(-best, kind="stable")[: max(1, min(k, self.n_shards))]
        return [Route(int(s), float(best[s])) for s in order]


def _passages(text: str) -> list[str]:
    out: list[str] = []
    current: list[str] = []
    for para in re.split(r"\n\s*\n|\n", text):
        words = para.split()
        while words:
            room = PASSAGE_WORDS - len(current)
            current += words[:room]
            words = words[room:]
            if len(current) >= PASSAGE_WORDS:
                out.append(" ".join(current))
                current = []
    if current:
        out.append(" ".join(current))
    return out or [text]


def router_for(key: str, shard_texts) -> Router:
    """The router of one sharded corpus state (`key`: its shard snapshots), built once and kept."""
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    router = Router(shard_texts() if callable(shard_texts) else shard_texts)
    with _lock:
        _cache[key] = router
        while len(_cache) > 64:  # a BM25 index of one corpus's passages: small; comparison runs hold many
            _cache.popitem(last=False)
    return router
