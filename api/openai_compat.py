"""OpenAI-compatible chat completions: `model` names a corpus, `messages` are the conversation.

The knowledge prefix is the corpus's snapshot; the conversation (system messages, earlier turns, the last user message)
is the suffix after it (cag.answering.chat), its K/V kept between turns (cag.runtime.kept_conversations), so a follow-up
prefills only its new tokens. `usage.prompt_tokens_details.cached_tokens` counts the snapshot's tokens and the reused
conversation's; the `cag` extension says which. `stop` sequences end the answer before them
(cag.runtime.generate.TextStream); OpenAI's fields that cag does not honour are refused where their value would change
the answer (`unsupported`), others are ignored. Extensions (ignored by OpenAI clients, settable with `extra_body`):
`mode`, `on_stale`; the response carries a `cag` object with the snapshot, staleness, timings and the decode path
(`decode`).
"""

from __future__ import annotations

import secrets
import time

from fastapi import APIRouter, Request

from cag.answering.query import Query
from cag.runtime.generate import DecodeConfig

from .answers import AskCall, messages_of
from .auth import key_scope
from .deps import ReadyService
from .errors import Unsupported
from .routes import MODEL_ERRORS, finish_reason, sse_json, stream_errors, streamed, timings
from .schemas import ChatCompletion, ChatRequest, stop_sequences
from .service import Service
from .streaming import EventStream, ServerSentEvent, TextTrim, event

router = APIRouter(tags=["openai"])


def _extension(a) -> dict:
    return {
        "corpus": a.corpus,
        "mode": a.mode,
        "snapshot": a.snapshot,
        "stale": a.stale,
        "cached_tokens": {"snapshot": a.cached_tokens - a.conversation_tokens, "conversation": a.conversation_tokens},
        "stale_reasons": a.stale_reasons,
        "timings": timings(a),
        **({"shards": a.shards} if a.shards else {}),
        # what was read besides the snapshot (rag, cag+rag): the passages sent, by name
        **({"passages": [p["name"] for p in a.passages if p.get("quoted", True)]} if a.passages else {}),
        **({"decode": a.decode} if a.decode else {}),
    }


def _usage(a) -> dict:
    return {"prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens,
            "total_tokens": a.prompt_tokens + a.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": a.cached_tokens}}


def _fingerprint(a) -> str | None:
    return f"cag-{a.snapshot[:16]}" if a.snapshot else None


CHAT_STREAM = ("A `chat.completion` (JSON); with `stream: true` server-sent events instead: "
               "`chat.completion.chunk` objects, a usage chunk when `stream_options.include_usage`, then `[DONE]`.")


CHAT_EVENTS = {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
    sse_json("ChatCompletionChunk"), sse_json("ErrorResponse"), {"const": "[DONE]"}]}}}


@router.post("/v1/chat/completions", response_model=ChatCompletion,
             responses={**streamed(CHAT_STREAM, CHAT_EVENTS), **MODEL_ERRORS},
             summary="OpenAI-compatible chat completion over a corpus")
async def chat_completions(body: ChatRequest, request: Request, svc: ReadyService):
    """Greedy (exact) unless `temperature` > 0 (below 1e-5 it is greedy too). `max_completion_tokens`
    or `max_tokens` are clamped to CAG_ANSWER_ROOM. `stop`: up to 4 sequences the answer ends before
    (finish_reason `stop`; a stream never sends text that may start one). OpenAI's fields that cag does not
    honour are 400 `unsupported_parameter` where their value would change the answer. With `stream: true`:
    `chat.completion.chunk` events, a usage chunk when `stream_options.include_usage`, then `data: [DONE]`."""
    unsupported(body)
    messages = messages_of(body.messages)
    for _, text in messages:
        svc.check_question(text, body.mode)
    max_tokens = body.max_completion_tokens or body.max_tokens
    # torch.Generator takes seeds 0 .. 2**64-1 (and wraps negative ones the same way): any integer is
    # reduced into that range instead of overflowing there
    seed = None if body.seed is None else body.seed % 2**64
    decoding = DecodeConfig(temperature=body.temperature or 0.0, top_p=body.top_p or 1.0, seed=seed,
                            min_tokens=body.min_tokens, stop=stop_sequences(body.stop))
    query = Query(
        body.model,
        None,
        mode=str(body.mode),
        messages=messages,
        max_tokens=max_tokens,
        on_stale=str(body.on_stale),
        shards=body.shards,
        decoding=decoding,
        k=body.k,
        scope=key_scope(request),
    )
    call = AskCall(query, stream=body.stream)
    gen = svc.runner.start(svc.answers.work(call))
    cid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
    if not body.stream:
        try:
            a = await gen.result(request)
        finally:
            gen.close()
        svc.metrics.answer(a)
        return {"id": cid, "created": created, "model": body.model, "system_fingerprint": _fingerprint(a),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": a.answer},
                             "finish_reason": finish_reason(svc, a, max_tokens)}],
                "usage": _usage(a), "cag": _extension(a)}
    try:
        first = await gen.next(request)
    except BaseException:
        gen.close()
        raise
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventStream(_chunks(svc, gen, first, body.model, cid, created, max_tokens, include_usage), gen)


