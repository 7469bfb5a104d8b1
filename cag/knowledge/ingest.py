"""Ingest as named steps: plan the shards (one, when the corpus fits a context), then per shard
reuse a verified snapshot with the same key or build one (reusing the shard's current snapshot up
to its first changed document), then publish every shard in one transaction.

`read` needs no model; the steps after it (`run`) take a SnapshotSetup (model, layout, settings, index, store:
cag.knowledge.setup), and `Engine.ingest` runs them under the corpus's writer lock, evicting a rebuilt
snapshot from memory. A crash before `publish` leaves the corpus on its previous snapshots.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cag.errors import BadInput, ModelError, SnapshotCorrupt, StaleRefused, TooLarge
from cag.hashing import short
from cag.knowledge import documents, verify
from cag.knowledge.corpus import read_corpus
from cag.knowledge.setup import SnapshotSetup
from cag.knowledge.shards import Unit, pack, units_of
from cag.model import windows
from cag.model.prompt import PrefixTokens, document_text, encode_template, encode_text
from cag.results import human_bytes
from cag.runtime import knowledge_kv, kv_cache
from cag.store import snapshots as snapfiles

if TYPE_CHECKING:
    from cag.config import Settings
    from cag.store.index import Index
    from cag.store.remote import Ref
    from cag.store.sync import LocalOnly, Shared


@dataclass
class Shard:
    """One shard's prefix (head | units | mid) and its key."""

    index: int
    units: list[Unit]
    prefix: PrefixTokens
    key: str

    @property
    def digest(self) -> str:
        return short(self.key, 32)

    @property
    def spans(self) -> list[dict]:
        return [{"path": u.name, "content_hash": u.content_hash, "start": s[1], "end": s[2]}
                for s, u in zip(self.prefix.spans, self.units)]


@dataclass
class Plan:
    """What an ingest will write: the corpus's documents packed into shards."""

    name: str
    source: Path
    docs: list[documents.Document]
    skipped: list[str]
    ttl_s: float | None
    shard_tokens: int | None
    shards: list[Shard] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ref: Ref | None = None  # with a shared store: the corpus's ref read at the start (a conditional write expects it)


@dataclass
class Built:
    """A shard's snapshot after this ingest: its index row and how it came to be."""

    row: dict
    status: str  # built | refreshed | fresh
    reused: int = 0
    prefill_ms: float = 0.0


def read(index: Index, remote: Shared | LocalOnly, settings: Settings, name: str, source: Path, ttl_s: float | None,
         shard_tokens: int | None, reporter=None) -> Plan:
    """Read the corpus (within CAG_MAX_DOCUMENT_BYTES / CAG_MAX_CORPUS_BYTES), before the model loads: a
    plan with no shards yet (`pack_shards`)."""
    index.require_writable("cannot record the snapshot")  # a read-only index fails now, before any work
    ref = remote.pull(name) if remote else None  # another machine's newer ref is adopted first
    row = index.corpus(name) or {}
    ttl_s = row.get("ttl_s") if ttl_s is None else ttl_s
    shard_tokens = row.get("shard_tokens") if shard_tokens is None else shard_tokens or None
    docs, skipped = read_corpus(index, source, name, settings, reporter)  # refused before the model loads
    return Plan(name, source, docs, skipped, ttl_s, shard_tokens, ref=ref)


def pack_shards(setup: SnapshotSetup, plan: Plan, reporter=None) -> Plan:
    """Pack the plan's documents into shards that each fit the context (and its `shard_tokens`); refuse
    shards that would not fit on the disk."""
    name, docs, shard_tokens = plan.name, plan.docs, plan.shard_tokens
    lm, layout, room = setup.lm, setup.layout, setup.room
    head, mid = encode_template(lm.tokenizer, layout.head), encode_template(lm.tokenizer, layout.mid)
    capacity, layout_tokens = lm.max_context - room, len(head) + len(mid)
    if capacity - layout_tokens < 16:  # the rooms' fault, whatever --shard-tokens says: name them
        raise BadInput(
            f"CAG_QUESTION_ROOM + CAG_ANSWER_ROOM ({room}) leave no room in the model's context ({lm.max_context}) for "
            f"knowledge (the prompt layout alone is {layout_tokens} tokens): lower them"
        )
    if shard_tokens:
        capacity = min(capacity, shard_tokens)
    if capacity - layout_tokens < 16:
        raise BadInput(f"shards of {capacity} tokens leave no room for knowledge: the prompt layout alone is "
                       f"{layout_tokens} tokens (raise --shard-tokens)")
    tokenizing = getattr(reporter, "tokenizing", None)
    tick = tokenizing(sum(len(d.text) for d in docs)) if tokenizing else None
    units = units_of(lm.tokenizer, docs, capacity - len(head) - len(mid), tick)
    getattr(reporter, "tokenized", lambda: None)()
    previous = [[s["path"] for s in setup.index.snapshot_documents(r["snapshot"])] for r in setup.index.shards(name)]
    out = plan
    out.warnings += [f"{u.name}: a sentence longer than a shard, cut between tokens" for u in units if u.cut_by_tokens]
    for i, sp in enumerate(pack(units, capacity, len(head) + len(mid), previous)):
        ids, spans = list(head), []
        for u in sp.units:
            start = len(ids)
            ids += u.ids if u.ids is not None else encode_text(lm.tokenizer, document_text(u.name, u.text))
            u.ids = None  # held once, in the shard's ids
            spans.append((u.name, start, len(ids)))
        ids += mid
        setup.require_fit(len(ids), "a shard's knowledge")
        out.shards.append(Shard(i, sp.units, PrefixTokens(ids, spans), setup.key(ids)))
    check_room(setup, out)
    return out


