"""What the engine hands back: plain dataclasses and the two enums every layer shares.

The CLI prints these, the API serializes them, the comparison runner logs them; nothing here
imports torch, so reading a result never loads a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum


def human_bytes(n: float) -> str:
    """A size for an error message or a report, in binary units as computed: 512 B, 1.5 KiB, 2.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class Mode(str, Enum):
    """How a question reads the knowledge: from the snapshot, the whole corpus re-prefilled, or
    the top-k retrieved passages re-prefilled (the RAG baseline; cag.answering.retrieval)."""

    CAG = "cag"
    FULL = "full"
    RAG = "rag"
    HYBRID = "cag+rag"  # the snapshot, with the top-k passages quoted before the question (cag.answering.retrieval)

    def __str__(self) -> str:
        return self.value


class StalePolicy(str, Enum):
    """What a question on a stale corpus does: answer and flag it, refuse, or refresh first."""

    SERVE = "serve"
    REFUSE = "refuse"
    REFRESH = "refresh"

    def __str__(self) -> str:
        return self.value


def choices(enum: type[Enum]) -> str:
    return ", ".join(m.value for m in enum)


@dataclass
class IngestResult:
    corpus: str
    snapshot: str  # key digest
    n_documents: int
    n_tokens: int
    bytes: int
    prefill_ms: float
    status: str  # built | refreshed | fresh
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    estimate_bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    path: str = ""
    n_shards: int = 1
    shards: list[dict] = field(default_factory=list)  # per shard: shard, snapshot, n_tokens, bytes, status, ...
    warnings: list[str] = field(default_factory=list)  # ingested, but not as a user may expect (a sentence cut)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, plan, built: list, estimates: list[int]) -> IngestResult:
        """The result of an ingest (cag.knowledge.ingest Plan and Built per shard); the top-level snapshot and
        path are shard 0's, sizes and times add up over the shards."""
        shards = [{"shard": s.index, "snapshot": b.row["digest"], "n_documents": len(s.units),
                   "n_tokens": len(s.prefix.ids), "bytes": b.row["bytes"], "status": b.status,
                   "reused_tokens": b.reused, "prefill_ms": round(b.prefill_ms, 1)} for s, b in zip(plan.shards, built)]
        statuses = {b.status for b in built}  # fresh: nothing prefilled; built: everything; else refreshed
        status = statuses.pop() if len(statuses) == 1 else "refreshed"
        n = sum(x["n_tokens"] for x in shards)
        reused = sum(b.reused for b in built)
        return cls(plan.name, shards[0]["snapshot"], len(plan.docs), n, sum(x["bytes"] for x in shards),
                   round(sum(b.prefill_ms for b in built), 1), status, reused, n - reused, sum(estimates),
                   plan.skipped, built[0].row["path"], len(shards), shards, plan.warnings)


@dataclass
class Answer:
    answer: str
    mode: str
    corpus: str
    snapshot: str | None
    stale: bool
    stale_reasons: list[str]
    prompt_tokens: int
    cached_tokens: int  # the snapshot's tokens plus conversation_tokens
    completion_tokens: int
    load_ms: float
    ttft_ms: float
    total_ms: float
    retrieval_ms: float = 0.0  # rag mode only
    decode_tok_s: float | None = None  # tokens after the first, per second (None below two tokens)
    routing_ms: float = 0.0  # sharded corpora: choosing the shard(s)
    warnings: list[str] = field(default_factory=list)  # what went wrong beside the answer (the query log not written)
    shards: list[dict] = field(default_factory=list)  # sharded corpora: the shard(s) that answered, with scores
    token_ids: list[int] = field(default_factory=list, repr=False)
    passages: list[dict] = field(default_factory=list, repr=False)  # rag mode: what was retrieved
    # prompt tokens of earlier turns reused from the kept conversation (cag.runtime.kept_conversations)
    conversation_tokens: int = 0
    # what decoded it: weights, kernels, fast step or forward (cag.runtime.describe)
    decode: dict = field(default_factory=dict)
    stopped: bool = False  # the answer ends before a stop sequence (DecodeConfig.stop): its finish reason is `stop`

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("token_ids")
        return d


@dataclass
class CorpusStatus:
    name: str
    source: str
    model: str
    snapshot: str | None
    n_documents: int
    n_tokens: int
    bytes: int
    created: float | None
    last_used: float | None
    stale: bool
    reasons: list[str]
    n_shards: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


class Reporter:
    """Hooks for long work; the CLI draws them (progress bar on a terminal), the API records them."""

    def estimate(self, n_tokens: int, n_bytes: int, reused: int) -> None: ...

    def progress(self, total: int) -> Callable[[int], None]:
        return lambda n: None

    def done(self) -> None: ...
