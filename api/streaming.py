"""Server-sent events: formatting, a response that stops its generation when it ends, and text
pieces trimmed so that their concatenation is exactly the final (stripped) answer."""

from __future__ import annotations

import json

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .runner import Generation


def sse(data, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content, gen: Generation):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # finished, failed, or cancelled because the client disconnected
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