def unsupported(body: ChatRequest) -> None:
    """Refuse OpenAI's fields that cag does not honour, where their value would change the answer (400
    unsupported_parameter, the field as `param`); where it changes nothing (`n: 1`, `logprobs: false`,
    `frequency_penalty: 0`, `tools: []`, `response_format: {"type": "text"}` ...) they are accepted. Fields
    that are not OpenAI's are ignored (extra="ignore"), as OpenAI-compatible servers do."""
    def refuse(param: str, why: str):
        raise Unsupported(f"{param}: {why}", param)

    if body.n is not None and body.n != 1:
        refuse("n", f"only one choice is generated (n: 1), got {body.n}")
    for name in ("tools", "functions"):
        if getattr(body, name):
            refuse(name, "cag answers from its corpus and calls no tools")
    for name in ("tool_choice", "function_call"):
        if (value := getattr(body, name)) not in (None, "none", "auto"):
            refuse(name, f"cag calls no tools: only 'none' or 'auto' are accepted, got {value!r}")
    for name in ("frequency_penalty", "presence_penalty"):
        if value := getattr(body, name):
            refuse(name, f"no penalties are applied: only 0 is accepted, got {value}")
    if body.logit_bias:
        refuse("logit_bias", "no token biases are applied: only {} is accepted")
    if body.logprobs:
        refuse("logprobs", "log-probabilities are not returned: only false is accepted")
    if body.top_logprobs:
        refuse("top_logprobs", f"log-probabilities are not returned: only 0 is accepted, got {body.top_logprobs}")
    if body.response_format is not None and body.response_format.type != "text":
        refuse("response_format", f"only {{\"type\": \"text\"}} is accepted, got {body.response_format.type!r}")
    if body.modalities is not None and set(body.modalities) - {"text"}:
        refuse("modalities", f"answers are text: only [\"text\"] is accepted, got {body.modalities}")
    for name, why in (("audio", "answers are text"), ("reasoning_effort", "the model answers without reasoning first"),
                      ("verbosity", "the answer's length is set by max_tokens and stop only"),
                      ("web_search_options", "answers come from the corpus, not the web")):
        if getattr(body, name) is not None:
            refuse(name, f"not supported ({why})")


async def _chunks(svc: Service, gen, first, model: str, cid: str, created: int, max_tokens: int | None,
                  include_usage: bool):
    def chunk(delta: dict, finish: str | None = None, fingerprint: str | None = None) -> ServerSentEvent:
        c = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
             "system_fingerprint": fingerprint,
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        return event(c)

    yield chunk({"role": "assistant", "content": ""})
    trim, item = TextTrim(), first
    while True:
        kind, value = item
        if kind == "text":
            if piece := trim.push(value):
                yield chunk({"content": piece})
        else:
            a = value
            svc.metrics.answer(a)
            if tail := trim.finish(a.answer):
                yield chunk({"content": tail})
            yield chunk({}, finish_reason(svc, a, max_tokens), _fingerprint(a))
            if include_usage:
                yield event({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "system_fingerprint": _fingerprint(a), "choices": [], "usage": _usage(a),
                           "cag": _extension(a)})
            break
        item, error = await stream_errors(gen, None)
        if error:
            yield error
            break
    yield event("[DONE]")
