"""A snapshot file's header, read and checked without torch: the format version, the metadata's
JSON encoding and `header_checksum`, the document spans (store/snapshots.py has the whole format)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import blake3

# "2": the checksum covers dtype and shape. A version-1 file is refused as an unknown format,
# and since the version is part of every snapshot key, `cag ingest` rebuilds it.
FORMAT_VERSION = "2"
MAX_HEADER = 100 * 1024**2  # safetensors' own limit on a header: a larger length is a damaged file


class SnapshotError(Exception):
    """The file is missing, truncated, tampered with, or not the snapshot that was asked for."""


def _encode(meta: dict) -> dict[str, str]:
    raw = {k: json.dumps(v, ensure_ascii=False) for k, v in meta.items()}  # every value JSON: types survive
    raw["header_checksum"] = json.dumps(_header_checksum(raw))
    return raw


def _header_checksum(raw: dict[str, str]) -> str:
    """blake3 over every metadata field but itself, as stored (name and JSON text), in name order."""
    fields = sorted((k, v) for k, v in raw.items() if k != "header_checksum")
    return "blake3:" + blake3.blake3(json.dumps(fields, ensure_ascii=False).encode()).hexdigest()


def _decode(raw: dict[str, str], name: str = "snapshot") -> dict:
    try:
        return {k: json.loads(v) for k, v in raw.items()}
    except (TypeError, ValueError):
        raise SnapshotError(f"{name}: header is not valid JSON metadata") from None


def _check_header(raw: dict[str, str], meta: dict, name: str) -> None:
    if "header_checksum" in meta and meta["header_checksum"] != _header_checksum(raw):
        raise SnapshotError(f"{name}: header checksum mismatch (its metadata was edited or damaged)")


def decode_header(raw: dict[str, str], name: str = "snapshot") -> dict:
    """The metadata's values parsed, after its `header_checksum` (when it has one) is checked."""
    meta = _decode(raw, name)
    _check_header(raw, meta, name)
    return meta


def spans_of(meta: dict, name: str = "snapshot") -> list[dict]:
    """The header's document spans, validated: [{path, content_hash, start, end}] in prompt order,
    0 <= start <= end <= n_tokens, none overlapping. Everything that builds on a snapshot's documents
    (a refresh's reuse, the index's rows, freshness) reads them; a file written before the header
    checksum has only this check."""
    spans, n = meta.get("spans"), meta.get("n_tokens")
    invalid = f"{name}: header field 'spans' missing or invalid"
    if not isinstance(spans, list) or type(n) is not int:
        raise SnapshotError(invalid)
    end = 0
    for s in spans:
        if not (isinstance(s, dict) and isinstance(s.get("path"), str) and isinstance(s.get("content_hash"), str)
                and type(s.get("start")) is int and type(s.get("end")) is int and end <= s["start"] <= s["end"] <= n):
            raise SnapshotError(invalid)
        end = s["end"]
    return spans


@contextmanager
def reading(path: Path):
    """Any failure to read snapshot file `path` inside it as one SnapshotError line (missing, truncated, corrupt)."""
    try:
        yield
    except SnapshotError:
        raise
    except FileNotFoundError:
        raise SnapshotError(f"snapshot file missing: {path}") from None
    except Exception as e:
        raise SnapshotError(f"snapshot unreadable (truncated or corrupt): {path.name}: {e}") from None


def read_header(path: Path) -> dict:
    """The header's metadata, its header checksum checked (the tensors are not read). Read as the
    safetensors format lays it out (8 bytes little-endian length, then that much JSON), without torch:
    `cag list` and the store's refs read headers in commands that never load a model."""
    with reading(path):
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= MAX_HEADER:
                raise ValueError(f"header length {n}")
            raw = f.read(n)
            if len(raw) != n:
                raise ValueError("truncated header")
            meta = json.loads(raw).get("__metadata__") or {}
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise ValueError("metadata is not a map of strings")
        return decode_header(meta, f"snapshot {path.name}")
