"""Snapshot files: round trip, self-describing header, verification, atomic publish."""

from __future__ import annotations

import os

import pytest
import torch

from cag.errors import SnapshotCorrupt
from cag.store import snapshots


def _kv(n_layers=2, heads=2, n=5, dim=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(1, heads, n, dim, generator=g), torch.randn(1, heads, n, dim, generator=g)) for _ in range(n_layers)]


def test_round_trip_header_and_size(tmp_path):
    kv = _kv()
    path = tmp_path / "s.safetensors"
    nbytes = snapshots.save(path, kv, [5, 6, 7, 8, 9], {"key": "sha256:abc", "spans": [["a", 0, 5]]}, torch.float16)
    snap = snapshots.load(path, expect_key="sha256:abc")
    assert snap.ids == [5, 6, 7, 8, 9]
    assert snap.meta["spans"] == [["a", 0, 5]] and snap.meta["n_layers"] == 2 and snap.meta["dtype"] == "float16"
    for (k, v), (k2, v2) in zip(kv, snap.kv):
        assert torch.equal(k.half(), k2) and torch.equal(v.half(), v2)
    formula = snapshots.expected_bytes(2, 2, 4, torch.float16, 5)
    assert nbytes == path.stat().st_size and nbytes > formula
    assert not [p for p in tmp_path.iterdir() if p.name != "s.safetensors"]  # no temp left behind


def test_wrong_key_is_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "sha256:abc"}, torch.float16)
    with pytest.raises(snapshots.SnapshotError, match="another key"):
        snapshots.load(path, expect_key="sha256:other")


def test_truncated_file_is_detected(tmp_path):
    path = tmp_path / "s.safetensors"
    snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "k"}, torch.float16)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 17])
    with pytest.raises(snapshots.SnapshotError, match="truncated|corrupt"):
        snapshots.load(path)


def test_tampered_byte_is_detected(tmp_path):
    path = tmp_path / "s.safetensors"
    snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "k"}, torch.float16)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(snapshots.SnapshotError, match="checksum"):
        snapshots.load(path)
    assert snapshots.load(path, verify=False).ids  # the check, not the parser, caught it


def test_crash_before_publish_leaves_nothing_servable(tiny_engine, small_corpus, monkeypatch):
    """Kill the write between the temp file and the rename: no file under the final name,
    no temp file left, and the index has no snapshot row."""

    def crash(src, dst):
        raise KeyboardInterrupt("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        tiny_engine.ingest(str(small_corpus))
    monkeypatch.undo()
    snap_dir = tiny_engine.settings.snapshots_dir
    assert not list(snap_dir.glob("*")) if snap_dir.exists() else True
    assert tiny_engine.index.snapshots() == [] and tiny_engine.index.corpus("corpus") is None


def test_old_snapshot_survives_a_failed_rebuild(tiny_engine, small_corpus, monkeypatch):
    first = tiny_engine.ingest(str(small_corpus))
    before = tiny_engine.ask("corpus", "Who keeps the lighthouse?", max_tokens=8).token_ids
    (small_corpus / "d.md").write_text("A new document about the harbour master, Ilse Brandt.\n")
    monkeypatch.setattr(os, "replace", lambda s, d: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        tiny_engine.ingest("corpus")
    monkeypatch.undo()
    assert tiny_engine.index.corpus("corpus")["current_snapshot"] == first.snapshot
    tiny_engine._evict()
    assert tiny_engine.ask("corpus", "Who keeps the lighthouse?", max_tokens=8).token_ids == before


def test_corrupt_snapshot_is_reported_never_served_and_rebuilt(tiny_engine, small_corpus):
    r = tiny_engine.ingest(str(small_corpus))
    good = tiny_engine.ask("corpus", "Who keeps the lighthouse?", max_tokens=8).token_ids
    tiny_engine._evict()
    path = tiny_engine.settings.snapshots_dir / f"{r.snapshot}.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match="checksum.*cag ingest corpus"):
        tiny_engine.ask("corpus", "Who keeps the lighthouse?", max_tokens=8)
    again = tiny_engine.ingest("corpus")
    assert again.status == "built" and again.snapshot == r.snapshot
    assert tiny_engine.ask("corpus", "Who keeps the lighthouse?", max_tokens=8).token_ids == good


def test_snapshot_bytes_match_the_kv_formula(tiny_engine, small_corpus):
    r = tiny_engine.ingest(str(small_corpus))
    lm = tiny_engine.lm
    kv_bytes = snapshots.expected_bytes(lm.n_layers, lm.n_kv_heads, lm.head_dim, torch.float16, r.n_tokens)
    ids_bytes = 4 * r.n_tokens  # the prefix_ids tensor (int32)
    header = r.bytes - kv_bytes - ids_bytes
    assert r.estimate_bytes == kv_bytes
    assert 0 < header < 64 * 1024  # a small JSON header, nothing else
