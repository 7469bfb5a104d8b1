"""Where an answer is computed: the seam between the routes and the engine.

A route describes the question once as an `AskCall`: the engine's Query (cag.answering.query) and whether
its text streams (plain data: it can travel to another process); it asks the service's `answers` for the
work the runner runs. `LocalAnswers` runs it on this
process's engine (plain `cag serve`); `cag.api.ray_app.RemoteAnswers` sends it to an engine replica
on Ray Serve. The routes, the runner (limits, timeouts, cancel on disconnect) and the streaming code
are the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from cag.answering import chat
from cag.answering.query import Query

from .runner import Work

if TYPE_CHECKING:
    from cag.engine import Answer, Engine

    from .schemas import ChatMessage


@dataclass(frozen=True)
class AskCall:
    """One question (or conversation) as the routes parsed it (the native and the OpenAI route alike): its
    Query (a conversation's messages as (role, text) pairs; `scope`: the API key's, whose kept conversations
    it may reuse: api.auth), and whether its text pieces go to on_text as they come."""

    query: Query
    stream: bool = False

    @property
    def corpus(self) -> str:
        return self.query.corpus

    def run(self, engine: Engine, on_text, should_stop) -> Answer:
        return engine.answer(self.query, on_text if self.stream else None, should_stop)


def messages_of(messages: list[ChatMessage]) -> tuple[tuple[str, str], ...]:
    """(role, text) per message: text parts joined as `cag ask --messages` joins them (chat.content_text),
    anything else refused (cag.answering.chat checks the rest)."""
    return tuple((m.role, chat.content_text(i, m.role, [p.model_dump() for p in m.content]
                                            if isinstance(m.content, list) else m.content))
                 for i, m in enumerate(messages))


class LocalAnswers:
    """Answers computed by this process's engine, on the runner's threads."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def work(self, call: AskCall) -> Work:
        return partial(call.run, self.engine)

    def health(self) -> dict:
        """Extra fields for /health: nothing here (the model loaded is all it takes)."""
        return {}
