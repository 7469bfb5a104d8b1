"""The FastAPI app: `create_app(settings)` wires the engine, routes, errors and middleware.

The lifespan starts loading the model in a thread and returns at once: the server answers from
the first moment, `/health` with 503 until the model is loaded, then 200; routes that need the
model answer 503 (not_ready) until then.

With CAG_API_KEYS set, every route but /health (the API, /mcp, /metrics, /docs and /openapi.json) carries
the `RequireKey` security dependency: the check and its OpenAPI declaration are one thing.

The chat page (api/ui.py: `/` and `/ui/<file>`, static files that hold no data) is open too, unless
CAG_UI=false; it asks for a key when the API answers 401.

Every route, with keys or without, answers only a Host this server answers to, and refuses changes
asked for by another site's page (api/middleware.py SameSite: DNS rebinding, cross-site forms).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request, Security
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema

import cag
from cag.config import Settings, get_settings
from cag.engine import Engine
from cag.rag.index import retrieve

from . import errors, mcp_server, openai_compat, routes, ui
from .auth import RequireKey
from .middleware import BodyLimit, RequestMetrics, SameSite
from .runner import ClientGone
from .schemas import REFERENCED
from .service import Service
from .settings import ApiSettings, load_api_settings

log = logging.getLogger("cag.api")

DESCRIPTION = """Cache-augmented generation over HTTP: each corpus is prefilled once into a KV snapshot;
a question costs loading the snapshot (resident in memory after the first), the question's tokens and
the answer's. Native route `POST /v1/ask`; OpenAI-compatible `POST /v1/chat/completions` and
`GET /v1/models` (a model is a corpus). Errors use the OpenAI shape `{"error": {"message", "type", "code"}}`."""

docs = APIRouter(include_in_schema=False)


@docs.get("/openapi.json")
def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@docs.get("/docs")
def swagger_ui():
    return get_swagger_ui_html(openapi_url="/openapi.json", title="cag - API")


@docs.get("/redoc")
def redoc():
    return get_redoc_html(openapi_url="/openapi.json", title="cag - API")


def create_app(settings: ApiSettings | None = None, cag_settings: Settings | None = None,
               engine: Engine | None = None) -> FastAPI:
    """settings: the HTTP layer's (CAG_API_KEYS, limits ...); cag_settings: the engine's
    (CAG_MODEL, CAG_HOME ...), both from the environment when omitted (a bad value raises
    BadSettings). An `engine` may be passed (tests, embedding); its index is then served through
    per-thread SQLite connections."""
    settings = settings or load_api_settings()
    engine = engine or Engine(cag_settings or get_settings(), retrieval=retrieve)
    if engine.retrieval is None:  # an engine built elsewhere: rag and cag+rag through cag.rag's retriever
        engine.retrieval = retrieve
    service = Service(settings, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loader = asyncio.create_task(asyncio.to_thread(service.load))
        try:
            yield
        finally:
            service.close()

    app = FastAPI(title="cag", version=cag.__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)  # served by `docs`, behind the key
    app.state.service = service
    errors.install(app)

    @app.exception_handler(ClientGone)
    async def _gone(request, e):  # nobody reads this; the status shows in logs and metrics
        return errors.error_response(499, "client closed the request", "client_closed")

    guarded: dict = {}
    if settings.keys:
        guarded = {"dependencies": [Security(RequireKey(settings.keys))], "responses": errors.documented(401)}
    app.include_router(routes.open_router)
    app.include_router(routes.router, **guarded)
    app.include_router(openai_compat.router, **guarded)
    app.include_router(docs, dependencies=guarded.get("dependencies"))
    mcp_server.mount(app, service, guarded.get("dependencies"))  # /mcp for MCP clients, behind the same key
    if settings.ui:
        app.include_router(ui.router)

    # added innermost first: CORS > metrics > same site (Host, Origin) > body limit > routes
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(SameSite, hosts=settings.hosts, cors_origins=settings.origins)
    app.add_middleware(RequestMetrics, metrics=service.metrics, routes_app=app)
    if settings.origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for ops in schema.get("paths", {}).values():  # validation errors are answered with 400, not 422
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):  # only the 422s referred to them
            components.pop(name, None)
        _, extra = models_json_schema([(m, "serialization") for m in REFERENCED],
                                      ref_template="#/components/schemas/{model}")
        for name, definition in extra.get("$defs", {}).items():
            components.setdefault(name, definition)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its schema
    return app
