"""What a question is once checked: its corpus, mode, suffix tokens (a plain question's, or a whole
conversation's: cag.answering.chat), decoding and staleness; and whether a conversation fits the context its
knowledge leaves. Everything here runs before any model work but tokenizing."""

from __future__ import annotations

import time
from dataclasses import dataclass

from cag.answering import chat
from cag.errors import BadInput, ContextExceeded, StaleRefused, TooLarge
from cag.model.prompt import build_suffix
from cag.results import Mode, StalePolicy, choices
from cag.runtime.generate import DecodeConfig
from cag.store.sync import known_corpus

MAX_SUFFIX = 32768  # a conversation's tokens: a slot's room is virtual memory, bounded for long-context models


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

    @property
    def search_text(self) -> str:
        """What retrieval and shard routing search by: a conversation's last two user messages (a
        follow-up such as "and who owns it?" keeps the subject of the one before)."""
        if self.search is not None:
            return self.search
        return self.text if not self.turns else "\n".join([t.text for t in self.turns if t.role == "user"][-2:])


def suffix_room(lm) -> int:
    """The longest suffix (a conversation and its answer) a request may hold: the model's context,
    at most MAX_SUFFIX, in whole blocks of 512 (cag.runtime.rows.suffix_keys)."""
    return -(-min(lm.max_context, MAX_SUFFIX) // 512) * 512


def check(engine, corpus: str, question: str | None, mode: str = "cag", max_tokens: int | None = None,
          on_stale: str = "serve", decoding: DecodeConfig | None = None, messages: list | None = None) -> Question:
    """Everything a question (or a conversation: `messages`) needs before any model work; applies
    the stale policy. A conversation's fit in the context is checked once its prefix is known."""
    t_start = time.perf_counter()
    try:
        mode, policy = Mode(mode), StalePolicy(on_stale)
    except ValueError:
        bad = ("mode", mode, Mode) if mode not in {m.value for m in Mode} else ("stale policy", on_stale, StalePolicy)
        raise BadInput(f"unknown {bad[0]} {bad[1]!r}; use one of {choices(bad[2])}") from None
    turns = None
    if messages is not None:
        turns = chat.turns_of(messages)
        question = chat.question(turns)
    if not question or not question.strip():
        raise BadInput("empty question")
    if turns is None and (why := chat.unicode_problem(question)):  # a conversation's turns are checked already
        raise BadInput(f"the question {why}")
    row = known_corpus(engine.index, engine.remote, corpus)
    max_tokens = engine.settings.max_tokens if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise BadInput("max_tokens must be at least 1")
    d = (decoding or DecodeConfig()).within(min(max_tokens, engine.settings.answer_room))
    # what a name or a setting can refuse is refused above, before the model loads (a one-time cost
    # of the process, not of the question: t_start excludes it)
    t_load = time.perf_counter()
    lm = engine.lm
    if engine.settings.threads > 0:
        import torch

        torch.set_num_threads(engine.settings.threads)  # process-wide; the same value from every thread
    t_start += time.perf_counter() - t_load
    _, layout, turn = engine._layouts()
    # one user message gives a plain question's tokens; as a conversation it may use the context's room
    suffix = build_suffix(lm.tokenizer, layout, question) if turns is None else chat.encode(lm.tokenizer, layout, turn, turns)
    if turns is None and len(suffix) > engine.settings.question_room:
        raise TooLarge(f"question is {len(suffix)} tokens; the room left for it is {engine.settings.question_room}")
    reasons = engine.stale_reasons(row)
    if reasons and policy is StalePolicy.REFUSE:
        raise StaleRefused(f"corpus {corpus!r} is stale: " + "; ".join(reasons))
    if reasons and policy is StalePolicy.REFRESH:
        engine.ingest(row["source"], name=corpus)  # the recorded source, never a same-named folder in cwd
        row, reasons = engine.index.corpus(corpus), []
    return Question(corpus, question, mode, row, suffix, d, reasons, t_start, turns)


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
