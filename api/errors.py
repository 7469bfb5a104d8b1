"""Errors as JSON in the OpenAI shape: {"error": {"message", "type", "param", "code"}}.

Engine errors (cag.errors.CagError) carry their own HTTP status and code; the few that only the
HTTP layer can raise are defined here the same way. `STATUSES` lists every error status the API
answers, with its codes: the OpenAPI responses are picked from it, and a test holds the README's
error table and every CagError to it.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cag.errors import CagError

log = logging.getLogger("cag.api")


class Unauthorized(CagError):
    http_status = 401
    code = "invalid_api_key"


class Unsupported(CagError):
    """A request field the OpenAI-compatible route does not honour, set to a value that would change
    the answer (`logprobs: true`, `n: 2` ...): refused with the field as `param`, as OpenAI names it."""

    http_status = 400
    code = "unsupported_parameter"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFull(CagError):
    http_status = 429
    code = "queue_full"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class NotReady(CagError):
    http_status = 503
    code = "not_ready"


class Timeout(CagError):
    http_status = 504
    code = "timeout"


def status_of(e: CagError | type[CagError]) -> int:
    """The error's HTTP status (each named error carries its own)."""
    return (e if isinstance(e, type) else type(e)).http_status


# Every status the API answers with an error body: its codes, and when.
STATUSES: dict[int, tuple[tuple[str, ...], str]] = {
    400: (("invalid_request", "bad_request", "unsupported_parameter", "model_error", "context_length_exceeded"),
          "Bad input: a body that is not JSON or does not fit the schema (invalid_request), input the engine "
          "refuses, e.g. a blank question or no user message (bad_request), an OpenAI field cag does not honour set "
          "to a value that would change the answer, e.g. logprobs, tools, n > 1 (unsupported_parameter, `param` "
          "names it), a model it cannot use (model_error), a conversation longer than the context left after the "
          "knowledge (context_length_exceeded)."),
    401: (("invalid_api_key",), "Missing or wrong API key (only when CAG_API_KEYS is set)."),
    403: (("host_not_allowed", "cross_site"), "A Host header naming something other than this server: localhost, "
                                              "127.0.0.1, [::1], an IP address, its bound address or CAG_ALLOWED_HOSTS "
                                              "(host_not_allowed: DNS rebinding); a request that changes state sent "
                                              "by another site's page, by its Origin (cross_site)."),
    404: (("not_found",), "Unknown corpus, model, job or path."),
    405: (("method_not_allowed",), "The path exists, the method does not (see the Allow header)."),
    409: (("stale",), "The corpus is stale and on_stale is refuse."),
    413: (("too_large",), "Body over CAG_MAX_BODY_BYTES, question over CAG_MAX_QUESTION_CHARS or the "
                          "question room, or knowledge that no longer fits the context."),
    429: (("queue_full", "busy"), "Queue full (see Retry-After), or the corpus is being ingested elsewhere (busy)."),
    499: (("client_closed",), "The client disconnected before the answer (logs and metrics only: nobody reads it)."),
    500: (("internal_error",), "A bug: logged with its traceback; the body says no more."),
    503: (("not_ready", "model_changed", "snapshot_corrupt", "index_unusable"),
          "The model is still loading or failed to load (not_ready), its weights file was rewritten on disk after "
          "the server loaded it: restart the server (model_changed), the corpus's snapshot failed verification "
          "or is missing from the shared store, or its ref there is corrupt, and must be rebuilt, e.g. by "
          "POST /v1/corpora/{name}/refresh (snapshot_corrupt), or the index database cannot be used or "
          "written, e.g. read-only (index_unusable)."),
    504: (("timeout",), "Queue wait plus generation took longer than CAG_REQUEST_TIMEOUT_S."),
    507: (("insufficient_storage",), "The server's disk has no room for a snapshot (a refresh, or on_stale refresh): "
                                     "nothing half-written is kept and the previous snapshot still answers."),
}


ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}


def documented(*statuses: int) -> dict:
    """OpenAPI `responses` for these error statuses: JSON in the error shape, described from
    STATUSES. Spelled as content rather than a response model, so that a route whose own
    responses are not JSON (/metrics) still documents its errors as JSON."""
    return {s: {"description": STATUSES[s][1], "content": {"application/json": {"schema": ERROR_REF}}}
            for s in statuses}


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "invalid_request_error", 429: "rate_limit_error"}


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str, headers: dict | None = None,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def cag_error_response(e: CagError) -> JSONResponse:
    status, headers = status_of(e), {}
    if status == 429:
        headers["Retry-After"] = str(getattr(e, "retry_after", 1))
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return error_response(status, str(e), e.code, headers, param=getattr(e, "param", None))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    first = errs[0]
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "model_attributes_type":
        return "the request body must be a JSON object (Content-Type: application/json)", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc)
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return (
        f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid"))
    ) + more, where or None


def install(app: FastAPI) -> None:
    @app.exception_handler(CagError)
    async def _cag(request: Request, e: CagError):
        return cag_error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        message, param = _validation_message(e)
        return error_response(400, message, "invalid_request", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed",
                413: "too_large"}.get(e.status_code, "http_error")
        return error_response(e.status_code, str(e.detail), code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", "internal_error")
