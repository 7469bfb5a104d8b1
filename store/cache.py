"""The local read cache of store blobs: `CAG_HOME/snapshots/`, bounded by CAG_STORE_CACHE_BYTES.

The cache is the snapshots folder itself, so every index row's `path` stays a local file path and
the load code does not change. A fill downloads a blob to a dot-named temp file, verifies it fully
(format, dtypes, shapes, checksum, and that the header's key hashes to the digest it was asked
for) and only then renames it into place: a tampered or truncated blob is never served and never
left under a final name. Eviction is least recently used by access time, which this module sets
itself on every use (mounts with noatime/relatime would not), and only removes blobs the store
holds (same size), so nothing is lost that cannot be fetched again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from cag.hashing import short

from .snapshot_header import SnapshotError


def touch(path: Path) -> None:
    """Mark a cached blob as used now (access time; the modification time is kept)."""
    try:
        os.utime(path, (time.time(), path.stat().st_mtime))
    except OSError:
        pass  # gone meanwhile: the next use fetches it again


def fill(remote, digest: str, path: Path) -> None:
    """Fetch blob `digest` from the store into `path`, verified before it is renamed into place.
    Raises SnapshotError (never leaving the bad bytes) when it fails verification."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{digest}.fetch.{os.getpid()}.tmp")  # gc knows `.<...>.<pid>.tmp` as a temp file
    from . import snapshots as snapfiles  # torch: only where a blob is fetched, not in `cag list`

    try:
        remote.get_blob(digest, tmp)  # SnapshotError when the store does not hold it
        try:
            snap = snapfiles.load(tmp, verify=True, decode=False)  # every check a load makes, no dequantizing
            if short(str(snap.meta.get("key", "")), 32) != digest:
                raise SnapshotError(f"snapshot {digest[:12]} in the store holds another key's snapshot")
        except SnapshotError as e:
            why = f"snapshot {digest[:12]} fetched from the store failed verification, not served: {e}"
            # reported, the next `cag ingest` uploads it again even from a machine whose good copy has the
            # same size and blake3 as the blob claims; unreported, only a rebuild (--force) replaces it there
            if not remote.report_failed(digest, why):
                why += " (the store refused the report: on a machine that holds a good copy, `cag ingest --force`)"
            raise SnapshotError(why) from None
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    touch(path)


def evict(folder: Path, budget: int, keep: set[str], in_store) -> list[str]:
    """Remove least recently used blobs until the folder holds at most `budget` bytes of them.
    `keep`: digests never evicted now (the one being served); `in_store(digest, size)`: whether the
    store holds that blob (only those are evicted). Returns the evicted digests."""
    files = []
    for p in folder.glob("*.safetensors") if folder.is_dir() else []:
        try:
            st = p.stat()
        except OSError:
            continue
        files.append((st.st_atime, p, st.st_size))
    total = sum(size for _, _, size in files)
    out = []
    for _, p, size in sorted(files, key=lambda f: f[0]):
        if total <= budget:
            break
        if p.stem in keep or not in_store(p.stem, size):
            continue
        p.unlink(missing_ok=True)
        total -= size
        out.append(p.stem)
    return out
