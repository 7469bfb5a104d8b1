"""Ingest verifies what it calls fresh exactly as a question verifies it; names and values that
make no sense are refused before any work."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from cag.answering.query import Query
from cag.errors import BadInput, SnapshotCorrupt

Q = "Who keeps the lighthouse?"


def edit_header(path: Path, edit) -> None:
    """Rewrite a safetensors header in place, keeping its length (the file still parses)."""
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n, "the edit must not grow the header"
    data[8 : 8 + n] = raw + b" " * (n - len(raw))  # safetensors pads headers with spaces
    path.write_bytes(bytes(data))


def test_edited_model_fingerprint_is_refused_then_rebuilt_by_ingest(tiny_engine, small_corpus):
    first = tiny_engine.ingest(str(small_corpus))
    before = tiny_engine.answer(Query("corpus", Q, max_tokens=8)).token_ids

    def tamper(h):
        fp = json.loads(h["__metadata__"]["model_fingerprint"])
        h["__metadata__"]["model_fingerprint"] = json.dumps(fp[:-1] + ("0" if fp[-1] != "0" else "1"))

    edit_header(Path(first.path), tamper)
    tiny_engine.evict()
    with pytest.raises(SnapshotCorrupt, match="cag ingest corpus"):
        tiny_engine.answer(Query("corpus", Q, max_tokens=8))
    assert tiny_engine.status("corpus").stale  # the refusal is recorded, not only raised
    again = tiny_engine.ingest("corpus")  # the advice in the error works
    assert again.status == "built" and again.snapshot == first.snapshot
    assert tiny_engine.answer(Query("corpus", Q, max_tokens=8)).token_ids == before
    assert not tiny_engine.status("corpus").stale


def test_a_healthy_snapshot_is_reused_not_rebuilt(tiny_engine, small_corpus):
    tiny_engine.ingest(str(small_corpus))
    assert tiny_engine.ingest("corpus").status == "fresh"


@pytest.mark.parametrize("name", ["", "..", ".", ".hidden", "a/b", "a\\b", "tab\there", "x" * 201])
def test_bad_corpus_names_are_refused(tiny_engine, small_corpus, name):
    with pytest.raises(BadInput):
        tiny_engine.ingest(str(small_corpus), name=name)
    assert tiny_engine.index.corpora() == []


def test_negative_ttl_is_refused(tiny_engine, small_corpus):
    with pytest.raises(BadInput, match="ttl"):
        tiny_engine.ingest(str(small_corpus), ttl_s=-5)
    assert tiny_engine.index.corpora() == []
