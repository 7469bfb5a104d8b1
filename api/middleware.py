"""Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer streams and hide disconnects).
API keys are checked by a route dependency (api/auth.py), not here.

- `BodyLimit`: request bodies over `max_body_bytes` get 413, by Content-Length or while streaming.
- `RequestMetrics`: counts requests by route template/method/status and times them.
"""

from __future__ import annotations

import json
import time

from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_body


async def send_error(send: Send, status: int, message: str, code: str, headers: dict | None = None) -> None:
    body = json.dumps(error_body(status, message, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(HTTPException):
    """Raised from `receive`; an HTTPException so that FastAPI's body parsing passes it through."""


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"request body larger than {self.max_bytes} bytes (CAG_MAX_BODY_BYTES)"
        for name, v in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(v) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await send_error(send, 413, message, "too_large", {"Connection": "close"})
                    return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(413, message)
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await send_error(send, 413, message, "too_large", {"Connection": "close"})


class RequestMetrics:
    def __init__(self, app: ASGIApp, metrics, routes_app):
        self.app = app
        self.metrics = metrics
        self.routes_app = routes_app  # the FastAPI app, to name a request by its route template

    def _route(self, scope: Scope) -> str:
        route = scope.get("route")
        if route is not None and getattr(route, "path", None):
            return route.path
        for r in self.routes_app.router.routes:
            match, _ = r.matches(scope)
            if match == Match.FULL:
                return getattr(r, "path", "other")
        return "other"  # unknown paths share one label: no unbounded label values

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def tracking_send(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            route = self._route(scope)
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - t0)