def header_bytes(setup: SnapshotSetup, shard: Shard) -> int:
    """What a snapshot file holds beside the K/V formula: its token ids (int64), the documents' spans
    and the metadata (JSON), ~100 bytes of index per tensor, and int8's fp16 scales (one per 32 values)."""
    n, layers = len(shard.prefix.ids), setup.lm.n_layers
    scales = setup.lm.kv_bytes(n, setup.kv_dtype) // 16 if setup.kv_name == "int8" else 0
    return 8 * n + 200 * len(shard.prefix.spans) + 4096 + 100 * 4 * layers + scales


def check_room(setup: SnapshotSetup, plan: Plan) -> None:
    """Refuse, before any prefill, snapshots that cannot fit on the disk: the KV-size formula over
    the shards not already there, against the free space of the snapshots folder."""
    folder = setup.settings.snapshots_dir
    new = [s for s in plan.shards if not (folder / f"{s.digest}.safetensors").exists()]
    need = sum(setup.lm.kv_bytes(len(s.prefix.ids), setup.kv_dtype) + header_bytes(setup, s) for s in new)
    here = next((p for p in (folder, *folder.parents) if p.exists()), None)
    free = shutil.disk_usage(here).free if here is not None and need else None
    if free is not None and need > free:
        n = sum(len(s.prefix.ids) for s in plan.shards)
        raise TooLarge(
            f"the knowledge of {plan.name!r} is {n} tokens in {len(plan.shards)} shard(s): its snapshots need "
            f"~{human_bytes(need)} and {folder} has {human_bytes(free)} free; free space, or ingest less"
        )


def reuse_fresh(setup: SnapshotSetup, shard: Shard) -> Built | None:
    """An existing snapshot with this shard's key, verified exactly as a question would verify it."""
    row = setup.index.snapshot(shard.digest)
    if not row or row["status"] == "corrupt" or (not Path(row["path"]).exists() and not setup.remote):
        return None  # with a shared store a file missing here is fetched (and verified) by open_snapshot
    try:
        verify.open_snapshot(setup, row)
    except (SnapshotCorrupt, StaleRefused):
        return None  # rebuilt (a corrupt file is marked so)
    if setup.remote:  # the ref about to name it needs the blob in the store
        setup.remote.put_blob(Path(row["path"]), shard.digest)
    return Built(row, "fresh", reused=len(shard.prefix.ids))


def reusable(setup: SnapshotSetup, corpus: str, shard: Shard) -> tuple[int, list | None]:
    """Tokens of the shard's current snapshot that stay valid: the longest common prefix of token
    ids, cut back to a document boundary and then to a whole prefill block (KV at position i depends only
    on tokens 0..i, and the prefill starts blocks at multiples of the block: kv_cache.prefill_knowledge)."""
    rows = setup.index.shards(corpus)
    digest = rows[shard.index]["snapshot"] if shard.index < len(rows) else None
    snap = setup.index.snapshot(digest) if digest else None
    if not snap or snap["model_fingerprint"] != setup.lm.fingerprint or snap["dtype"] != setup.kv_name:
        return 0, None
    try:  # int8 dequantized in fp32: the kept positions quantize again to the very same bytes
        old = verify.open_snapshot(setup, snap, dequant=torch.float32)
    except (SnapshotCorrupt, StaleRefused):
        return 0, None
    common = 0
    for a, b in zip(old.ids, shard.prefix.ids):
        if a != b:
            break
        common += 1
    spans = old.meta["spans"]
    bounds = [s["start"] for s in spans] + [max((s["end"] for s in spans), default=0)]
    cut = max((b for b in bounds if b <= common), default=0)
    how = setup.prefill(len(shard.prefix.ids))
    if knowledge_kv.of_meta(old.meta) != how:  # prefilled another way (or to be): nothing of it is reused
        return 0, None
    cut = windows.reusable(cut - cut % knowledge_kv.block(how), len(old.ids), setup.lm.windows)
    return cut, (old.kv if cut else None)


