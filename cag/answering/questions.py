"""What a question is once checked: its corpus, mode, suffix tokens (a plain question's, or a whole
conversation's: cag.answering.chat), decoding and staleness; and whether a conversation fits the context its
knowledge leaves. Everything here runs before any model work but tokenizing."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cag.answering import chat
from cag.errors import BadInput, ContextExceeded, StaleRefused, TooLarge
from cag.model.prompt import Layout, build_suffix
from cag.results import Mode, StalePolicy, choices
from cag.runtime.generate import DecodeConfig
from cag.runtime.slots import MAX_SUFFIX
from cag.store.sync import known_corpus

if TYPE_CHECKING:
    from cag.answering.query import Query
    from cag.answering.routing import Route
    from cag.config import Settings
    from cag.model.loading import LoadedModel
    from cag.store.index import Index



@dataclass
class Question:
    """A checked question: its corpus row, suffix tokens, decoding, staleness, and start time. A
    conversation's suffix holds all its turns (cag.answering.chat); `text` is its last user message."""

    corpus: str
    text: str
    mode: Mode
    row: dict
    suffix: list[int]
    decoding: DecodeConfig
    reasons: list[str]
    t_start: float
    turns: list[chat.Turn] | None = None  # a conversation's turns (None: a plain question)
    scope: str | None = None  # whose kept conversations it may reuse (an API key's; None: the one user's)
    search: str | None = None  # what to route by instead of its text (cag+rag: the question, not its quote)
    refresh: bool = False  # stale under the refresh policy: the caller ingests it again before answering
    routes: list[Route] | None = None  # the shards to answer from, best first (cag+rag: cag.answering.quotes)

    @property
    def search_text(self) -> str:
        """What retrieval and shard routing search by: a conversation's last two user messages (a
        follow-up such as "and who owns it?" keeps the subject of the one before)."""
        if self.search is not None:
            return self.search
        return self.text if not self.turns else "\n".join([t.text for t in self.turns if t.role == "user"][-2:])


def suffix_room(lm: LoadedModel) -> int:
    """The longest suffix (a conversation and its answer) a request may hold: the model's context,
    at most MAX_SUFFIX, in whole blocks of 512 (cag.runtime.rows.suffix_keys)."""
    return -(-min(lm.max_context, MAX_SUFFIX) // 512) * 512


def check(
    query: Query,
    settings: Settings,
    index: Index,
    remote,
    loaded: Callable[[], tuple[LoadedModel, Layout, str]],
    stale_reasons: Callable[[dict], list[str]],
) -> Question:
    """Everything a query (a question, or a conversation: `messages`) needs before any model work; applies
    the stale policy but a refresh, which it asks of the caller (`Question.refresh`: the engine ingests).
    `remote`: the shared store (cag.store.sync). `loaded`: the model, its prompt layout and chat turn piece
    (loaded on first use: after what a name or a setting can refuse). `stale_reasons`: why a corpus row is
    stale (cag.knowledge.freshness). A conversation's fit in the context is checked once its prefix is known."""
    t_start = time.perf_counter()
    question, mode, on_stale, messages = query.question, query.mode, query.on_stale, query.messages
    try:
        mode, policy = Mode(mode), StalePolicy(on_stale)
    except ValueError:
        bad = ("mode", mode, Mode) if mode not in {m.value for m in Mode} else ("stale policy", on_stale, StalePolicy)
        raise BadInput(f"unknown {bad[0]} {bad[1]!r}; use one of {choices(bad[2])}") from None
    turns = None
    if messages is not None:
        turns = chat.turns_of(list(messages))
        question = chat.question(turns)
    if not question or not question.strip():
        raise BadInput("empty question")
    if turns is None and (why := chat.unicode_problem(question)):  # a conversation's turns are checked already
        raise BadInput(f"the question {why}")
    row = known_corpus(index, remote, query.corpus)
    max_tokens = settings.max_tokens if query.max_tokens is None else query.max_tokens
    if max_tokens < 1:
        raise BadInput("max_tokens must be at least 1")
    d = (query.decoding or DecodeConfig()).within(min(max_tokens, settings.answer_room))
    # what a name or a setting can refuse is refused above, before the model loads (a one-time cost
    # of the process, not of the question: t_start excludes it)
    t_load = time.perf_counter()
    lm, layout, turn = loaded()
    if settings.threads > 0:
        import torch

        torch.set_num_threads(settings.threads)  # process-wide; the same value from every thread
    t_start += time.perf_counter() - t_load
    # one user message gives a plain question's tokens; as a conversation it may use the context's room
    suffix = (
        build_suffix(lm.tokenizer, layout, question)
        if turns is None
        else chat.encode(lm.tokenizer, layout, turn, turns)
    )
    if turns is None and len(suffix) > settings.question_room:
        raise TooLarge(f"question is {len(suffix)} tokens; the room left for it is {settings.question_room}")
    reasons = stale_reasons(row)
    if reasons and policy is StalePolicy.REFUSE:
        raise StaleRefused(f"corpus {query.corpus!r} is stale: " + "; ".join(reasons))
    return Question(query.corpus, question, mode, row, suffix, d, reasons, t_start, turns, query.scope, query.search,
                    refresh=bool(reasons) and policy is StalePolicy.REFRESH)


def conversation(q: Question, messages: list, mode: Mode, lm: LoadedModel, layout: Layout, turn: str) -> Question:
    """`q` (checked: corpus, decoding, staleness) asked as the conversation `messages` in `mode` instead (cag+rag:
    its quote in the last user message), routed by what `q` searches by. Only the new turns are read and
    tokenized: nothing is checked again."""
    turns = chat.turns_of(messages)
    return Question(
        q.corpus,
        chat.question(turns),
        mode,
        q.row,
        chat.encode(lm.tokenizer, layout, turn, turns),
        q.decoding,
        q.reasons,
        time.perf_counter(),
        turns,
        q.scope,
        q.search_text,
    )


def fit(q: Question, n_prefix: int, max_context: int, room: int) -> None:
    """A conversation must fit the context after its knowledge prefix (`n_prefix` tokens), with its
    answer, and its slot's `room`: OpenAI's context_length_exceeded otherwise (never a silent
    truncation). A plain question fits the room ingest reserved (check)."""
    if q.turns is None:
        return
    n, m = len(q.suffix), q.decoding.max_tokens
    limit = min(max_context, n_prefix + room)
    if n_prefix + n + m > limit:
        raise ContextExceeded(f"this model's maximum context length is {limit} tokens; the knowledge takes {n_prefix}, "
                              f"the conversation {n} and the answer up to {m} ({n_prefix + n + m} in all); "
                              "shorten the conversation or start a new one")
