"""Why a snapshot is stale: documents changed/added/removed on disk (by content hash), another
model or tokenizer configured (by fingerprint), an explicit invalidation, or an expired TTL."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cag.knowledge import documents
from cag.knowledge.shards import doc_of
from cag.model.facts import ModelFacts
from cag.results import CorpusStatus
from cag.store.sync import known_corpus


def document_changes(source: Path, snap_docs: list[dict], known: list[dict]) -> list[str]:
    """Reasons, one per line, comparing the files on disk with the documents in the snapshot.

    `known` are the index's document rows (size, mtime, hash): an unchanged size+mtime skips
    re-hashing; a changed mtime with the same bytes is not a change.
    """
    if not source.exists():
        return [f"source missing: {source}"]
    entries, _ = documents.scan(source)
    by_name = {d["path"]: d for d in known}
    on_disk = {e.name: e for e in entries}
    in_snap = {doc_of(d["path"]): d for d in snap_docs}  # parts of a long document count as the document
    sharded = len({d.get("shard", 0) for d in snap_docs}) > 1
    where = lambda n: f"{n} (shard {in_snap[n]['shard']})" if sharded else n  # noqa: E731
    reasons = []
    changed = [
        n
        for n in in_snap
        if n in on_disk and documents.content_hash(on_disk[n], by_name.get(n)) != in_snap[n]["content_hash"]
    ]
    added = [n for n in on_disk if n not in in_snap]
    removed = [n for n in in_snap if n not in on_disk]
    for label, names in (
        ("changed", [where(n) for n in changed]),
        ("added", added),
        ("removed", [where(n) for n in removed]),
    ):
        if names:
            reasons.append(f"documents {label}: {', '.join(names)}")
    return reasons


def stale_reasons(
    corpus: dict,
    snapshot: dict | None,
    snap_docs: list[dict],
    known: list[dict],
    model_fingerprint: str | None = None,
    tokenizer_fingerprint: str | None = None,
    ttl_s: float = 0.0,
    now: float | None = None,
    more_shards: Sequence[dict] = (),
    check_documents: bool = True,
    kv_dtype: str | None = None,
    prefill: Callable[[int], str] | None = None,
) -> list[str]:
    """`snapshot` is the corpus's current one (shard 0); `more_shards` the snapshots of its other
    shards, each checked the same way (a reason names its shard)."""
    if snapshot is None:
        return ["no snapshot: run `cag ingest`"]
    reasons = []
    if corpus.get("invalidated"):
        reasons.append(f"invalidated: {corpus['invalidated']}")
    for i, snap in enumerate([snapshot, *more_shards]):
        label = f"shard {i}: " if more_shards else ""
        if snap is None:
            reasons.append(f"{label}snapshot missing from the index: run `cag ingest`")
            continue
        # a current snapshot is never superseded for this corpus, whatever another corpus sharing the
        # file did (an index from before that was derived may still say so)
        if snap.get("status") not in ("ready", "superseded", None):
            reasons.append(f"{label}snapshot is {snap['status']}")
        if model_fingerprint and snap.get("model_fingerprint") != model_fingerprint:
            reasons.append(f"{label}model changed: the configured model's weights differ from the snapshot's")
        if tokenizer_fingerprint and snap.get("tokenizer_fingerprint") != tokenizer_fingerprint:
            reasons.append(f"{label}tokenizer changed: the configured tokenizer differs from the snapshot's")
        # sound, served as stored, but not what `full` rounds to
        if kv_dtype and snap.get("dtype") not in (kv_dtype, None):
            reasons.append(f"{label}snapshot stored as {snap['dtype']}, CAG_KV_DTYPE means {kv_dtype} here: "
                           "`cag ingest` rebuilds it")
        # sound, served as built; a snapshot from before methods were recorded was prefilled in blocks
        was, here = snap.get("prefill") or "blocks", prefill(snap.get("n_tokens") or 0) if prefill else None
        if here and was != here and not (was == "blocks" and here.startswith("blocks")):
            reasons.append(f"{label}knowledge prefilled as {was}, here as {here}: `cag ingest` rebuilds it")
    ttl = corpus.get("ttl_s") or ttl_s
    age = (now or time.time()) - snapshot["created"]
    if ttl and age > ttl:
        reasons.append(f"expired: built {age:.0f} s ago, ttl {ttl:.0f} s")
    if check_documents:
        reasons += document_changes(Path(corpus["source"]), snap_docs, known)
    return reasons


def corpus_reasons(index, remote, settings, row: dict, facts: ModelFacts | None) -> list[str]:
    """Why a corpus (all its shards) is stale, as `cag status` lists it. `facts`: the configured
    model's (cag.model.facts), None to leave the model out of it."""
    snap = index.snapshot(row["current_snapshot"]) if row.get("current_snapshot") else None
    shards = index.shards(row["name"]) if snap else []
    spans = [dict(d, shard=r["shard"]) for r in shards for d in index.snapshot_documents(r["snapshot"])]
    return stale_reasons(
        row, snap, spans or (index.snapshot_documents(snap["digest"]) if snap else []),
        index.documents(row["name"]), facts.fingerprint if facts else None,
        facts.tokenizer_fingerprint if facts else None, settings.ttl_s,
        more_shards=[index.snapshot(r["snapshot"]) for r in shards[1:]],
        # with a shared store, a machine that only serves has no copy of the source: the documents
        # are checked where the corpus is ingested, and the store's ref says which snapshots are current
        check_documents=not (remote and not Path(row["source"]).exists()),
        kv_dtype=facts.kv_name(settings.kv_dtype) if facts else None,
        prefill=facts.prefill_for if facts and facts.prefill else None,
    )


def status(index, remote, settings, corpus: str, facts: ModelFacts | None) -> CorpusStatus:
    """A corpus's snapshot(s), size and freshness; sizes add up over its shards."""
    row = known_corpus(index, remote, corpus)  # a corpus this machine may know only from the shared store
    snap = index.snapshot(row["current_snapshot"]) if row.get("current_snapshot") else None
    snaps = [x for x in (index.snapshot(r["snapshot"]) for r in index.shards(corpus)) if x] or ([snap] if snap else [])
    reasons = corpus_reasons(index, remote, settings, row, facts)
    return CorpusStatus(
        name=row["name"], source=row["source"], model=row["model"],
        snapshot=snap["digest"] if snap else None, n_documents=len(index.documents(corpus)) if snap else 0,
        n_tokens=sum(x["n_tokens"] for x in snaps), bytes=sum(x["bytes"] for x in snaps),
        created=snap["created"] if snap else None, last_used=snap["last_used"] if snap else None,
        stale=bool(reasons), reasons=reasons, n_shards=len(snaps) or 1,
    )