def build(setup: SnapshotSetup, plan: Plan, shard: Shard, reused: int, old_kv, tick) -> Built:
    """Prefill the shard (after its `reused` tokens) and save its snapshot file atomically."""
    lm, ids = setup.lm, shard.prefix.ids
    n = len(ids)
    t0 = time.perf_counter()
    how = setup.prefill(n)
    seed = [(k[:, :, :reused], v[:, :, :reused]) for k, v in old_kv] if old_kv is not None and reused else None
    layers = [(k.cpu(), v.cpu()) for k, v in setup.compute(how, setup.kv_dtype, ids, seed, tick)]
    prefill_ms = (time.perf_counter() - t0) * 1e3
    path = setup.settings.snapshots_dir / f"{shard.digest}.safetensors"
    created = time.time()
    meta = {"key": shard.key, "corpus": plan.name, "model": lm.name, "model_fingerprint": lm.fingerprint,
            "tokenizer_fingerprint": lm.tokenizer_fingerprint, "layout": setup.layout.as_dict(),
            "n_kv_heads": lm.n_kv_heads, "head_dim": lm.head_dim, "spans": shard.spans, "created": created,
            "compute_dtype": str(lm.dtype), "source": str(plan.source), "ttl_s": plan.ttl_s,
            "n_documents": len(shard.units), "reused_tokens": reused, "prefill_ms": prefill_ms,
            "shard": shard.index, "n_shards": len(plan.shards), "shard_tokens": plan.shard_tokens,
            "prefill_block": knowledge_kv.block(how), "prefill": how,
            **({"windows": list(lm.windows)} if any(w is not None for w in lm.windows) else {})}
    if why := kv_cache.nonfinite(layers, setup.kv_dtype):  # a snapshot holding NaN or inf would answer garbage forever
        raise ModelError(f"the model's keys and values for {plan.name!r} cannot be stored: {why}; "
                         "prefill in float32 (CAG_DTYPE=float32) or store them in bfloat16 (CAG_KV_DTYPE=bfloat16)")
    nbytes = snapfiles.save(path, layers, ids, meta, setup.kv_dtype)
    del layers
    if setup.remote:  # uploaded whole under its final name before any ref can name it
        setup.remote.put_blob(path, shard.digest)
    row = {"key": shard.key, "digest": shard.digest, "corpus": plan.name, "model": lm.name,
           "model_fingerprint": lm.fingerprint, "tokenizer_fingerprint": lm.tokenizer_fingerprint,
           "n_tokens": n, "n_documents": len(shard.units), "bytes": nbytes, "dtype": setup.kv_name,
           "path": str(path), "created": created, "last_used": None, "prefill_ms": prefill_ms, "reused_tokens": reused,
           "prefill": how}
    return Built(row, "refreshed" if reused else "built", reused, prefill_ms)


def publish(setup: SnapshotSetup, plan: Plan, built: list[Built]) -> None:
    corpus_row = {"name": plan.name, "source": str(plan.source), "model": setup.lm.name, "ttl_s": plan.ttl_s,
                  "shard_tokens": plan.shard_tokens}
    doc_rows = [{"path": d.name, "content_hash": d.content_hash, "size": d.size, "mtime": d.mtime} for d in plan.docs]
    if setup.remote:  # the store is the truth: its ref first (conditional), then this machine's index
        setup.remote.publish(corpus_row, doc_rows, [b.row for b in built], plan.ref)
    setup.index.publish_shards(corpus_row, doc_rows, [(b.row, s.spans) for b, s in zip(built, plan.shards)])


def run(setup: SnapshotSetup, plan: Plan, force: bool, reporter, evict) -> tuple[list[Built], list[int]]:
    """Every step after `read`: pack, reuse or build each shard (with progress), publish. `evict(digest)` drops a
    rebuilt snapshot's copy in memory. (the shards as built, their estimated bytes)"""
    pack_shards(setup, plan, reporter)
    fresh = [None if force else reuse_fresh(setup, s) for s in plan.shards]
    reuse = [(0, None) if f or force else reusable(setup, plan.name, s) for f, s in zip(fresh, plan.shards)]
    todo = sum(len(s.prefix.ids) - r for (r, _), s, f in zip(reuse, plan.shards, fresh) if not f)
    n = sum(len(s.prefix.ids) for s in plan.shards)
    est = [setup.lm.kv_bytes(len(s.prefix.ids), setup.kv_dtype) for s in plan.shards]
    getattr(reporter, "shards", lambda _: None)([{"shard": s.index, "n_tokens": len(s.prefix.ids), "bytes": b}
                                                 for s, b in zip(plan.shards, est)])
    tick = None
    if todo:
        reporter.estimate(n, sum(est), n - todo)
        tick = reporter.progress(todo)
    built = [f or build(setup, plan, s, r, o, tick) for f, s, (r, o) in zip(fresh, plan.shards, reuse)]
    for s in (s for s, f in zip(plan.shards, fresh) if not f):
        evict(s.digest)  # a copy of a file just replaced is not served again
    if todo:
        reporter.done()
    publish(setup, plan, built)
    return built, est
