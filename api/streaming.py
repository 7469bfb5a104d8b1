"""Server-sent events: one event per piece (sse-starlette frames them and notices a client that
disconnects), a response that stops its generation when it ends, and text pieces trimmed so that
their concatenation is exactly the final (stripped) answer."""

from __future__ import annotations

import json

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from .runner import Generation


def event(data, name: str | None = None) -> ServerSentEvent:
    """`data` as one SSE event: JSON unless it is already a string (OpenAI's final `[DONE]`)."""
    return ServerSentEvent(data=data if isinstance(data, str) else json.dumps(data, ensure_ascii=False), event=name)


class EventStream(EventSourceResponse):
    """An event stream bound to its generation: when the response ends (finished, failed, or
    cancelled because the client disconnected) the generation stops at its next token."""

    def __init__(self, content, gen: Generation):
        super().__init__(content, sep="\n")
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()


class TextTrim:
    """The engine strips the final answer; streamed pieces hold back leading and trailing
    whitespace so that their concatenation equals it. `finish` returns what is still missing
    (a trailing piece the decoder held back, e.g. an incomplete UTF-8 sequence)."""

    def __init__(self) -> None:
        self.sent = ""
        self.pending = ""

    def push(self, piece: str) -> str:
        text = self.pending + piece
        if not self.sent:
            text = text.lstrip()
        body = text.rstrip()
        self.pending = text[len(body):]
        self.sent += body
        return body

    def finish(self, answer: str) -> str:
        return answer[len(self.sent):] if answer.startswith(self.sent) else ""
