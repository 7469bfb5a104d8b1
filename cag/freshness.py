"""Why a snapshot is stale: documents changed/added/removed on disk (by content hash), another
model or tokenizer configured (by fingerprint), an explicit invalidation, or an expired TTL."""

from __future__ import annotations

import time
from pathlib import Path

from . import documents


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
    in_snap = {d["path"]: d for d in snap_docs}
    reasons = []
    changed = [n for n in in_snap if n in on_disk and documents.content_hash(on_disk[n], by_name.get(n)) != in_snap[n]["content_hash"]]
    added = [n for n in on_disk if n not in in_snap]
    removed = [n for n in in_snap if n not in on_disk]
    for label, names in (("changed", changed), ("added", added), ("removed", removed)):
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
) -> list[str]:
    if snapshot is None:
        return ["no snapshot: run `cag ingest`"]
    reasons = []
    if corpus.get("invalidated"):
        reasons.append(f"invalidated: {corpus['invalidated']}")
    # `snapshot` is this corpus's current one, so it is never superseded for this corpus, whatever
    # another corpus sharing the file did (an index from before that was derived may still say so)
    if snapshot.get("status") not in ("ready", "superseded", None):
        reasons.append(f"snapshot is {snapshot['status']}")
    if model_fingerprint and snapshot.get("model_fingerprint") != model_fingerprint:
        reasons.append("model changed: the configured model's weights differ from the snapshot's")
    if tokenizer_fingerprint and snapshot.get("tokenizer_fingerprint") != tokenizer_fingerprint:
        reasons.append("tokenizer changed: the configured tokenizer differs from the snapshot's")
    ttl = corpus.get("ttl_s") or ttl_s
    age = (now or time.time()) - snapshot["created"]
    if ttl and age > ttl:
        reasons.append(f"expired: built {age:.0f} s ago, ttl {ttl:.0f} s")
    reasons += document_changes(Path(corpus["source"]), snap_docs, known)
    return reasons
