"""What the engine hands back: plain dataclasses and the two enums every layer shares.

The CLI prints these, the API serializes them, the comparison runner logs them; nothing here
imports torch, so reading a result never loads a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum


class Mode(str, Enum):
    """How a question reads the knowledge: from the snapshot, the whole corpus re-prefilled, or
    the top-k retrieved passages re-prefilled (the RAG baseline, built above the engine)."""

    CAG = "cag"
    FULL = "full"
    RAG = "rag"

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

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Answer:
    answer: str
    mode: str
    corpus: str
    snapshot: str | None
    stale: bool
    stale_reasons: list[str]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    load_ms: float
    ttft_ms: float
    total_ms: float
    retrieval_ms: float = 0.0  # rag mode only
    decode_tok_s: float | None = None  # tokens after the first, per second (None below two tokens)
    token_ids: list[int] = field(default_factory=list, repr=False)
    passages: list[dict] = field(default_factory=list, repr=False)  # rag mode: what was retrieved

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

    def to_dict(self) -> dict:
        return asdict(self)


class Reporter:
    """Hooks for long work; the CLI draws them (progress bar on a terminal), the API records them."""

    def estimate(self, n_tokens: int, n_bytes: int, reused: int) -> None: ...

    def progress(self, total: int) -> Callable[[int], None]:
        return lambda n: None

    def done(self) -> None: ...
