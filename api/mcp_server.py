"""cag as an MCP server (Model Context Protocol, the official `mcp` SDK): tools for assistants and IDE agents.

Three tools, over the same Service as the HTTP API (api/service.py: its engine, runner, answers and
metrics), so an MCP answer is the REST answer:

* `list_corpora`: each corpus's name, freshness, tokens, size and shards;
* `ask_corpus`: answer a question from a corpus (mode, max tokens): the answer with its token
  counts, and the passages and their documents (`sources`) where the mode reads passages;
* `corpus_status`: one corpus's snapshot, size and freshness, with every reason it is stale.

Two transports:

* HTTP: `mount(app, service, dependencies)` adds `/mcp` to `cag serve`'s FastAPI app (streamable
  HTTP, stateless, JSON responses). It is an ordinary route of the app, so it carries the app's
  `RequireKey` dependency when CAG_API_KEYS is set (401 in the API's error shape without the right
  Bearer key), and the app's Host/Origin checks, body limit and metrics; an answer uses the key's
  scope (api/auth.py) as POST /v1/ask does.
* stdio: `serve_stdio` (`cag mcp`), for assistants that start their servers as subprocesses; the
  model loads in the background from the start and the first tool call that needs it waits for it.

A user error (unknown corpus, bad mode, a question too long, ...) is a tool error carrying cag's
one-line message (cag.errors.CagError), as the CLI prints it; model work runs on the runner's
threads and index reads in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, FastAPI, Request, Response
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import Field

import cag
from cag.answering.query import Query
from cag.config import Settings
from cag.engine import Engine
from cag.errors import CagError
from cag.rag.index import retrieve
from cag.results import Mode, human_bytes

from .answers import AskCall
from .auth import key_scope
from .errors import NotReady
from .routes import finish_reason, timings
from .service import Service
from .settings import ApiSettings

log = logging.getLogger("cag.api")

PATH = "/mcp"
MODES = [m.value for m in Mode]

INSTRUCTIONS = """cag answers questions from knowledge corpora (document folders prefilled once into a KV cache).
Call list_corpora for the corpus names, then ask_corpus with one of them and a self-contained question;
corpus_status says whether a corpus is stale (its documents changed since it was ingested) and why.
Modes: cag (default, from the cached corpus), cag+rag (cached corpus plus the best retrieved passage quoted
again), full (whole corpus re-read, no cache: slower, same answer as cag), rag (top retrieved passages only)."""

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)

CorpusArg = Annotated[str, Field(description="Corpus name, as list_corpora lists it.")]
QuestionArg = Annotated[str, Field(description="The question, self-contained (the corpus is the only context).")]
# the schema names the modes; the value is checked by cag (an unknown one is a tool error with cag's message)
ModeArg = Annotated[str, Field(description="cag: from the snapshot (default); cag+rag: the snapshot with the best "
                                           "retrieved passage quoted again; full: whole corpus in the prompt, no "
                                           "cache; rag: top retrieved passages only.",
                               json_schema_extra={"enum": MODES})]
MaxTokensArg = Annotated[int | None, Field(description="Answer length limit in tokens (default CAG_MAX_TOKENS; "
                                                       "clamped to CAG_ANSWER_ROOM).")]


def one_line(e: CagError) -> str:
    return " ".join(str(e).splitlines())


# a tool's result: JSON data (structured content, repeated as text), or a tool error with cag's message
Result = Annotated[CallToolResult, dict[str, Any]]


def _data(data: dict) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(data, ensure_ascii=False))],
                          structured_content=data)


def _error(e: CagError) -> CallToolResult:
    """A user error as a tool error carrying exactly cag's one-line message (the SDK's own ToolError would
    prefix it with "Error executing tool ..."); a bug is left to the SDK, which logs its traceback."""
    log.info("MCP tool call refused: %s", one_line(e))
    return CallToolResult(content=[TextContent(type="text", text=one_line(e))], is_error=True)


def _scope(ctx: Context | None) -> str | None:
    """The API key's scope on HTTP (set by RequireKey on this request); None on stdio or without keys."""
    if ctx is None:
        return None
    try:
        request = ctx.request_context.request  # the HTTP request that carried the call (a Starlette Request)
    except (AttributeError, ValueError):  # no context: called outside a request
        return None
    return key_scope(request) if isinstance(request, Request) else None


def _summary(s) -> dict:
    return {"name": s.name, "freshness": "stale" if s.stale else "fresh", "stale_reasons": list(s.reasons),
            "n_documents": s.n_documents, "n_tokens": s.n_tokens, "bytes": s.bytes, "size": human_bytes(s.bytes),
            "n_shards": s.n_shards, "snapshot": s.snapshot}


def answer_of(svc: Service, a, max_tokens: int | None) -> dict:
    """An answer as POST /v1/ask gives it (api/routes.py ask_response, without token ids and the decode
    path), and `sources`: the documents of the passages the answer read (rag: every retrieved one;
    cag+rag: the quoted ones)."""
    out = {"answer": a.answer, "corpus": a.corpus, "mode": a.mode, "snapshot": a.snapshot, "stale": a.stale,
           "stale_reasons": a.stale_reasons, "finish_reason": finish_reason(svc, a, max_tokens),
           "usage": {"prompt_tokens": a.prompt_tokens, "cached_tokens": a.cached_tokens,
                     "conversation_tokens": a.conversation_tokens, "completion_tokens": a.completion_tokens},
           "timings": timings(a)}
    if a.passages:
        out["passages"] = a.passages
        out["sources"] = list(dict.fromkeys(p["doc_id"] for p in a.passages if p.get("quoted", True)))
    if a.shards:
        out["shards"] = a.shards
    return out


