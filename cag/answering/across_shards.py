"""Asking a sharded corpus: route the question to its best shard(s), answer from each chosen
shard's snapshot, keep the answer the model is most confident in.

Routing reads each shard's text from its snapshot's own token ids (what is served, even when the
files on disk moved on), so a router is built once per set of shard snapshots and kept. With
`shards` > 1 every chosen shard answers, each answer is scored by the mean log-probability of its
tokens (kept while decoding), and the best one is returned; its text is
streamed once chosen, since the others were not worth streaming.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cag.answering import routing
from cag.answering.questions import Question
from cag.errors import NotFound, SnapshotCorrupt
from cag.runtime.generate import Generated
from cag.store import snapshots as snapfiles

if TYPE_CHECKING:
    from cag.store.index import Index
    from cag.store.sync import LocalOnly, Shared

# (question, snapshot digest, on_text, should_stop, score) -> (Generated, prefix tokens, load ms, mean log-prob)
Generate = Callable[[Question, str, Callable | None, Callable | None, bool], tuple[Generated, int, float, float | None]]


@dataclass
class ShardAnswer:
    shard: int
    snapshot: str
    score: float  # routing score
    n_tokens: int
    gen: Generated
    load_ms: float
    mean_logprob: float | None  # scored only when several shards answered

    def info(self) -> dict:
        return {
            "shard": self.shard,
            "snapshot": self.snapshot,
            "score": round(self.score, 4),
            "n_tokens": self.n_tokens,
            "mean_logprob": None if self.mean_logprob is None else round(self.mean_logprob, 4),
        }


def route(index: Index, remote: Shared | LocalOnly, tokenizer, corpus: str, text: str,
          k: int) -> tuple[list[dict], list[routing.Route], float]:
    """(shard rows, the k best routes, routing ms). `remote`: the shared store (a shard's file fetched from it)."""
    rows = index.shards(corpus)
    t0 = time.perf_counter()

    def texts() -> list[list[str]]:
        out = []
        for r in rows:
            snap = index.snapshot(r["snapshot"])
            assert snap is not None  # a shard row names a snapshot the index holds (published together)
            try:
                ids = snapfiles.read_ids(remote.ensure_local(r["snapshot"], Path(snap["path"])))
            except snapfiles.SnapshotError as e:
                raise SnapshotCorrupt(f"shard {r['shard']} of {corpus!r}: {e}; run `cag ingest {corpus}`") from None
            spans = index.snapshot_documents(r["snapshot"])
            out.append([tokenizer.decode(ids[s["start"] : s["end"]]) for s in spans])
        return out

    router = routing.router_for("|".join(r["snapshot"] for r in rows), texts)
    routes = router.route(text, k)
    return rows, routes, (time.perf_counter() - t0) * 1e3


def answer(index: Index, remote: Shared | LocalOnly, tokenizer, generate: Generate, q: Question, k: int, on_text,
           should_stop) -> tuple[ShardAnswer, list[ShardAnswer], float]:
    """Answer a checked question from the k best shards of its corpus (see the module doc): (the best, every
    shard's, routing ms). `generate` answers over one resident snapshot."""
    if q.routes:  # cag+rag's: the shards holding its passages (cag.answering.quotes.routes)
        rows, routes, routing_ms = index.shards(q.corpus), q.routes[:k], 0.0
    else:
        rows, routes, routing_ms = route(index, remote, tokenizer, q.corpus, q.search_text, k)
    tried = []
    for rt in routes:
        digest = rows[rt.shard]["snapshot"]
        if index.snapshot(digest) is None:
            raise NotFound(f"shard {rt.shard} of {q.corpus!r} has no snapshot: run `cag ingest {q.corpus}`")
        try:
            gen, n, load_ms, logprob = generate(q, digest, on_text if len(routes) == 1 else None, should_stop,
                                                len(routes) > 1)
        except SnapshotCorrupt as e:  # the other shards still serve; this one is rebuilt by `cag ingest`
            raise SnapshotCorrupt(f"shard {rt.shard} of {q.corpus!r}: {e}") from None
        tried.append(ShardAnswer(rt.shard, digest, rt.score, n, gen, load_ms, logprob))
    best = max(tried, key=lambda t: t.mean_logprob if t.mean_logprob is not None else float("-inf"))
    if len(routes) > 1 and on_text and best.gen.text:
        on_text(best.gen.text)
    return best, tried, routing_ms
