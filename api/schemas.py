"""Request and response models of the HTTP API (pydantic). Unknown request fields are ignored.

Requests are validated strictly: a JSON value must already have the declared type (`0` is not a
boolean, `"5"` not an integer), so what the OpenAPI description says is what the server accepts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from cag import results
from cag.answering import chat

# the engine's enums, as JSON-schema enums of their values (strict validation takes plain strings);
# spelled out for the type checker, and held to the enums here
Mode = Literal["cag", "full", "rag", "cag+rag"]
StalePolicy = Literal["serve", "refuse", "refresh"]
assert get_args(Mode) == tuple(m.value for m in results.Mode), "api/schemas.py's Mode differs from cag.results.Mode"
assert get_args(StalePolicy) == tuple(p.value for p in results.StalePolicy), "StalePolicy differs from cag.results'"


def _integral(v):
    # JSON Schema counts 2.0 as an integer (clients and fuzzers send it); 2.5, "2" and true are refused
    return int(v) if isinstance(v, float) and v.is_integer() else v


# bounds first: then they land in the JSON schema as minimum/maximum
Count = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
Count0 = Annotated[int, Field(ge=0), BeforeValidator(_integral)]
Integer = Annotated[int, BeforeValidator(_integral)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI's limit of 4; a length bound keeps the per-token check cheap
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None
STOP = ("Up to 4 stop sequences (a string or a list): the answer ends before the first one its text holds "
        "(searched from its first character that is not whitespace), finish_reason `stop`; the tokens before it are "
        "those decoded without `stop`, and decoding halts there. A stream never sends text that may start one.")


def stop_sequences(stop: str | list[str] | None) -> tuple[str, ...]:
    """`stop` as the engine takes it (cag.runtime.generate.DecodeConfig.stop)."""
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


# -- /v1/ask -------------------------------------------------------------------------------------
class AskRequest(_Request):
    corpus: str = Field(min_length=1, description="Corpus name, as listed by GET /v1/corpora.")
    question: str = Field(min_length=1, description="The question (limit: CAG_MAX_QUESTION_CHARS characters).")
    mode: Mode = Field(
        "cag",
        description="cag: from the snapshot; cag+rag: the snapshot, with the top-k passages quoted before the "
        "question; full: whole corpus in the prompt, no cache; rag: top-k passages.",
    )
    k: Count | None = Field(
        None, description="rag and cag+rag: passages to retrieve (BM25); default 3 for rag, 1 for cag+rag."
    )
    max_tokens: Count | None = Field(
        None, description="Answer length limit; clamped to CAG_ANSWER_ROOM. Default CAG_MAX_TOKENS."
    )
    min_tokens: Count0 = Field(
        0,
        description="No stop token before this many answer tokens (at most max_tokens), as vLLM's min_tokens: "
        "fixed-length answers for load tests.",
    )
    stream: bool = Field(False, description="Server-sent events: `token` events, then one `answer` event.")
    on_stale: StalePolicy = Field("serve", description="serve (flag it), refuse (409) or refresh first.")
    include_token_ids: bool = Field(False, description="Add the generated token ids to the answer.")
    history: list[ChatMessage] | None = Field(
        None,
        description="Earlier turns (system, user, assistant messages) before `question`, as in /v1/chat/completions.",
    )
    shards: Count = Field(
        1,
        description="Sharded corpora: answer from the S best shards (BM25 routing) and keep the most confident answer; "
        "more than the corpus has means all.",
    )
    stop: Stop = Field(None, description=STOP)


class Usage(BaseModel):
    prompt_tokens: int
    cached_tokens: int = Field(description="Prompt tokens not recomputed: the snapshot's and conversation_tokens.")
    conversation_tokens: int = Field(
        0, description="Of those, tokens reused from a kept conversation (earlier turns) or a warmed cag+rag quote."
    )
    completion_tokens: int


class Timings(BaseModel):
    load_ms: float = Field(description="Getting the snapshot: 0-ish for a resident hit, a file load on a miss.")
    ttft_ms: float
    total_ms: float
    retrieval_ms: float = 0.0
    routing_ms: float = Field(0.0, description="Sharded corpora: choosing the shard(s).")
    decode_tok_s: float | None = Field(None, description="Tokens after the first, per second (null below two tokens).")


class ShardInfo(BaseModel):
    shard: int
    snapshot: str | None = None
    score: float = Field(description="BM25 routing score of the shard (its best passage).")
    n_tokens: int
    mean_logprob: float | None = Field(
        None, description="Mean log-probability of the shard's answer (when several answered)."
    )
    chosen: bool = True


class DecodeInfo(BaseModel):
    weights: str = Field(
        description="The weights format decode multiplies in (CAG_WEIGHTS resolved): fp32, bf16, int8 or int4."
    )
    arithmetic: str = Field(
        description="What the weight products multiply: the weights format, or int4-q8 where cag's AVX-512 "
        "products meet int4 weights with 8-bit activations (per group of 32, as GGUF's Q4_0 x Q8_0)."
    )
    kernels: str = Field(
        description="What decode rows run on: amx, avx512 (cag's kernels), avx2 (cag's AVX2 kernels) or torch."
    )
    kernels_reason: str | None = Field(None, description="Why those kernels (a setting, the CPU, the head width ...).")
    step: Literal["fast", "forward"] = Field(
        description="fast: cag's lean batched step; forward: transformers' forward, one request at a time (a model the "
        "step does not cover)."
    )
    step_reason: str | None = Field(None, description="With `forward`: why the fast step does not cover this model.")
    native: Literal["layers", "glue", "attention", "none"] = Field(
        description="Which native kernels the fast step runs: layers (all layers in one call), glue (attention, "
        "products, norm / rope / silu; a family's q/k norms, post-norms, multipliers in torch), attention, or none."
    )


class AskResponse(BaseModel):
    answer: str
    corpus: str
    mode: Mode
    snapshot: str | None = None
    stale: bool
    stale_reasons: list[str]
    finish_reason: Literal["stop", "length"]
    usage: Usage
    timings: Timings
    token_ids: list[int] | None = None
    passages: list[dict[str, Any]] | None = None
    shards: list[ShardInfo] | None = Field(None, description="Sharded corpora: the shard(s) that answered.")
    decode: DecodeInfo | None = Field(
        None, description="What decoded the answer: weights format, kernels, fast step or forward."
    )


# -- corpora, models, jobs ---------------------------------------------------------------------
class CorpusInfo(BaseModel):
    name: str
    source: str
    model: str
    snapshot: str | None = None
    n_documents: int
    n_tokens: int
    bytes: int
    created: float | None
    last_used: float | None
    stale: bool
    reasons: list[str]


class CorpusList(BaseModel):
    corpora: list[CorpusInfo]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cag"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class JobInfo(BaseModel):
    id: str
    kind: Literal["refresh"] = "refresh"
    corpus: str
    status: Literal["queued", "running", "done", "failed"]
    created: float
    started: float | None = None
    finished: float | None = None
    total_tokens: int = Field(0, description="Tokens to prefill (known once the job has read the corpus).")
    done_tokens: int = 0
    reused_tokens: int = Field(0, description="Tokens kept from the previous snapshot.")
    progress: float = Field(0.0, description="done_tokens / total_tokens, 1.0 when done.")
    tokens_per_s: float | None = None
    eta_s: float | None = None
    result: dict[str, Any] | None = Field(None, description="The ingest result once done.")
    error: dict[str, Any] | None = None


class Health(BaseModel):
    status: Literal["ok", "loading", "error"]
    model: str | None = None
    decode_kernels: str | None = Field(
        None, description="What decode rows run on: amx, avx512 (cag's kernels), avx2 (cag's AVX2 kernels) or torch."
    )
    decode_kernels_reason: str | None = Field(
        None, description="Why those kernels (a setting, the CPU, no compiler ...)."
    )
    decode: DecodeInfo | None = Field(
        None, description="How answers decode: weights format, kernels, fast step or forward (and why)."
    )
    error: str | None = None
    replicas: int | None = Field(
        None, description="Under Ray Serve (`cag serve --replicas N`): engine replicas answering; 0 is `loading` (503)."
    )


# -- OpenAI-compatible chat ----------------------------------------------------------------------
class ContentPart(_Request):
    type: str = Field(
        description="Only `text` parts are read; any other type (image_url, input_audio, file) is refused."
    )
    text: str | None = None


def _unicode(content):
    # a lone surrogate ("\\ud800") passes the union below as a str (a plain str field refuses it) and
    # failed in the tokenizer with a 500: refused here, with the message's path as `param`
    texts = [content] if isinstance(content, str) else [p.text for p in content or () if p.text]
    for text in texts:
        if why := chat.unicode_problem(text):
            raise PydanticCustomError("string_unicode", "content " + why)
    return content


class ChatMessage(_Request):
    role: str = Field(description="system (or developer), user or assistant; tool and function are refused.")
    content: Annotated[str | list[ContentPart] | None, AfterValidator(_unicode)] = None


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    type: str = Field(
        description="Only `text` is accepted: json_object and json_schema are refused (unsupported_parameter)."
    )


class ChatRequest(_Request):
    model: str = Field(min_length=1, description="The corpus name (GET /v1/models).")
    messages: list[ChatMessage] = Field(
        min_length=1,
        description="The conversation: system messages, earlier user and assistant turns and, last, the user message "
        "to answer; all of it is the prompt after the corpus's knowledge (its K/V kept between turns).",
    )
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    min_tokens: Count0 = Field(
        0, description="Extension (as vLLM's): no stop token before this many completion tokens."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2, description="Unset, 0 or below 1e-5: greedy (exact).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling; the most likely token is always kept.")
    seed: Integer | None = Field(None, description="Sampling seed, any integer: taken modulo 2**64 (-1 is 2**64-1).")
    stop: Stop = Field(None, description=STOP)
    n: Count | None = Field(None, description="Only 1 is supported (more: 400 unsupported_parameter).")
    mode: Mode = Field("cag", description="Extension: cag | cag+rag | full | rag.")
    k: Count | None = Field(
        None, description="Extension: rag and cag+rag: passages to retrieve (BM25); default 3 for rag, 1 for cag+rag."
    )
    on_stale: StalePolicy = Field("serve", description="Extension: serve | refuse | refresh.")
    shards: Count = Field(1, description="Extension: sharded corpora answer from the S best shards.")
    # OpenAI's fields that cag does not honour: accepted where their value changes nothing, else refused with
    # 400 unsupported_parameter naming the field (api/openai_compat.py unsupported)
    tools: list[Any] | None = Field(
        None, description="Refused when not empty: cag answers from its corpus and calls no tools."
    )
    functions: list[Any] | None = Field(None, description="Refused when not empty (as `tools`).")
    tool_choice: str | dict[str, Any] | None = Field(None, description="Only `none` or `auto` (with no tools: none).")
    function_call: str | dict[str, Any] | None = Field(None, description="Only `none` or `auto` (as `tool_choice`).")
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored: no tools are called.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0: no penalties are applied.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Only 0: no penalties are applied.")
    logit_bias: dict[str, Any] | None = Field(None, description="Only empty: no biases are applied.")
    logprobs: bool | None = Field(None, description="Only false: log-probabilities are not returned.")
    top_logprobs: Count0 | None = Field(None, description="Only 0 (as `logprobs`).")
    response_format: ResponseFormat | None = Field(None, description="Only `{\"type\": \"text\"}`.")
    modalities: list[str] | None = Field(None, description="Only `[\"text\"]`.")
    audio: dict[str, Any] | None = Field(None, description="Refused when set: answers are text.")
    reasoning_effort: str | None = Field(None, description="Refused when set: the model does not reason first.")
    verbosity: str | None = Field(None, description="Refused when set.")
    web_search_options: dict[str, Any] | None = Field(
        None, description="Refused when set: answers come from the corpus."
    )
    user: str | None = Field(None, description="Accepted and ignored: conversations are matched by their tokens.")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[Choice]
    usage: ChatUsage
    cag: dict[str, Any] = Field(
        default_factory=dict, description="Extension: snapshot, staleness, timings, decode path."
    )


# -- server-sent events --------------------------------------------------------------------------
class TokenEvent(BaseModel):
    text: str = Field(description="A piece of the answer; the pieces concatenate to exactly the answer.")


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice] = Field(description="Empty in the usage chunk.")
    usage: ChatUsage | None = Field(None, description="Only in the last chunk, with stream_options.include_usage.")
    cag: dict[str, Any] | None = Field(
        None, description="Extension, in the usage chunk: snapshot, staleness, timings, decode path."
    )


# -- errors ------------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


# models that the OpenAPI description refers to by hand (error responses, event-stream items):
# no route declares them, so they are added to its components explicitly
REFERENCED = (ErrorResponse, TokenEvent, ChatCompletionChunk)