class CagTools:
    """The tools, bound to one Service. `loading`: the task loading the model (stdio), awaited by the
    first call that needs it; on HTTP the app's lifespan loads it and a call before then is refused
    as the routes refuse it (not ready)."""

    def __init__(self, service: Service):
        self.service = service
        self.loading: asyncio.Future | None = None

    async def ready(self) -> Service:
        if self.loading is not None:
            await asyncio.shield(self.loading)
        self.service.require_ready()
        return self.service

    async def _call(self, work: Callable[[Service], Awaitable[dict]]) -> CallToolResult:
        try:
            return _data(await work(await self.ready()))
        except CagError as e:
            return _error(e)

    async def list_corpora(self) -> Result:
        """List the corpora this server answers from: name, freshness (fresh or stale, with the reasons),
        documents, tokens, snapshot size and shards."""
        async def work(svc: Service) -> dict:
            items = await anyio.to_thread.run_sync(svc.engine.list)
            return {"corpora": [_summary(s) for s in items]}

        return await self._call(work)

    async def ask_corpus(self, corpus: CorpusArg, question: QuestionArg, mode: ModeArg = "cag",
                         max_tokens: MaxTokensArg = None, ctx: Context | None = None) -> Result:
        """Answer a question from one corpus. Returns the answer, its mode, finish_reason (length: cut at
        max_tokens), token counts (prompt_tokens; cached_tokens: those read from the corpus's cache), whether
        the corpus is stale, and for rag and cag+rag the retrieved passages and their documents (sources)."""
        async def work(svc: Service) -> dict:
            svc.check_question(question, mode)
            call = AskCall(Query(corpus, question, mode=str(mode), max_tokens=max_tokens, scope=_scope(ctx)))
            gen = svc.runner.start(svc.answers.work(call))
            try:
                a = await gen.result()
            finally:
                gen.close()  # a cancelled call (the client's notifications/cancelled) stops the generation
            svc.metrics.answer(a)
            return answer_of(svc, a, max_tokens)

        return await self._call(work)

    async def corpus_status(self, corpus: CorpusArg) -> Result:
        """One corpus's status, as `cag status` shows it: freshness with one reason per change that made it
        stale (edited, added or removed documents, another model, an expired TTL, ...), snapshot, documents,
        tokens, size, shards, source folder, model, when it was built and last used."""
        async def work(svc: Service) -> dict:
            s = await anyio.to_thread.run_sync(svc.engine.status, corpus)
            return {**s.to_dict(), **_summary(s)}

        return await self._call(work)


def build(service: Service, lifespan: Callable | None = None) -> tuple[MCPServer, CagTools]:
    tools = CagTools(service)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    server = MCPServer("cag", title="cag knowledge corpora", version=cag.__version__, instructions=INSTRUCTIONS,
                       lifespan=lifespan, log_level="WARNING")
    root.handlers[:], root.level = handlers, level  # MCPServer calls logging.basicConfig: keep the process's logging
    for fn, title in ((tools.list_corpora, "List corpora"), (tools.ask_corpus, "Ask a corpus"),
                      (tools.corpus_status, "Corpus status")):
        server.add_tool(fn, title=title, annotations=READ_ONLY, structured_output=True)
    return server, tools


# -- streamable HTTP on the FastAPI app ----------------------------------------------------------
class _Handled(Response):
    """A response that hands the request to the MCP session manager (it answers on its own)."""

    def __init__(self, handle):
        self.handle = handle
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        await self.handle(scope, receive, send)


def mount(app: FastAPI, service: Service, dependencies: list | None = None) -> MCPServer:
    """`/mcp` on `app` (streamable HTTP), behind `dependencies` (the API key check) like the API's routes.
    A session manager runs inside each run of the app's lifespan (one manager runs once)."""
    server, _ = build(service)
    running: list = []  # the current run's session manager
    router = APIRouter(include_in_schema=False)

    @router.api_route(PATH, methods=["GET", "POST", "DELETE"])
    async def mcp_endpoint(request: Request) -> Response:
        if not running:
            raise NotReady("the server is starting; retry when GET /health answers 200")
        return _Handled(running[0].handle_request)

    app.include_router(router, dependencies=dependencies)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator:
        # stateless: every POST stands alone (nothing to resume, no session to hijack, any replica answers).
        # The app's SameSite middleware checks Host and Origin, with CAG_ALLOWED_HOSTS;
        # the SDK's check would not know it.
        server.streamable_http_app(streamable_http_path=PATH, stateless_http=True, json_response=True,
                                   transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
        manager = server.session_manager
        async with inner(a) as state, manager.run():
            running[:] = [manager]
            try:
                yield state
            finally:
                running.clear()

    app.router.lifespan_context = lifespan
    app.state.mcp = server
    return server


# -- stdio: `cag mcp` ----------------------------------------------------------------------------
def serve_stdio(api_settings: ApiSettings, cag_settings: Settings) -> None:
    """Serve MCP on stdin/stdout until the client closes stdin. The SDK points fd 1 at stderr while it
    serves, so nothing but the protocol reaches stdout."""
    service = Service(api_settings, Engine(cag_settings, retrieval=retrieve))
    tools: CagTools  # built below, with this lifespan

    @contextlib.asynccontextmanager
    async def lifespan(_server) -> AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        tools.loading = loading = loop.create_future()

        def loaded() -> None:  # on the loop
            if not loading.done():
                loading.set_result(None)

        def load() -> None:  # a daemon thread: a client that leaves while the model loads is not kept waiting
            service.load()
            with contextlib.suppress(RuntimeError):  # the loop is closed: the client left first
                loop.call_soon_threadsafe(loaded)

        threading.Thread(target=load, name="cag-load", daemon=True).start()
        try:
            yield {}
        finally:
            service.close()

    server, tools = build(service, lifespan)
    server.run("stdio")
