"""Ingest as named steps: plan the prefix, reuse a verified snapshot with the same key, or build
one (reusing the current snapshot's KV up to the first changed document), then publish it.

Each step takes the Engine (model, settings, index); `Engine.ingest` runs them under the
corpus's writer lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from cag.store import snapshots as snapfiles

from . import documents, kv
from .errors import SnapshotCorrupt, StaleRefused
from .hashing import short
from .prompt import Prefix, build_prefix
from .results import IngestResult, Reporter


@dataclass
class Plan:
    """What an ingest will write: the corpus's documents laid out as one prefix, and its key."""

    name: str
    source: Path
    docs: list[documents.Document]
    skipped: list[str]
    prefix: Prefix
    key: str
    ttl_s: float | None

    @property
    def digest(self) -> str:
        return short(self.key, 32)

    @property
    def spans(self) -> list[dict]:
        return [{"path": s[0], "content_hash": d.content_hash, "start": s[1], "end": s[2]}
                for s, d in zip(self.prefix.spans, self.docs)]


def plan(engine, name: str, source: Path, ttl_s: float | None) -> Plan:
    docs, skipped = engine.read_corpus(source, name)
    prefix = build_prefix(engine.lm.tokenizer, engine.layout(), [(d.name, d.text) for d in docs])
    engine.require_fit(len(prefix.ids), "knowledge")
    if ttl_s is None:
        ttl_s = (engine.index.corpus(name) or {}).get("ttl_s")
    return Plan(name, source, docs, skipped, prefix, engine.snapshot_key(prefix.ids), ttl_s)


def publish(engine, plan: Plan, snap_row: dict) -> None:
    corpus_row = {"name": plan.name, "source": str(plan.source), "model": engine.lm.name, "ttl_s": plan.ttl_s}
    doc_rows = [{"path": d.name, "content_hash": d.content_hash, "size": d.size, "mtime": d.mtime} for d in plan.docs]
    engine.index.publish(corpus_row, doc_rows, snap_row, plan.spans)


def reuse_fresh(engine, plan: Plan) -> IngestResult | None:
    """An existing snapshot with this key, verified exactly as a question would verify it."""
    row = engine.index.snapshot(plan.digest)
    if not row or row["status"] == "corrupt" or not Path(row["path"]).exists():
        return None
    try:
        engine.open_snapshot(row)
    except (SnapshotCorrupt, StaleRefused):
        return None  # rebuilt below (a corrupt file is marked so)
    publish(engine, plan, row)
    n = len(plan.prefix.ids)
    return IngestResult(plan.name, plan.digest, len(plan.docs), n, row["bytes"], 0.0, "fresh", reused_tokens=n,
                        estimate_bytes=engine.lm.kv_bytes(n, engine.kv_dtype), skipped=plan.skipped, path=row["path"])


def build(engine, plan: Plan, force: bool, reporter: Reporter) -> IngestResult:
    lm, ids = engine.lm, plan.prefix.ids
    n = len(ids)
    reused, old_kv = (0, None) if force else reusable(engine, plan.name, ids)
    est = lm.kv_bytes(n, engine.kv_dtype)
    reporter.estimate(n, est, reused)
    t0 = time.perf_counter()
    cache = kv.new_cache(lm.model, n + engine.room)
    if old_kv is not None:
        kv.load_into(cache, [(k[:, :, :reused], v[:, :, :reused]) for k, v in old_kv], lm.dtype, lm.device)
    kv.prefill(lm.model, cache, ids[reused:], reused, engine.settings.chunk_tokens, reporter.progress(n - reused))
    reporter.done()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    path = engine.settings.snapshots_dir / f"{plan.digest}.safetensors"
    created = time.time()
    meta = {"key": plan.key, "corpus": plan.name, "model": lm.name, "model_fingerprint": lm.fingerprint,
            "tokenizer_fingerprint": lm.tokenizer_fingerprint, "layout": engine.layout().as_dict(),
            "n_kv_heads": lm.n_kv_heads, "head_dim": lm.head_dim, "spans": plan.spans, "created": created,
            "compute_dtype": str(lm.dtype), "source": str(plan.source), "ttl_s": plan.ttl_s,
            "n_documents": len(plan.docs), "reused_tokens": reused, "prefill_ms": prefill_ms}
    nbytes = snapfiles.save(path, kv.export(cache, n), ids, meta, engine.kv_dtype)
    del cache
    publish(engine, plan, {
        "key": plan.key, "digest": plan.digest, "corpus": plan.name, "model": lm.name,
        "model_fingerprint": lm.fingerprint, "tokenizer_fingerprint": lm.tokenizer_fingerprint,
        "n_tokens": n, "n_documents": len(plan.docs), "bytes": nbytes, "dtype": engine.settings.kv_dtype,
        "path": str(path), "created": created, "last_used": None, "prefill_ms": prefill_ms, "reused_tokens": reused})
    engine.resident.evict(plan.digest)
    return IngestResult(plan.name, plan.digest, len(plan.docs), n, nbytes, round(prefill_ms, 1),
                        "refreshed" if reused else "built", reused, n - reused, est, plan.skipped, str(path))


def reusable(engine, corpus: str, ids: list[int]) -> tuple[int, list | None]:
    """Tokens of the current snapshot that stay valid: the longest common prefix of token ids,
    cut back to a document boundary (KV at position i depends only on tokens 0..i)."""
    row = engine.index.corpus(corpus)
    snap = engine.index.snapshot(row["current_snapshot"]) if row and row.get("current_snapshot") else None
    if not snap or snap["model_fingerprint"] != engine.lm.fingerprint or snap["dtype"] != engine.settings.kv_dtype:
        return 0, None
    try:
        old = engine.open_snapshot(snap)
    except (SnapshotCorrupt, StaleRefused):
        return 0, None
    common = 0
    for a, b in zip(old.ids, ids):
        if a != b:
            break
        common += 1
    spans = old.meta["spans"]
    bounds = [s["start"] for s in spans] + [max((s["end"] for s in spans), default=0)]
    cut = max((b for b in bounds if b <= common), default=0)
    return cut, (old.kv if cut else None)
