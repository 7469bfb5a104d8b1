"""Native routes: ask, corpora, refresh jobs, metrics (`router`, behind the API key when one is
configured) and health (`open_router`, always open).

Routes that run the model are `async def` and hand the work to the runner's thread pool
(api/runner.py); routes that only read the index are plain `def` (FastAPI's threadpool).
"""

from __future__ import annotations

import logging
from typing import Any, Literal, cast

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from cag.answering.query import Query as AskQuery
from cag.engine import Answer
from cag.errors import CagError, NotFound
from cag.runtime import describe
from cag.runtime.generate import DecodeConfig

from .answers import AskCall, messages_of
from .auth import key_scope
from .deps import ReadyService, ServiceDep
from .errors import documented, error_body, status_of
from .metrics import CONTENT_TYPE
from .runner import Generation
from .schemas import (
    AskRequest,
    AskResponse,
    CorpusInfo,
    CorpusList,
    Health,
    JobInfo,
    Mode,
    ModelCard,
    ModelList,
    Timings,
    Usage,
    stop_sequences,
)
from .service import Service
from .streaming import EventStream, TextTrim, event

log = logging.getLogger("cag.api")

ERRORS = documented(400, 404, 413, 503)
MODEL_ERRORS = documented(400, 404, 409, 413, 429, 503, 504)


def sse_json(model: str) -> dict:
    """An event's `data`: JSON text holding one `model` (a component schema)."""
    return {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"$ref": f"#/components/schemas/{model}"}}


def streamed(description: str, item: dict) -> dict:
    """The 200 response of a route that streams with `stream: true` (JSON otherwise); `item`
    describes one event (`itemSchema`, as OpenAPI 3.2 and FastAPI's own event streams do)."""
    return {200: {"description": description, "content": {"text/event-stream": {"itemSchema": item}}}}


ASK_EVENTS = {"oneOf": [{"type": "object", "required": ["event", "data"],
                         "properties": {"event": {"const": name}, "data": sse_json(model)}}
                        for name, model in (("token", "TokenEvent"), ("answer", "AskResponse"),
                                            ("error", "ErrorResponse"))]}


router = APIRouter()
open_router = APIRouter()


def finish_reason(svc: Service, answer: Answer, requested: int | None) -> Literal["stop", "length"]:
    """`stop`: a stop token, or a stop sequence (also on the answer's last allowed token); `length`: max_tokens."""
    if answer.stopped:
        return "stop"
    return "length" if answer.completion_tokens >= svc.effective_max_tokens(requested) else "stop"


def timings(a: Answer) -> dict:
    return {"load_ms": a.load_ms, "ttft_ms": a.ttft_ms, "total_ms": a.total_ms, "retrieval_ms": a.retrieval_ms,
            "routing_ms": a.routing_ms, "decode_tok_s": a.decode_tok_s}


def ask_response(svc: Service, a: Answer, body: AskRequest) -> dict:
    extra: dict[str, Any] = {}
    if body.include_token_ids:
        extra["token_ids"] = list(a.token_ids)
    if a.passages:
        extra["passages"] = a.passages
    if a.shards:
        extra["shards"] = a.shards
    if a.decode:
        extra["decode"] = a.decode
    out = AskResponse(
        answer=a.answer, corpus=a.corpus, mode=cast(Mode, a.mode), snapshot=a.snapshot, stale=a.stale,
        stale_reasons=a.stale_reasons, finish_reason=finish_reason(svc, a, body.max_tokens),
        usage=Usage(prompt_tokens=a.prompt_tokens, cached_tokens=a.cached_tokens,
                    conversation_tokens=a.conversation_tokens, completion_tokens=a.completion_tokens),
        timings=Timings(**timings(a)),
        **extra,
    )
    return out.model_dump(exclude_unset=True)  # token_ids, passages and shards only when there are any


def start_ask(svc: Service, body: AskRequest, scope: str | None = None) -> Generation:
    svc.check_question(body.question, body.mode)
    messages = None
    if body.history:  # earlier turns: the question is the conversation's last user message
        messages = (*messages_of(body.history), ("user", body.question))
        for _, text in messages:
            svc.check_question(text, body.mode)
    query = AskQuery(
        body.corpus,
        body.question if messages is None else None,
        mode=str(body.mode),
        max_tokens=body.max_tokens,
        on_stale=str(body.on_stale),
        shards=body.shards,
        messages=messages,
        scope=scope,
        k=body.k,
        decoding=DecodeConfig(min_tokens=body.min_tokens, stop=stop_sequences(body.stop)),
    )
    call = AskCall(query, stream=body.stream)
    return svc.runner.start(svc.answers.work(call))


async def stream_errors(gen: Generation, name: str | None):
    """Await the next event; a failure mid-stream becomes one SSE error event (the status is sent)."""
    try:
        return await gen.next(), None
    except CagError as e:
        return None, event(error_body(status_of(e), str(e), e.code), name)
    except Exception:  # noqa: BLE001 - logged; the client gets the error shape
        log.exception("generation failed mid-stream")
        return None, event(error_body(500, "internal server error", "internal_error"), name)


ASK_STREAM = ("The answer (JSON); with `stream: true` server-sent events instead: `event: token` with "
              "`{\"text\"}` pieces, then one `event: answer` with the JSON answer, or one `event: error`.")


