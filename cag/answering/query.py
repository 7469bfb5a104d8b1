"""What a caller asks, before any of it is checked: one `Query` for every mode (cag, full, rag, cag+rag).

`Engine.answer(query, on_text, should_stop)` answers it; cag.answering.questions checks it into a
`Question` (its corpus row, suffix tokens, decoding, staleness) first. The CLI, the HTTP API, MCP, the
benchmarks and the comparison runner all build one, so a new option is a field here and its use in the
engine, not a parameter threaded through every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the engine, not with a query
    from cag.runtime.generate import DecodeConfig


@dataclass(frozen=True)
class Query:
    """A question (or a conversation: `messages`) on a corpus, in a mode, with its limits."""

    corpus: str
    question: str | None = None  # None when `messages` carry a conversation
    mode: str = "cag"  # cag | full | rag | cag+rag (cag.results.Mode); checked, with its error, by questions.check
    max_tokens: int | None = None  # None: CAG_MAX_TOKENS; at most CAG_ANSWER_ROOM
    on_stale: str = "serve"  # serve | refuse | refresh (cag.results.StalePolicy)
    decoding: DecodeConfig | None = None  # sampling, min_tokens, stop sequences (max_tokens above bounds it)
    shards: int = 1  # a sharded corpus answers from its best `shards` shards (more than it has: all)
    messages: Sequence | None = None  # chat messages ({"role", "content"} dicts or (role, text) pairs)
    scope: str | None = None  # whose kept conversations it may reuse and extend (an API key's; None: the one user's)
    k: int | None = None  # rag and cag+rag: passages retrieved (None: the mode's default, retrieval.RAG_K/HYBRID_K)
    retriever: str = "bm25"  # rag and cag+rag: the retriever kind (bm25, dense where installed)
    # rag and cag+rag: passage size (None: the retriever's; cag+rag: CAG_QUOTE_TOKENS)
    passage_tokens: int | None = None
    search: str | None = None  # what a sharded corpus routes by, in place of the question's own text
