"""Where an answer is computed: the seam between the routes and the engine.

A route describes the question once as an `AskCall` (plain data: it can travel to another process)
and asks the service's `answers` for the work the runner runs. `LocalAnswers` runs it on this
process's engine (plain `cag serve`); `cag.api.ray_app.RemoteAnswers` sends it to an engine replica
on Ray Serve. The routes, the runner (limits, timeouts, cancel on disconnect) and the streaming code
are the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from cag.answering import chat
from cag.rag.answer import ask as answer_question
from cag.runtime.generate import DecodeConfig

from .runner import Work

if TYPE_CHECKING:
    from cag.engine import Answer, Engine

    from .schemas import ChatMessage


@dataclass(frozen=True)
class AskCall:
    """One question (or conversation) as the routes parsed it (the native and the OpenAI route alike)."""

    corpus: str
    question: str | None  # None when `messages` carry the conversation
    mode: str = "cag"
    max_tokens: int | None = None
    on_stale: str = "serve"
    shards: int = 1
    stream: bool = False  # hand text pieces to on_text as they come
    decoding: DecodeConfig | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, text): a conversation (cag.answering.chat)
    k: int | None = None  # rag and cag+rag: passages retrieved (None: the mode's default)
    scope: str | None = None  # the API key's scope: kept conversations are reused within it only (api.auth)

    def run(self, engine: Engine, on_text, should_stop) -> Answer:
        return answer_question(engine, self.corpus, self.question, mode=str(self.mode), max_tokens=self.max_tokens,
                               on_text=on_text if self.stream else None, should_stop=should_stop,
                               on_stale=str(self.on_stale), decoding=self.decoding, shards=self.shards,
                               messages=list(self.messages) if self.messages is not None else None, k=self.k,
                               scope=self.scope)


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
