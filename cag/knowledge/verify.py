"""Opening a snapshot to serve it: the file loaded and checked against its index row and the
loaded model before any of its tensors is used."""

from __future__ import annotations

import time
from pathlib import Path

from cag.errors import IndexUnusable, SnapshotCorrupt, StaleRefused, StorageFull
from cag.knowledge.setup import SnapshotSetup
from cag.runtime import knowledge_kv, kv_cache
from cag.store import snapshots as snapfiles
from cag.store.stamps import Passed, stamp

FINITE = Passed()  # snapshot files whose values were found finite


def open_snapshot(setup: SnapshotSetup, row: dict, dequant=None) -> snapfiles.Snapshot:
    """Load a snapshot file and verify it against its index row and the loaded model: header key,
    checksum (once per unchanged file: snapfiles.CHECKSUMS), model fingerprint, a key recomputed from
    its token ids (with the dtype it is stored in: a snapshot of another CAG_KV_DTYPE is sound, only
    stale, see freshness.py), tensor shapes, finite values (ingest refuses to build any other).
    Any failure marks it corrupt (stale for every corpus on it, rebuilt by the next ingest); a
    snapshot the index records for another model is refused as stale."""
    lm, digest = setup.lm, row["digest"]
    if row.get("model_fingerprint") != lm.fingerprint:  # a sound snapshot of another model: stale, not corrupt
        raise StaleRefused(f"snapshot {digest[:12]} was built for another model; run `cag ingest {row['corpus']}`")
    try:
        # a shared store's blob is fetched, verified, when missing
        path = setup.remote.ensure_local(digest, Path(row["path"]))
        seen, t0 = stamp(path), time.time_ns()
        snap = snapfiles.load(path, expect_key=row["key"], dequant=dequant, trust=True)
        if (snap.meta.get("model_fingerprint") != lm.fingerprint
                or setup.key(snap.ids, snap.meta.get("dtype"), knowledge_kv.of_meta(snap.meta)) != snap.meta["key"]):
            raise snapfiles.SnapshotError(f"snapshot {digest[:12]}: header does not match its key (another model, "
                                          "layout or dtype, or an edited header)")
        if not kv_cache.kv_shape_ok(snap.kv, lm.n_layers, lm.n_kv_heads, lm.head_dim, snap.n_tokens):
            raise snapfiles.SnapshotError(f"snapshot {digest[:12]}: tensor shapes do not fit the model")
        # what a refresh reuses by (a file older than the header checksum)
        snapfiles.spans_of(snap.meta, f"snapshot {digest[:12]}")
        if not FINITE.holds(path, seen):  # once per unchanged file, as the checksum
            if why := kv_cache.nonfinite(snap.kv):  # NaN or inf would reach every answer on it (int8: its scales too)
                raise snapfiles.SnapshotError(f"snapshot {digest[:12]}: {why}")
            FINITE.remember(path, seen, t0)
    except snapfiles.SnapshotError as e:
        try:
            setup.index.set_snapshot_status(digest, "corrupt")
        except (IndexUnusable, StorageFull):
            pass  # an index that cannot be written (read-only, full) does not record it; the refusal stands
        raise SnapshotCorrupt(f"{e}; run `cag ingest {row['corpus']}` to rebuild it") from None
    return snap
