"""Canonical JSON and tagged content hashes ("sha256:<hex>").

A tag in front of every digest says which function made it, so a future change of function
can never be mistaken for a change of content.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def hash_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def hash_obj(obj: Any) -> str:
    return hash_bytes(canonical_json(obj).encode("utf-8"))


def short(digest: str, n: int = 12) -> str:
    """Human-sized form of a tagged digest: the first n hex characters."""
    return digest.split(":", 1)[-1][:n]
