"""Retrieved passages in a prompt: the retriever protocol cag.rag implements, and how `rag` and `cag+rag` lay
out what it returns.

`rag` is the `full` prompt of a corpus made only of the retrieved passages: listed in corpus order
(documents in corpus order, then passage index), each named after its document with the passage index
before the suffix (``handbook/leave.md`` passage 2 -> ``handbook/leave#2.md``), so a folder holding
the passages under those names, asked in `full`, gives the same tokens (tests/test_rag_answer.py).

`cag+rag` keeps the snapshot as the prefix and quotes the top-k passages retrieved from the whole corpus
just before the question, as text in the last user message (earlier turns stay as the client sent
them): an ordinary conversation over the snapshot, exact by construction (the same tokens as the same
messages answered with no cache, alone, batched and in a conversation). Passages are quoted in corpus
order, as many of the best k as fit the context left after the largest snapshot of the corpus, the
conversation and the answer (a corpus ingested with a larger CAG_QUESTION_ROOM leaves room for more).

The engine is given its retriever (`Engine(settings, retrieval=...)`; cag.rag.index.retrieve: BM25, dense
where installed); cag never imports cag.rag.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Protocol

from cag.errors import TooLarge
from cag.model.prompt import build_prefix, encode_text
from cag.results import Answer, Mode

if TYPE_CHECKING:
    from cag.answering.questions import Question
    from cag.model.loading import LoadedModel
    from cag.model.prompt import Layout
    from cag.store.index import Index

RAG_K = 3  # passages a `rag` answer reads by default (docs/comparison.md)
HYBRID_K = 1  # passages `cag+rag` quotes by default: the best measured (docs/comparison.md#cagrag)
QUOTE_HEAD = "Passages quoted from the knowledge above:"


class Document(Protocol):
    """A corpus document as cag.knowledge.documents reads it (what a retriever indexes)."""

    @property
    def name(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def content_hash(self) -> str: ...


class Passage(Protocol):
    """A retrievable piece of a document: the `index`-th passage of document `doc_id`."""

    @property
    def doc_id(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def text(self) -> str: ...
    @property
    def n_tokens(self) -> int: ...


Hits = Sequence[tuple[Passage, float]]  # passages with their scores, best first


class Retrieval(Protocol):
    """The `k` best passages of `docs` for `query`, best first, cut into passages of `passage_tokens` tokens
    of `lm`'s tokenizer (None: the retriever's default size) and searched by retriever `kind`; an unknown
    or unavailable kind is a BadInput."""

    def __call__(self, docs: Sequence[Document], query: str, k: int, kind: str, passage_tokens: int | None,
                 lm: LoadedModel) -> Hits: ...


def passage_name(doc_id: str, index: int) -> str:
    """``dir/a.md`` passage 2 -> ``dir/a#2.md``: doc id + passage index, suffix kept last."""
    p = PurePosixPath(doc_id)
    if not p.suffix:
        return f"{doc_id}#{index}"
    return str(p.with_name(f"{p.stem}#{index}{p.suffix}"))


def in_corpus_order(docs: Sequence[Document], hits: Hits) -> list[tuple[str, str]]:
    """(name, text) of the passages, in corpus order (documents, then passage index), as `full` lists documents."""
    order = {d.name: i for i, d in enumerate(docs)}
    return [
        (passage_name(p.doc_id, p.index), p.text)
        for p, _ in sorted(hits, key=lambda h: (order[h[0].doc_id], h[0].index))
    ]


def described(hits: Hits, quoted: Hits | None = None) -> list[dict]:
    """What an Answer says of its passages (`quoted`: cag+rag's, whether each one made it into the prompt)."""
    return [{"doc_id": p.doc_id, "index": p.index, "score": round(s, 4), "name": passage_name(p.doc_id, p.index),
             "n_tokens": p.n_tokens, **({} if quoted is None else {"quoted": (p, s) in quoted})} for p, s in hits]


def rag_prefix(lm: LoadedModel, layout: Layout, room: int, docs: Sequence[Document], hits: Hits) -> list[int]:
    """`rag`'s knowledge: the passages as the documents of a `full` prompt; refused when it leaves the question
    and answer less than `room` tokens of the context."""
    prefix = build_prefix(lm.tokenizer, layout, in_corpus_order(docs, hits))
    if not lm.fits(len(prefix.ids), room):
        raise TooLarge(f"{len(hits)} passages are {len(prefix.ids)} tokens; too large for the model's context of "
                       f"{lm.max_context} with {room} reserved for question and answer; use a smaller k")
    return prefix.ids


def quoted(passages: list[tuple[str, str]], question: str) -> str:
    """The last user message of `cag+rag`: the passages (name, text), then the question."""
    body = "".join(f'<passage name="{name}">\n{text.strip()}\n</passage>\n' for name, text in passages)
    return f"{QUOTE_HEAD}\n{body}\nQuestion: {question}"


def quote_room(index: Index, q: Question, max_context: int) -> int:
    """Tokens a quote may take: the context after the largest snapshot of the corpus (a sharded corpus
    answers from any one shard), the conversation so far and the answer."""
    digests = [s["snapshot"] for s in index.shards(q.corpus)] or [q.row["current_snapshot"]]
    rows = [index.snapshot(d) for d in digests if d]
    prefix = max((r["n_tokens"] for r in rows if r), default=0)
    return max_context - prefix - len(q.suffix) - q.decoding.max_tokens - 8


def fitting(tokenizer, docs: Sequence[Document], hits: Hits, question: str, room: int) -> list[tuple[Passage, float]]:
    """The hits, best first, while the quoted message fits `room` (measured in tokens, as it will be prefilled)."""
    chosen: list[tuple[Passage, float]] = []
    bare = len(encode_text(tokenizer, question))
    for hit in hits:
        if len(encode_text(tokenizer, quoted(in_corpus_order(docs, chosen + [hit]), question))) - bare <= room:
            chosen.append(hit)
    return chosen


def quoting(a: Answer, hits: Hits, chosen: Hits, retrieval_ms: float) -> Answer:
    """`a` (the quoted conversation's answer) as `cag+rag`'s: its passages, which of them were quoted, and why
    some were not."""
    a.mode, a.retrieval_ms, a.passages = Mode.HYBRID.value, round(retrieval_ms, 2), described(hits, chosen)
    if len(chosen) < len(hits):
        a.warnings.append(f"{len(chosen)} of {len(hits)} retrieved passages fit the context left after the knowledge "
                          "(ingest with a larger CAG_QUESTION_ROOM to quote more)")
    return a


def messages_with_quote(question: str | None, messages: Sequence | None, text: str,
                        quote: list[tuple[str, str]]) -> list[dict]:
    """The conversation to answer: `messages` (or the plain `question`) with the last user message (`text`,
    as checked) quoted."""
    pairs = [(m.get("role"), m.get("content")) if isinstance(m, dict) else tuple(m) for m in messages or []]
    msgs = (
        [{"role": r, "content": c} for r, c in pairs]
        if messages is not None
        else [{"role": "user", "content": question}]
    )
    last = max(i for i, m in enumerate(msgs) if m.get("role") == "user")
    msgs[last]["content"] = quoted(quote, text)
    return msgs