@router.post(
    "/v1/ask",
    response_model=AskResponse,
    response_model_exclude_unset=True,
    responses={**streamed(ASK_STREAM, ASK_EVENTS), **MODEL_ERRORS},
    tags=["ask"],
    summary="Answer a question from a corpus",
)
async def ask(body: AskRequest, request: Request, svc: ReadyService):
    """With `stream: true` the answer comes as server-sent events: `event: token` with `{"text"}`
    pieces (their concatenation is the answer), then one `event: answer` with the full JSON answer;
    a failure after the stream started is one `event: error` with the error shape."""
    gen = start_ask(svc, body, key_scope(request))
    if not body.stream:
        try:
            answer = await gen.result(request)
        finally:
            gen.close()
        svc.metrics.answer(answer)
        return ask_response(svc, answer, body)
    try:  # errors before the first token (unknown corpus, stale, ...) keep their HTTP status
        first = await gen.next(request)
    except BaseException:
        gen.close()
        raise

    async def events():
        trim, item = TextTrim(), first
        while True:
            kind, value = item
            if kind == "text":
                if piece := trim.push(value):
                    yield event({"text": piece}, "token")
            else:
                svc.metrics.answer(value)
                if tail := trim.finish(value.answer):
                    yield event({"text": tail}, "token")
                yield event(ask_response(svc, value, body), "answer")
                return
            item, error = await stream_errors(gen, "error")
            if error:
                yield error
                return

    return EventStream(events(), gen)


# -- corpora and models -------------------------------------------------------------------------
@router.get("/v1/corpora", response_model=CorpusList, responses=ERRORS, tags=["corpora"],
            summary="Corpora with their snapshots and freshness")
def list_corpora(svc: ReadyService):
    return {"corpora": [s.to_dict() for s in svc.engine.list()]}


@router.get("/v1/corpora/{name}", response_model=CorpusInfo, responses=ERRORS, tags=["corpora"],
            summary="One corpus: snapshot, size, freshness (as `cag status` shows it)")
def corpus_status(name: str, svc: ReadyService):
    return svc.engine.status(name).to_dict()


@router.post("/v1/corpora/{name}/refresh", status_code=202, response_model=JobInfo, responses=ERRORS,
             tags=["corpora"], summary="Refresh a corpus's snapshot in the background")
def refresh(name: str, svc: ReadyService, response: Response,
            force: bool = Query(False, description="Rebuild from scratch instead of reusing unchanged documents.")):
    """Returns 202 and the job at once; a refresh already running for the corpus is returned
    instead of starting a second one. Poll `GET /v1/jobs/{id}`."""
    job, _ = svc.jobs.refresh(name, force=force)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return job.to_dict()


@router.get("/v1/jobs/{job_id}", response_model=JobInfo, responses=ERRORS, tags=["corpora"],
            summary="Progress and result of a refresh job")
def job_status(job_id: str, svc: ServiceDep):
    return svc.jobs.get(job_id).to_dict()


@router.get("/v1/models", response_model=ModelList, responses=ERRORS, tags=["openai"],
            summary="Corpora as OpenAI models (use the id as `model`)")
def list_models(svc: ReadyService):
    return {"data": [_card(row) for row in svc.engine.index.corpora()]}


@router.get("/v1/models/{model}", response_model=ModelCard, responses=ERRORS, tags=["openai"],
            summary="One corpus as an OpenAI model")
def get_model(model: str, svc: ReadyService):
    row = svc.engine.index.corpus(model)
    if row is None:
        raise NotFound(f"unknown model (corpus) {model!r}; GET /v1/models lists them")
    return _card(row)


def _card(row: dict) -> dict:
    return {"id": row["name"], "created": int(row.get("created") or 0)}


# -- operations ---------------------------------------------------------------------------------
@open_router.get("/health", response_model=Health, response_model_exclude_none=True,
                 responses={503: {"model": Health, "description": "Loading, or the model failed to load."}},
                 tags=["operations"], summary="200 once the model is loaded, 503 before (never needs a key)")
@open_router.head("/health", include_in_schema=False)  # load balancers probe with HEAD: GET's status, no body
async def health(svc: ServiceDep):
    """Open to anyone: it names the model and how it decodes (weights format, kernels, fast step or
    forward, and why) once loaded, and says no more than `error` when loading failed (the reason, which
    may hold file paths, is in the server's log)."""
    extra = svc.answers.health()  # under Ray Serve: {"replicas": engine replicas answering}; 0 is not ready
    if svc.ready and extra.get("replicas", 1):
        lm = svc.engine.lm
        return {"status": "ok", "model": svc.model_name, "decode_kernels": lm.kernels,
                "decode_kernels_reason": lm.kernels_why or None, "decode": describe.decode_path(lm), **extra}
    if svc.load_error:
        return JSONResponse({"status": "error", "error": "the model failed to load; see the server log"},
                            status_code=503)
    return JSONResponse({"status": "loading", **extra}, status_code=503)


class PrometheusText(Response):
    media_type = CONTENT_TYPE


@router.get("/metrics", response_class=PrometheusText, tags=["operations"], summary="Prometheus metrics",
            responses={200: {"description": "Prometheus text exposition format.",
                             "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
def metrics(svc: ServiceDep):
    """Behind the API key like every route but /health (Prometheus sends one with `authorization`
    in its scrape config)."""
    return PrometheusText(svc.metrics.render())
