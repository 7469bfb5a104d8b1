"""Prometheus metrics, one registry per app (so several apps in one process never collide).

HTTP: requests by route/method/status, latency histograms by route. Model: tokens by kind
(prompt, cached = served from a snapshot, completion), time to first token, generations stopped
early. Engine (read at scrape time): resident snapshot hits and loads, resident bytes, queue, the
decode batch (steps, rows, size now).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from cag.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)


# The engine's counters and gauges read at scrape time: (family, metric name, key in Engine.stats, help)
ENGINE_STATS = (
    (CounterMetricFamily, "cag_snapshot_hits", "snapshot_hits",
     "Questions served from a resident (in-memory) snapshot."),
    (CounterMetricFamily, "cag_snapshot_loads", "snapshot_loads", "Snapshot files loaded (resident cache misses)."),
    (GaugeMetricFamily, "cag_conversations_kept", "conversations_kept",
     "Conversations whose K/V are kept for their next turn (cag.runtime.kept_conversations)."),
    (GaugeMetricFamily, "cag_conversation_bytes", "conversation_bytes",
     "Bytes of kept conversations (LRU bound: CAG_CONVERSATION_BYTES; counted in CAG_RESIDENT_BYTES too)."),
    (CounterMetricFamily, "cag_conversation_hits", "conversation_hits", "Requests that continued a kept conversation."),
    (CounterMetricFamily, "cag_conversation_misses", "conversation_misses",
     "Requests on a snapshot that found no kept conversation to continue."),
    (CounterMetricFamily, "cag_conversation_reused_tokens", "conversation_reused_tokens",
     "Prompt tokens copied from kept conversations instead of prefilled."),
    (CounterMetricFamily, "cag_conversation_evictions", "conversation_evictions",
     "Kept conversations evicted for the byte budget."),
    (GaugeMetricFamily, "cag_quotes_kept", "quotes_kept", "cag+rag quotes warmed and kept (CAG_WARM_QUOTES)."),
    (GaugeMetricFamily, "cag_quote_bytes", "quote_bytes",
     "Bytes of warmed quotes (LRU bound: CAG_QUOTE_BYTES; counted in CAG_RESIDENT_BYTES too)."),
    (CounterMetricFamily, "cag_quote_hits", "quote_hits", "Requests that began with a warmed quote."),
    (CounterMetricFamily, "cag_quote_reused_tokens", "quote_reused_tokens", "Prompt tokens copied from warmed quotes."),
    (CounterMetricFamily, "cag_decode_steps", "decode_steps",
     "Batched decode steps (one forward for every active request)."),
    (CounterMetricFamily, "cag_decode_rows", "decode_rows",
     "Tokens decoded in batched steps (rows / steps = mean batch size)."),
    (GaugeMetricFamily, "cag_decode_batch", "decode_active",
     "Requests in the decode batch now (CAG_MAX_BATCH at most)."),
    (GaugeMetricFamily, "cag_decode_waiting", "decode_waiting", "Requests waiting for a place in the decode batch."),
    (GaugeMetricFamily, "cag_decode_slot_bytes", "slot_bytes",
     "Bytes of one request's suffix slot (its conversation and answer K/V at the slot's full room; pages are "
     "used as tokens are written; 0 before the first batched answer)."),
)


class _EngineCollector:
    """Read at scrape time from what it was handed (no reference back to the service)."""

    def __init__(self, engine: Engine, running: Callable[[], int], waiting: Callable[[], int],
                 ready: Callable[[], bool]):
        self.engine, self.running, self.waiting, self.ready = engine, running, waiting, ready

    def collect(self):
        engine = self.engine
        stats = dict(engine.stats)
        yield GaugeMetricFamily("cag_resident_bytes", "Bytes held by resident snapshots, kept conversations "
                                "and warmed quotes (LRU bound: CAG_RESIDENT_BYTES).", value=engine.resident_bytes)
        for family, name, key, text in ENGINE_STATS:
            yield family(name, text, value=stats.get(key, 0))
        yield GaugeMetricFamily("cag_generations_running", "Generations running on a worker.", value=self.running())
        yield GaugeMetricFamily(
            "cag_generations_waiting", "Generations admitted and waiting for a worker.", value=self.waiting()
        )
        yield GaugeMetricFamily("cag_model_loaded", "1 once the model is loaded.", value=1 if self.ready() else 0)


class Metrics:
    """`engine` gives the snapshot counters and resident bytes; the callables the runner's
    generations running and waiting, and whether the model is loaded."""

    def __init__(self, engine: Engine, running: Callable[[], int], waiting: Callable[[], int],
                 ready: Callable[[], bool]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cag_http_requests", "HTTP requests by route, method and status.",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram(
            "cag_http_request_duration_seconds",
            "HTTP request latency (streams: until the last byte).",
            ["route"],
            buckets=_LATENCY,
            registry=r,
        )
        self.tokens = Counter(
            "cag_tokens",
            "Tokens by kind: prompt, cached (not recomputed: snapshot and kept conversation), conversation (of those, "
            "from a kept conversation), completion.",
            ["kind", "mode"],
            registry=r,
        )
        self.answers = Counter("cag_answers", "Answers generated.", ["mode"], registry=r)
        self.ttft = Histogram("cag_time_to_first_token_seconds", "Time to first token, request start to first token.",
                              ["mode"], buckets=_LATENCY, registry=r)
        self.load = Histogram(
            "cag_snapshot_load_seconds",
            "Getting a snapshot for a question (resident hit or file load).",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.stopped = Counter(
            "cag_generations_stopped", "Generations stopped early, by reason.", ["reason"], registry=r
        )
        self.jobs = Counter("cag_refresh_jobs", "Refresh jobs finished, by status.", ["status"], registry=r)
        r.register(_EngineCollector(engine, running, waiting, ready))

    def answer(self, a) -> None:
        self.answers.labels(a.mode).inc()
        self.tokens.labels("prompt", a.mode).inc(a.prompt_tokens)
        self.tokens.labels("cached", a.mode).inc(a.cached_tokens)
        self.tokens.labels("conversation", a.mode).inc(a.conversation_tokens)
        self.tokens.labels("completion", a.mode).inc(a.completion_tokens)
        self.ttft.labels(a.mode).observe(a.ttft_ms / 1e3)
        if a.mode == "cag":
            self.load.observe(a.load_ms / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)
