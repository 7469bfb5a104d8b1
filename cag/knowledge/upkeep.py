"""Invalidate, garbage-collect and reindex: index upkeep that needs no model.

The library of `cag invalidate`, `cag gc` and `cag reindex`: what they do and what they return is here;
cli/maintenance.py only declares their options and prints what these functions return."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cag.config import Settings
from cag.errors import NotFound
from cag.store import snapshots as snapfiles
from cag.store.index import Index


@dataclass
class GcResult:
    deleted: list[dict] = field(default_factory=list)  # {digest, corpus, bytes, why}: gone (or would go)
    kept: list[dict] = field(default_factory=list)  # {digest, corpus, bytes, why}: looked at and left, and why
    freed_bytes: int = 0
    kept_bytes: int = 0  # everything left in snapshots/: indexed snapshots plus the files in `kept`
    dry_run: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def invalidate(index: Index, corpus: str | None, doc: str | None = None) -> list[str]:
    """Mark a corpus, or every corpus whose current snapshot contains `doc`, as invalid.
    Returns the corpora marked. The snapshot stays on disk; `--on-stale` decides what asks do."""
    one = index.corpus(corpus) if corpus else None
    if corpus and one is None:
        raise NotFound(f"unknown corpus {corpus!r}; `cag list` shows the known ones")
    rows = [one] if one is not None else index.corpora()
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
            index.db.table("corpora").update(row["name"], {"invalidated": reason, "updated": time.time()})
            marked.append(row["name"])
    if doc is not None and not marked:
        raise NotFound(f"no {'such corpus contains' if corpus else 'corpus contains'} document {doc!r}")
    return marked


def gc(settings: Settings, index: Index, max_bytes: int | None = None, dry_run: bool = False,
       include_current: bool = False) -> GcResult:
    """Delete snapshots no corpus uses (superseded) or that failed verification (corrupt), and temp
    files of interrupted writes; then, over the byte budget, the least recently used rest. A
    snapshot that any corpus points to is kept unless `include_current` (those corpora then need
    `cag ingest` again). Whatever it reports deleted is gone; whatever it leaves is in `kept`."""
    out = GcResult(dry_run=dry_run)
    rows = index.snapshots()
    users = index.users()  # every shard's current snapshot counts
    doomed: list[tuple[dict, str]] = []
    for r in rows:
        if r["digest"] not in users:
            doomed.append((r, "corrupt" if r["status"] == "corrupt" else "superseded (no corpus uses it)"))
    if max_bytes is not None:
        going = {r["digest"] for r, _ in doomed}
        live = [r for r in rows if r["digest"] not in going]
        total = sum(r["bytes"] for r in live)
        for r in sorted(live, key=lambda r: r["last_used"] or r["created"]):  # least recently used first
            if total <= max_bytes:
                break
            if r["digest"] in users and not include_current:
                out.kept.append(_entry(r, f"current snapshot of {', '.join(users[r['digest']])} "
                                          "(over --max-bytes; --include-current deletes it)"))
                continue
            doomed.append((r, "over budget (least recently used)"))
            total -= r["bytes"]

    for r, why in doomed:
        if dry_run:
            out.deleted.append(_entry(r, why))
            continue
        with index.atomic():  # the row goes first: a crash leaves an orphan file, never a dangling row
            using = index.corpora_using(r["digest"])
            if using and not include_current:  # became some corpus's current since the listing above
                out.kept.append(_entry(r, f"now the current snapshot of {', '.join(using)}"))
                continue
            index.db.table("snapshot_documents").delete_where("snapshot = ?", [r["digest"]])
            index.db.table("snapshots").delete(r["digest"])
            index.db.execute("UPDATE corpora SET current_snapshot = NULL WHERE current_snapshot = ?", [r["digest"]])
            index.db.execute("DELETE FROM shards WHERE snapshot = ?", [r["digest"]])
        try:
            snapfiles.delete(Path(r["path"]))
        except OSError as e:
            out.kept.append(_entry(r, f"removed from the index, but the file could not be deleted: {e.strerror or e}"))
            continue
        out.deleted.append(_entry(r, why))

    known = {Path(r["path"]).name for r in rows}
    for p in sorted(settings.snapshots_dir.iterdir()) if settings.snapshots_dir.is_dir() else []:
        if p.name in known:
            continue
        try:
            size = p.stat().st_size if p.is_file() else 0
            keep_why = _why_keep(p)
        except FileNotFoundError:
            continue  # renamed or removed since the listing (a writer finishing its temp file): not ours to report
        entry = {"digest": p.name, "corpus": None, "bytes": size}
        if keep_why is None and not dry_run:
            try:
                p.unlink()
            except OSError as e:
                keep_why = f"could not delete: {e.strerror or e}"
        if keep_why is None:
            out.deleted.append(dict(entry, why="temp file of an interrupted write"))
        else:
            out.kept.append(dict(entry, why=keep_why))

    out.freed_bytes = sum(d["bytes"] for d in out.deleted)
    gone = {d["digest"] for d in out.deleted}
    out.kept_bytes = (sum(r["bytes"] for r in rows if r["digest"] not in gone)  # indexed, still there
                      + sum(k["bytes"] for k in out.kept if k["corpus"] is None))  # unindexed files left
    if settings.store:  # the shared store: blobs no ref names (never one a ref names), past the grace period
        from cag.store.sync import Shared

        deleted, kept = Shared(settings, index).gc(dry_run)
        out.deleted += [dict(d, digest=f"store:{d['digest']}") for d in deleted]
        out.kept += [dict(k, digest=f"store:{k['digest']}") for k in kept]
        out.freed_bytes += sum(d["bytes"] for d in deleted)
    return out


def _entry(row: dict, why: str) -> dict:
    return {"digest": row["digest"], "corpus": row["corpus"], "bytes": row["bytes"], "why": why}


# A temp file that names no writer (safetensors 0.8 writes `.tmpXXXXXX` before cag renames it to its
# own name) is left alone while younger than this: a large snapshot can take minutes to write, and
# its writer keeps the modification time current. Older, it is a leftover of a killed write.
TEMP_GRACE_S = 3600.0


def _why_keep(p: Path) -> str | None:
    """Why gc leaves a file that is not in the index, or None for a leftover temp file.

    Temp files are dot-files: ours (`.<digest>.safetensors.<pid>.tmp`) and anything a library or
    the OS names `.tmpXXXXXX`; a kill -9 can leave either. Ours name their writer, which is left
    alone while it runs; the others are left alone for TEMP_GRACE_S after their last write. A
    finished `<digest>.safetensors` without a row is a whole snapshot (written, then killed before
    it was recorded): never deleted, `cag reindex` adopts it.
    """
    if not p.is_file() or p.is_symlink():
        return "not a regular file: left alone"
    if not p.name.startswith(".") and not p.name.endswith(".tmp"):
        if p.suffix == ".safetensors":
            return "not in the index: `cag reindex` adopts it"
        return "not a snapshot or temp file: left alone"
    pid = _writer_pid(p.name)
    if pid is not None and _alive(pid):
        return f"being written by running process {pid}"
    if pid is None and time.time() - p.stat().st_mtime < TEMP_GRACE_S:
        return f"temp file written less than {TEMP_GRACE_S / 3600:g} h ago: may still be being written"
    return None


def _writer_pid(name: str) -> int | None:
    parts = name.split(".")  # "", "<digest>", "safetensors", "<pid>", "tmp"
    if len(parts) >= 3 and parts[-1] == "tmp" and parts[-2].isdigit():
        return int(parts[-2])
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def reindex(settings: Settings, index: Index) -> dict:
    """Rebuild the snapshot tables from the files' own headers (the index can be lost; the
    snapshots describe themselves). A corpus row that survives keeps its current snapshot when
    that file is here; otherwise the newest readable snapshot built for the corpus becomes current.
    A header names only the corpus that built the file, so a lost index brings back the corpora
    that built snapshots, not others that shared one by identical content."""
    found, bad = [], []
    for path in sorted(settings.snapshots_dir.glob("*.safetensors")) if settings.snapshots_dir.exists() else []:
        if path.name.startswith("."):
            continue
        try:
            meta = snapfiles.read_header(path)
            meta["key"], meta["corpus"], meta["created"], snapfiles.spans_of(meta, path.name)  # noqa: B018 - required fields
        except (snapfiles.SnapshotError, KeyError):
            bad.append(path.name)
            continue
        found.append((path, meta))
    newest: dict[str, tuple[Path, dict]] = {}
    for path, meta in found:
        if meta["corpus"] not in newest or meta["created"] > newest[meta["corpus"]][1]["created"]:
            newest[meta["corpus"]] = (path, meta)
    digests = {path.stem for path, _ in found}
    with index.atomic():
        for table in ("snapshot_documents", "snapshots"):
            index.db.table(table).delete_where()
        for path, meta in found:
            digest = path.stem
            index.db.table("snapshots").insert(
                {  # "superseded" is derived from the corpora, never stored
                    "key": meta["key"],
                    "digest": digest,
                    "corpus": meta["corpus"],
                    "model": meta.get("model"),
                    "model_fingerprint": meta.get("model_fingerprint"),
                    "tokenizer_fingerprint": meta.get("tokenizer_fingerprint"),
                    "n_tokens": meta["n_tokens"],
                    "n_documents": len(meta["spans"]),
                    "bytes": path.stat().st_size,
                    "dtype": meta.get("dtype"),
                    "path": str(path),
                    "status": "ready",
                    "created": meta["created"],
                    "last_used": None,
                    "prefill_ms": meta.get("prefill_ms"),
                    "reused_tokens": meta.get("reused_tokens", 0),
                }
            )
            index.db.table("snapshot_documents").insert_all(
                [dict(s, snapshot=digest, ordinal=i) for i, s in enumerate(meta["spans"])]
            )
        for name, (path, meta) in newest.items():
            old = index.corpus(name) or {}
            if old.get("current_snapshot") in digests:
                continue  # a surviving corpus row already points to a file that is here: its choice stands
            index.db.table("corpora").upsert({
                "name": name, "source": meta.get("source") or old.get("source"), "model": meta.get("model"),
                "ttl_s": meta.get("ttl_s"), "current_snapshot": path.stem, "invalidated": None,
                "created": old.get("created") or meta["created"], "updated": time.time(),
            }, pk="name")
            if not index.documents(name):  # size -1: the next freshness check hashes the file
                index.db.table("documents").insert_all([
                    {"corpus": name, "path": s["path"], "content_hash": s["content_hash"], "size": -1,
                     "mtime": 0.0, "ordinal": i} for i, s in enumerate(meta["spans"])
                ])
    out: dict[str, Any] = {"snapshots": len(found), "corpora": sorted(newest), "unreadable": bad}
    if settings.store:  # the store's refs say what is current: the index is this machine's cache of them
        from cag.store.sync import Shared

        # a bad ref is reported, not fatal
        out["store_corpora"], out["store_refused"] = Shared(settings, index).adopt_all()
        out["corpora"] = sorted(set(out["corpora"]) | set(out["store_corpora"]))
    return out
