"""cag+rag at cag's speed: each passage's quote prefilled before a question quotes it, and the shard a quote is
answered from.

A cag+rag question's suffix is its last user message with the passages quoted before the question
(cag.answering.retrieval.quoted): QUOTE_HEAD, each passage, then "Question: ..." and the template's tail. Every token
before the question's own words is the same for every question whose first quoted passage is the same one, so
`Engine.warm_quotes` prefills that part once per passage, after the snapshot the passage's questions are answered
from, and keeps its K/V (cag.runtime.kept_conversations, in a store of their own: CAG_QUOTE_BYTES) under the
snapshot's digest + WARM. A question quoting the passage then copies those rows and prefills only its own tokens
(with k = 1 all of the quote; with k > 1 the first passage's). Exact by construction: a kept row is the row a
recomputation gives, and rows are kept only where every row is a decode row (Decoder.keeps; elsewhere warming keeps
nothing and says why). A warmed quote holds no user's words, so every API key's questions may reuse it.

Routing: a sharded corpus answers a cag+rag question from the shard holding most of its retrieved passages (ties:
the one holding the best ranked), where each passage's quote was warmed; a two-hop question whose passages sit in
one shard is answered next to both. Without a passage in any shard (a document since removed) the question routes
by its words, as `cag` does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cag.answering.retrieval import Hits, in_corpus_order, quoted
from cag.answering.routing import Route
from cag.model.prompt import encode_text
from cag.runtime.kept_conversations import common_prefix

if TYPE_CHECKING:
    from cag.answering.retrieval import Document
    from cag.store.index import Index

WARM = "/quotes"  # a snapshot digest + this: the kept-conversation key of its warmed quotes


@dataclass
class Warmed:
    """What `Engine.warm_quotes` did: passages warmed (and their tokens and kept bytes), passages left cold."""

    corpus: str
    passages: int = 0
    tokens: int = 0
    kept_bytes: int = 0
    cold: int = 0  # passages not warmed: CAG_QUOTE_BYTES was reached, or it was stopped
    seconds: float = 0.0
    reason: str | None = None  # why nothing was warmed, or why some passages stayed cold


def question_free(tokenizer, name: str, text: str) -> list[int]:
    """The tokens of a one-passage quote (`name`, `text`) that no question changes: the common prefix of the quote
    before two questions that differ in their first word."""
    a, b = (encode_text(tokenizer, quoted([(name, text)], q)) for q in ("A", "Z"))
    return a[: common_prefix(np.asarray(a), np.asarray(b))]


def routes(owner: dict[str, int], hits: Hits) -> list[Route] | None:
    """Shards by how many of `hits` (best first) they hold, ties to the one holding the better ranked; None when
    no hit is in a shard (or the corpus has one)."""
    count: dict[int, int] = {}
    first: dict[int, int] = {}
    for rank, (p, _) in enumerate(hits):
        if (shard := owner.get(p.doc_id)) is not None:
            count[shard] = count.get(shard, 0) + 1
            first.setdefault(shard, rank)
    order = sorted(count, key=lambda s: (-count[s], first[s]))
    return [Route(s, float(count[s])) for s in order] or None


def plan(index: Index, corpus: str, current: str, owner: dict[str, int], docs: Sequence[Document], hits: Hits,
         tokenizer) -> list[tuple[str, list[int]]]:
    """(snapshot digest, question-free quote tokens) per passage of `hits`, in corpus order: each against the
    shard holding its document (`owner`: cag.knowledge.shards.owners; the current snapshot when unsharded)."""
    shards = {r["shard"]: r["snapshot"] for r in index.shards(corpus)}
    order = {d.name: i for i, d in enumerate(docs)}
    out = []
    for p, _ in sorted(hits, key=lambda h: (order[h[0].doc_id], h[0].index)):
        ((name, text),) = in_corpus_order(docs, [(p, 0.0)])
        shard = owner.get(p.doc_id)
        out.append((shards[shard] if shard is not None else current, question_free(tokenizer, name, text)))
    return out


def warm(corpus: str, todo: list[tuple[str, list[int]]], run, budget: int, kv_bytes, tick=None,
         should_stop=None) -> Warmed:
    """Prefill and keep each of `todo` (snapshot digest, quote tokens) with `run(digest, ids)`, while their K/V
    (`kv_bytes(n)`) fit the kept-conversation `budget` and `should_stop()` is false; `tick(n)` after each."""
    w, t0 = Warmed(corpus), time.perf_counter()
    for i, (digest, ids) in enumerate(todo):
        if should_stop is not None and should_stop():
            w.cold, w.reason = len(todo) - i, f"stopped after {i} of {len(todo)} passages"
            break
        if w.kept_bytes + (nbytes := kv_bytes(len(ids))) > budget:
            w.cold = len(todo) - i
            w.reason = (f"{w.cold} of {len(todo)} passages left cold: their K/V would pass the warmed quotes' "
                        f"budget of {budget / 1024**2:.0f} MiB (CAG_QUOTE_BYTES)")
            break
        run(digest, ids)
        w.passages, w.tokens, w.kept_bytes = w.passages + 1, w.tokens + len(ids), w.kept_bytes + nbytes
        if tick:
            tick(len(ids))
    w.seconds = round(time.perf_counter() - t0, 3)
    return w

NOT_KEPT = "nothing kept: K/V are kept only on cag's kernels (CAG_WEIGHTS int4, int8 or bf16 on an AVX-512 or AVX2 CPU)"
