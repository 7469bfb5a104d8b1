"""`cag+rag`: the snapshot stays the prefix, and the top-k passages retrieved from the whole corpus are
quoted again just before the question.

A small model reads a few focused passages better than a whole corpus (docs/comparison.md), and a
corpus beyond one context answers from one routed shard; the quote brings the retrieved passages (from
any shard) next to the question, while the knowledge stays cached. Only the quote and the question are
prefilled per question.

The quote is text in the last user message (earlier turns of a conversation stay as the client sent
them), so the prompt is an ordinary conversation over the snapshot: exact by construction, the same
tokens as the same messages answered with no cache (`full`), alone, batched and in a conversation.
Passages are quoted in corpus order, each named by its document and passage index (as RAG names
them), as many of the top k as fit the context left after the knowledge, the conversation and the
answer (the best first; a corpus ingested with a larger CAG_QUESTION_ROOM leaves room for more).
"""

from __future__ import annotations

import time
from pathlib import Path

from cag.errors import BadInput
from cag.model.prompt import encode_text

from .chunking import Passage
from .index import DEFAULT_PASSAGE_TOKENS, get_index, passage_name

QUOTE_HEAD = "Passages quoted from the knowledge above:"
HYBRID_K = 1  # passages quoted by default: the best measured (docs/comparison.md#cagrag)


def quoted(passages: list[tuple[str, str]], question: str) -> str:
    """The last user message: the passages (name, text), then the question."""
    body = "".join(f'<passage name="{name}">\n{text.strip()}\n</passage>\n' for name, text in passages)
    return f"{QUOTE_HEAD}\n{body}\nQuestion: {question}"


def room_left(engine, q) -> int:
    """Tokens the quote may take: the context after the largest snapshot of the corpus (a sharded
    corpus answers from any one shard), the conversation so far and the answer."""
    digests = [s["snapshot"] for s in engine.index.shards(q.corpus)] or [q.row["current_snapshot"]]
    rows = [engine.index.snapshot(d) for d in digests if d]
    prefix = max((r["n_tokens"] for r in rows if r), default=0)
    return engine.lm.max_context - prefix - len(q.suffix) - q.decoding.max_tokens - 8


def messages_with_quote(q, question: str | None, messages: list | None, quote: list[tuple[str, str]]) -> list[dict]:
    """The conversation to answer: `messages` (or the plain question) with the last user message quoted."""
    pairs = [(m.get("role"), m.get("content")) if isinstance(m, dict) else tuple(m) for m in messages or []]
    msgs = [{"role": r, "content": c} for r, c in pairs] if messages is not None else [{"role": "user", "content": question}]
    last = max(i for i, m in enumerate(msgs) if m.get("role") == "user")
    msgs[last]["content"] = quoted(quote, q.text)
    return msgs


def answer_hybrid(engine, corpus: str, question: str | None, k: int = 3, retriever: str = "bm25", messages: list | None = None,
                  passage_tokens: int | None = None, full: bool = False, **kw):
    """Answer from the snapshot with the top-k passages quoted before the question (`full`: the same
    prompt with no cache, prefilled again: what `cag+rag` must equal). `kw`: Engine.ask's options."""
    if k < 1:
        raise BadInput("k must be at least 1")
    q = engine.check(corpus, question, "cag", kw.get("max_tokens"), kw.get("on_stale", "serve"), kw.get("decoding"), messages)
    kw["on_stale"] = "serve"  # the policy ran once, above (a refresh too)
    docs, _ = engine.read_corpus(Path(q.row["source"]), q.corpus)
    t0 = time.perf_counter()
    idx, _ = get_index(engine, docs, retriever, passage_tokens or engine.settings.quote_tokens or DEFAULT_PASSAGE_TOKENS)
    hits = idx.retriever.search(q.search_text, k)
    retrieval_ms = (time.perf_counter() - t0) * 1e3
    order = {d.name: i for i, d in enumerate(docs)}

    def quote_of(hs):  # corpus order, as RAG and `full` list them
        return [(passage_name(p.doc_id, p.index), p.text) for p, _ in sorted(hs, key=lambda h: (order[h[0].doc_id], h[0].index))]

    room, tok = room_left(engine, q), engine.lm.tokenizer
    chosen: list[tuple[Passage, float]] = []
    bare = len(encode_text(tok, q.text))
    for hit in hits:  # best first, while the quoted message fits (measured in tokens, as it will be prefilled)
        if len(encode_text(tok, quoted(quote_of(chosen + [hit]), q.text))) - bare <= room:
            chosen.append(hit)
    quote = quote_of(chosen)
    a = engine.ask(corpus, None, mode="full" if full else "cag", messages=messages_with_quote(q, question, messages, quote),
                   search=q.search_text, **kw)
    a.mode = "cag+rag"
    a.retrieval_ms = round(retrieval_ms, 2)
    a.passages = [{"doc_id": p.doc_id, "index": p.index, "score": round(s, 4), "name": passage_name(p.doc_id, p.index),
                   "n_tokens": p.n_tokens, "quoted": (p, s) in chosen} for p, s in hits]
    if len(chosen) < len(hits):
        a.warnings.append(f"{len(chosen)} of {len(hits)} retrieved passages fit the context left after the knowledge "
                          "(ingest with a larger CAG_QUESTION_ROOM to quote more)")
    return a
