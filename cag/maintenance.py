"""Invalidate, garbage-collect and reindex: index upkeep that needs no model."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cag.store import snapshots as snapfiles
from cag.store.index import Index

from .config import Settings
from .errors import NotFound


@dataclass
class GcResult:
    deleted: list[dict] = field(default_factory=list)  # {digest, corpus, bytes, why}
    freed_bytes: int = 0
    kept_bytes: int = 0
    dry_run: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def invalidate(index: Index, corpus: str | None, doc: str | None = None) -> list[str]:
    """Mark a corpus, or every corpus whose current snapshot contains `doc`, as invalid.
    Returns the corpora marked. The snapshot stays on disk; `--on-stale` decides what asks do."""
    rows = [index.corpus(corpus)] if corpus else index.corpora()
    if corpus and rows[0] is None:
        raise NotFound(f"unknown corpus {corpus!r}; `cag list` shows the known ones")
    marked = []
    with index.atomic():
        for row in rows:
            if doc is not None:
                docs = [d["path"] for d in index.snapshot_documents(row.get("current_snapshot") or "")]
                if doc not in docs:
                    continue
                reason = f"document {doc} invalidated by user"
            else:
                reason = "invalidated by user"
            index.db["corpora"].update(row["name"], {"invalidated": reason, "updated": time.time()})
            marked.append(row["name"])
    if doc is not None and not marked:
        raise NotFound(f"no {'such corpus contains' if corpus else 'corpus contains'} document {doc!r}")
    return marked


def gc(settings: Settings, index: Index, max_bytes: int | None = None, dry_run: bool = False,
       include_current: bool = False) -> GcResult:
    """Delete superseded, invalid and corrupt snapshots and orphan/temp files; then, over the
    byte budget, the least recently used rest. A corpus's current snapshot is kept unless
    `include_current` (its corpus then needs `cag ingest` again)."""
    out = GcResult(dry_run=dry_run)
    current = {r["current_snapshot"] for r in index.corpora() if r.get("current_snapshot")}
    rows = index.snapshots()
    doomed: list[tuple[dict, str]] = []
    for r in rows:
        if r["digest"] not in current and r["status"] in ("superseded", "invalid", "corrupt"):
            doomed.append((r, r["status"]))
    live = [r for r in rows if r not in [d[0] for d in doomed]]
    if max_bytes is not None:
        total = sum(r["bytes"] for r in live)
        for r in sorted(live, key=lambda r: r["last_used"] or r["created"]):  # least recently used first
            if total <= max_bytes:
                break
            if r["digest"] in current and not include_current:
                continue
            doomed.append((r, "over budget (least recently used)"))
            total -= r["bytes"]
    known_paths = {Path(r["path"]).name for r in rows}
    stray = [p for p in settings.snapshots_dir.glob("*") if p.is_file() and p.name not in known_paths] if settings.snapshots_dir.exists() else []
    for r, why in doomed:
        out.deleted.append({"digest": r["digest"], "corpus": r["corpus"], "bytes": r["bytes"], "why": why})
        out.freed_bytes += r["bytes"]
    for p in stray:
        why = "temp file of an interrupted write" if p.name.endswith(".tmp") else "file not in the index (`cag reindex` adopts it)"
        if p.suffix == ".safetensors" and not p.name.startswith("."):
            continue  # an unindexed snapshot may be adopted by reindex: never delete it silently
        out.deleted.append({"digest": p.name, "corpus": None, "bytes": p.stat().st_size, "why": why})
        out.freed_bytes += p.stat().st_size
    gone = {d["digest"] for d in out.deleted}
    out.kept_bytes = sum(r["bytes"] for r in rows if r["digest"] not in gone)
    if dry_run:
        return out
    for r, _ in doomed:
        with index.atomic():  # the row goes first: a crash leaves an orphan file, never a dangling row
            index.db["snapshot_documents"].delete_where("snapshot = ?", [r["digest"]])
            index.db["snapshots"].delete(r["digest"])
            if r["digest"] in current:
                index.db["corpora"].update(r["corpus"], {"current_snapshot": None})
        snapfiles.delete(Path(r["path"]))
    for p in stray:
        if p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)
    return out


def reindex(settings: Settings, index: Index) -> dict:
    """Rebuild the snapshot tables from the files' own headers (the index can be lost; the
    snapshots describe themselves). The newest readable snapshot of each corpus becomes current."""
    found, bad = [], []
    for path in sorted(settings.snapshots_dir.glob("*.safetensors")) if settings.snapshots_dir.exists() else []:
        if path.name.startswith("."):
            continue
        try:
            meta = snapfiles.read_header(path)
            meta["key"], meta["corpus"], meta["spans"]  # noqa: B018 - required fields
        except (snapfiles.SnapshotError, KeyError):
            bad.append(path.name)
            continue
        found.append((path, meta))
    newest: dict[str, tuple[Path, dict]] = {}
    for path, meta in found:
        if meta["corpus"] not in newest or meta["created"] > newest[meta["corpus"]][1]["created"]:
            newest[meta["corpus"]] = (path, meta)
    with index.atomic():
        for table in ("snapshot_documents", "snapshots"):
            index.db[table].delete_where()
        for path, meta in found:
            digest = path.stem
            current = newest[meta["corpus"]][0] == path
            index.db["snapshots"].insert({
                "key": meta["key"], "digest": digest, "corpus": meta["corpus"], "model": meta.get("model"),
                "model_fingerprint": meta.get("model_fingerprint"), "tokenizer_fingerprint": meta.get("tokenizer_fingerprint"),
                "n_tokens": meta["n_tokens"], "n_documents": len(meta["spans"]), "bytes": path.stat().st_size,
                "dtype": meta.get("dtype"), "path": str(path), "status": "ready" if current else "superseded",
                "created": meta["created"], "last_used": None, "prefill_ms": meta.get("prefill_ms"),
                "reused_tokens": meta.get("reused_tokens", 0),
            })
            index.db["snapshot_documents"].insert_all(
                [dict(s, snapshot=digest, ordinal=i) for i, s in enumerate(meta["spans"])]
            )
        for name, (path, meta) in newest.items():
            old = index.corpus(name) or {}
            index.db["corpora"].upsert({
                "name": name, "source": meta.get("source") or old.get("source"), "model": meta.get("model"),
                "ttl_s": meta.get("ttl_s"), "current_snapshot": path.stem, "invalidated": None,
                "created": old.get("created") or meta["created"], "updated": time.time(),
            }, pk="name")
            if not index.documents(name):  # size -1: the next freshness check hashes the file
                index.db["documents"].insert_all([
                    {"corpus": name, "path": s["path"], "content_hash": s["content_hash"], "size": -1,
                     "mtime": 0.0, "ordinal": i} for i, s in enumerate(meta["spans"])
                ])
    return {"snapshots": len(found), "corpora": sorted(newest), "unreadable": bad}
