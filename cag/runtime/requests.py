"""A request the decoder serves (what it asks, where its rows are, what it produced so far), and how
requests are grouped into steps of a fixed row count (CAG_DECODE_ROWS: cag.runtime.decoder's module doc
says why a row count is fixed)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cag.runtime.generate import DecodeConfig, Generated, TextStream
from cag.runtime.slots import PrefixKV


@dataclass(eq=False)
class Request:
    prefix: PrefixKV
    suffix: list[int]  # question (or conversation) tokens, prefilled at the prefix's end
    cfg: DecodeConfig
    on_text: Callable[[str], None] | None = None
    should_stop: Callable[[], bool] | None = None
    t_start: float = field(default_factory=time.perf_counter)
    score: bool = False  # keep each answer token's log-probability (sharded corpora pick by it)
    # the snapshot digest: its suffix is kept for, and may reuse, kept conversations (cag.runtime.kept_conversations)
    key: str | None = None
    shared: str | None = None  # the key of the warmed quotes it may reuse (Decoder.quotes; cag.answering.quotes)
    quote: bool = False  # a quote being warmed: kept in Decoder.quotes under `key`
    # knowledge prefilled as decode rows (cag.runtime.knowledge_kv): per layer (H_kv, c, D) rows copied into the slot
    # first, a callback given views of the slot's suffix rows as it finishes, and one after each piece (its rows)
    seed: list | None = None
    export: Callable[[list], None] | None = None
    on_piece: Callable[[int], None] | None = None
    # scheduler state
    start: int = 0  # suffix tokens copied from a kept conversation: prefill starts here
    filled: int = 0  # suffix tokens whose K/V are in the slot (the prefill goes in pieces: Decoder._pieces)
    slot: int | None = None
    length: int = 0  # suffix positions written
    next_tok: int | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    t_first: float | None = None
    stream: TextStream | None = None
    gen: torch.Generator | None = None  # a seeded request's sampler
    error: BaseException | None = None
    result: Generated | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def mean_logprob(self) -> float | None:
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else None


def fixed_rows(device: str, max_batch: int, setting: int = 0, alone: bool = False) -> int:
    """Rows of every decode step, 0 for as many as decode: CAG_DECODE_ROWS, whose 0 (auto) means
    max_batch on CUDA, 1 on the CPU where the step's kernels may sum a row differently beside others
    (`alone`: torch's kernels without AMX) and 0 elsewhere on the CPU (cag's kernels give a row the same
    bits at any row count: module doc); never more than max_batch."""
    if setting == 0:
        return max_batch if device == "cuda" else 1 if alone else 0
    return min(setting, max_batch)


def chunks(batch: list[Request], rows: int, room: int) -> list[tuple[list[Request], int | None]]:
    """The decode steps of `batch` at a fixed row count: requests over one prefix together, at most
    `rows` a step, each reading `room` suffix keys; a request whose suffix has reached `room` steps
    alone over its own width (None), so no request's width depends on another's length."""
    by: dict[int, list[Request]] = {}
    alone: list[tuple[list[Request], int | None]] = []
    for r in batch:
        if r.length < room:
            by.setdefault(id(r.prefix), []).append(r)
        else:
            alone.append(([r], None))
    return [(g[i : i + rows], room) for g in by.values() for i in range(0, len(g), rows)] + alone
