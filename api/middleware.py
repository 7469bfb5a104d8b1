"""Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer streams and hide disconnects).
API keys are checked by a route dependency (api/auth.py), not here.

- `SameSite`: a Host this server does not answer to, or a cross-site request that changes state, gets 403.
- `BodyLimit`: request bodies over `max_body_bytes` get 413, by Content-Length or while streaming.
- `RequestMetrics`: counts requests by route template/method/status and times them.
"""

from __future__ import annotations

import ipaddress
import json
import time
from urllib.parse import urlsplit

from starlette.datastructures import Headers
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


LOOPBACK = ("localhost", "127.0.0.1", "::1")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _hostname(netloc: str) -> str | None:
    """The host of a Host header or an origin, lower case, without port, brackets or final dot; None
    where it is not one (a userinfo or path in it: no browser sends those)."""
    if any(c in netloc for c in "@/?#\\"):
        return None
    try:
        name = urlsplit("//" + netloc).hostname
    except ValueError:  # "[::1" and the like
        return None
    return name.rstrip(".") if name else None


class SameSite:
    """What a web page the user visits could make the browser send here without the user meaning it.

    DNS rebinding: a page of attacker.example points its name at 127.0.0.1; the browser then sends
    it `Host: attacker.example:PORT` and lets the page read the answers (same origin as far as the
    browser knows). So the Host must be a name this server answers to: localhost, 127.0.0.1, [::1],
    `hosts` (the address `cag serve` binds, CAG_ALLOWED_HOSTS; "*": any), or any IP address (only a
    name can be rebound, and a LAN client may reach the server by its address). A missing Host is
    no browser's.

    Cross-site requests: a page elsewhere can POST a form here (no preflight). A request that may
    change state (not GET, HEAD, OPTIONS) carrying an Origin must come from this server's own pages
    (the Origin's host:port is the Host), a host of `hosts` (any port) or a CORS origin; a browser
    sends Origin on every cross-site POST. Routes with a body also take JSON only (FastAPI refuses a
    form's body: 400). Reads need nothing here: the browser keeps another site from reading them.

    Starlette's TrustedHostMiddleware checks the Host alone and answers in plain text; this one
    answers in the API's error shape and checks the Origin too."""

    def __init__(self, app: ASGIApp, hosts: list[str], cors_origins: list[str]):
        self.app = app
        self.any_host = "*" in hosts
        self.names = {*LOOPBACK, *(h.rstrip(".") for h in hosts if h != "*")}
        self.cors = set(cors_origins)

    def _host_ok(self, name: str | None) -> bool:
        if self.any_host or name in self.names:
            return True
        try:
            return ipaddress.ip_address(name or "") is not None
        except ValueError:
            return False

    def _origin_ok(self, origin: str, host: str | None) -> bool:
        if "*" in self.cors or origin in self.cors:
            return True
        parts = urlsplit(origin)  # "null" (a sandboxed frame, a file: page) has no netloc
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False
        return parts.netloc.lower() == (host or "").lower() or _hostname(parts.netloc) in self.names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host, origin = headers.get("host"), headers.get("origin")
        if host is not None and not self._host_ok(_hostname(host)):
            await send_error(
                send,
                403,
                f"Host {host!r} is not a name this server answers to: another site's name pointed at this address (DNS "
                "rebinding) is refused; use localhost, 127.0.0.1, [::1] or the server's address, or add the name to "
                "CAG_ALLOWED_HOSTS",
                "host_not_allowed",
            )
            return
        if origin is not None and scope["method"] not in SAFE_METHODS and not self._origin_ok(origin, host):
            await send_error(
                send,
                403,
                f"cross-site request refused: a page of {origin!r} may not change anything here (this server's own "
                "pages, CAG_ALLOWED_HOSTS and CAG_CORS_ORIGINS may)",
                "cross_site",
            )
            return
        await self.app(scope, receive, send)


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
