"""Snapshot files: round trip, self-describing header, verification, atomic publish."""

from __future__ import annotations

import json
import os
import struct
import time

import pytest
import torch

from cag.answering.query import Query
from cag.errors import SnapshotCorrupt
from cag.store import snapshots, stamps


def _kv(n_layers=2, heads=2, n=5, dim=4):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(1, heads, n, dim, generator=g), torch.randn(1, heads, n, dim, generator=g))
        for _ in range(n_layers)
    ]


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


def _rewrite_header(path, edit) -> None:
    """Edit the safetensors header (8-byte little-endian length + JSON) and keep the tensor bytes:
    the file still parses, exactly what a tamperer or a buggy writer would produce."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _layers(header):
    return [v for k, v in header.items() if k.startswith("layers.")]


def test_tampered_tensor_dtype_is_refused(tmp_path):
    """F16 -> BF16 in the header keeps every byte and offset valid: without checks the file loads
    and serves garbage. The dtype check against the header's `dtype` refuses it."""
    from safetensors import safe_open

    path = tmp_path / "s.safetensors"
    snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "k"}, torch.float16)
    _rewrite_header(path, lambda h: [t.update(dtype="BF16") for t in _layers(h)])
    with safe_open(str(path), framework="pt") as f:  # the file still parses, as bfloat16
        assert f.get_tensor("layers.0.keys").dtype == torch.bfloat16
    for verify in (True, False):  # caught even without the checksum pass
        with pytest.raises(snapshots.SnapshotError, match="layer 0 is bfloat16, the header says float16"):
            snapshots.load(path, verify=verify)


def test_checksum_once_per_unchanged_file(tmp_path, monkeypatch):
    """trust=True skips the checksum of a file this process checked that has not changed since; any
    write (even one that restores size and mtime) brings the check back, and a file checked in the
    same clock tick as its last change is never trusted."""
    calls = []
    real = snapshots._checksum
    monkeypatch.setattr(snapshots, "_checksum", lambda t: calls.append(1) or real(t))
    racy, path = tmp_path / "racy.safetensors", tmp_path / "s.safetensors"
    snapshots.save(racy, _kv(), [1, 2, 3, 4, 5], {"key": "k"}, torch.float16)
    monkeypatch.setattr(stamps, "SETTLE_S", 60.0)  # everything just written counts as racy
    calls.clear()  # save computed one
    snapshots.load(racy, trust=True)
    snapshots.load(racy, trust=True)
    assert len(calls) == 2
    monkeypatch.setattr(stamps, "SETTLE_S", 0.05)
    snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "k"}, torch.float16)
    time.sleep(0.1)
    calls.clear()
    snapshots.load(path, trust=True)
    snapshots.load(path, trust=True)
    snapshots.load(path, expect_key="k", trust=True)
    assert len(calls) == 1  # checked once
    snapshots.load(path)
    assert len(calls) == 2  # without trust: always
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    with open(path, "r+b") as f:  # in place: same inode and size
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime set back; ctime cannot be
    with pytest.raises(snapshots.SnapshotError, match="checksum"):
        snapshots.load(path, trust=True)
    with pytest.raises(snapshots.SnapshotError, match="checksum"):
        snapshots.load(path, trust=True)  # a failed check is never remembered


def test_checksum_covers_dtype_and_shape(tmp_path):
    """A consistent rewrite (tensor dtypes and the header's `dtype` together; or a shape with the
    same element count) passes every header check: only the checksum can catch it."""
    path = tmp_path / "s.safetensors"
    snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "k"}, torch.float16)

    def to_bf16(h):
        for t in _layers(h):
            t["dtype"] = "BF16"
        h["__metadata__"]["dtype"] = json.dumps("bfloat16")

    _rewrite_header(path, to_bf16)
    assert snapshots.load(path, verify=False).kv[0][0].dtype == torch.bfloat16  # every header check passes
    with pytest.raises(snapshots.SnapshotError, match="checksum"):
        snapshots.load(path)

    snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "k"}, torch.float16)

    def swap_heads_and_dim(h):  # (1, 2, 5, 4) -> (1, 4, 5, 2): same bytes, other tensor
        for t in _layers(h):
            t["shape"] = [1, 4, 5, 2]
        h["__metadata__"].update(n_kv_heads="4", head_dim="2")

    _rewrite_header(path, swap_heads_and_dim)
    assert snapshots.load(path, verify=False).kv[0][0].shape == (1, 4, 5, 2)
    with pytest.raises(snapshots.SnapshotError, match="checksum"):
        snapshots.load(path)


def test_tensor_shape_must_match_the_header(tmp_path):
    path = tmp_path / "s.safetensors"
    snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "k"}, torch.float16)
    assert snapshots.read_header(path)["n_kv_heads"] == 2 and snapshots.read_header(path)["head_dim"] == 4
    _rewrite_header(path, lambda h: _layers(h)[0].update(shape=[1, 4, 5, 2]))
    with pytest.raises(snapshots.SnapshotError, match=r"has shape \(1, 4, 5, 2\), the header says \(1, 2, 5, 4\)"):
        snapshots.load(path, verify=False)


def test_an_older_format_is_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "k"}, torch.float16)
    _rewrite_header(path, lambda h: h["__metadata__"].update(format=json.dumps("1")))
    with pytest.raises(snapshots.SnapshotError, match="unknown format '1'"):
        snapshots.load(path)


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
    before = tiny_engine.answer(Query("corpus", "Who keeps the lighthouse?", max_tokens=8)).token_ids
    (small_corpus / "d.md").write_text("A new document about the harbour master, Ilse Brandt.\n")
    monkeypatch.setattr(os, "replace", lambda s, d: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        tiny_engine.ingest("corpus")
    monkeypatch.undo()
    assert tiny_engine.index.corpus("corpus")["current_snapshot"] == first.snapshot
    tiny_engine.evict()
    assert tiny_engine.answer(Query("corpus", "Who keeps the lighthouse?", max_tokens=8)).token_ids == before


def test_corrupt_snapshot_is_reported_never_served_and_rebuilt(tiny_engine, small_corpus):
    r = tiny_engine.ingest(str(small_corpus))
    good = tiny_engine.answer(Query("corpus", "Who keeps the lighthouse?", max_tokens=8)).token_ids
    tiny_engine.evict()
    path = tiny_engine.settings.snapshots_dir / f"{r.snapshot}.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match="checksum.*cag ingest corpus"):
        tiny_engine.answer(Query("corpus", "Who keeps the lighthouse?", max_tokens=8))
    again = tiny_engine.ingest("corpus")
    assert again.status == "built" and again.snapshot == r.snapshot
    assert tiny_engine.answer(Query("corpus", "Who keeps the lighthouse?", max_tokens=8)).token_ids == good


def test_snapshot_bytes_match_the_kv_formula(tiny_engine, small_corpus):
    r = tiny_engine.ingest(str(small_corpus))
    lm = tiny_engine.lm
    kv_bytes = snapshots.expected_bytes(lm.n_layers, lm.n_kv_heads, lm.head_dim, torch.float16, r.n_tokens)
    ids_bytes = 4 * r.n_tokens  # the prefix_ids tensor (int32)
    header = r.bytes - kv_bytes - ids_bytes
    assert r.estimate_bytes == kv_bytes
    assert 0 < header < 64 * 1024  # a small JSON header, nothing else
