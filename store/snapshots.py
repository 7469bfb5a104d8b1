"""Snapshot files: one safetensors file per snapshot, published atomically, verified on load.

Layout of a file:
  tensors   layers.{i}.keys / layers.{i}.values  (1, H_kv, n_tokens, D) in the storage dtype
            prefix_ids                           (n_tokens,) int32: the token ids the KV belongs to
  metadata  str -> str; structured values are JSON: format, key, model, fingerprints, shapes,
            dtype, document spans, created, and `checksum` = blake3 over every tensor's bytes in
            name order, so a truncated or tampered file is caught before it is served.
No pickle anywhere: safetensors holds raw tensor bytes and a JSON header only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_VERSION = "1"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class SnapshotError(Exception):
    """The file is missing, truncated, tampered with, or not the snapshot that was asked for."""


@dataclass
class Snapshot:
    meta: dict  # decoded header (JSON values parsed)
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, H_kv, T, D), storage dtype
    ids: list[int]

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode() + b"|")
        h.update(t.contiguous().view(torch.uint8).numpy().data if t.numel() else b"")
    return "blake3:" + h.hexdigest()


def _encode(meta: dict) -> dict[str, str]:
    return {k: json.dumps(v, ensure_ascii=False) for k, v in meta.items()}  # every value JSON: types survive


def _decode(raw: dict[str, str]) -> dict:
    try:
        return {k: json.loads(v) for k, v in raw.items()}
    except ValueError:
        raise SnapshotError("snapshot header is not valid JSON metadata") from None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(path: Path, kv, ids: list[int], meta: dict, dtype: torch.dtype) -> int:
    """Write to a temp file in the same folder, fsync, rename over `path`. Returns file bytes.

    A crash before the rename leaves only a `.tmp` file that nothing serves (gc removes it).
    """
    tensors: dict[str, torch.Tensor] = {"prefix_ids": torch.tensor(ids, dtype=torch.int32)}
    for i, (k, v) in enumerate(kv):
        tensors[f"layers.{i}.keys"] = k.to(dtype).contiguous()  # safetensors needs contiguous
        tensors[f"layers.{i}.values"] = v.to(dtype).contiguous()
    header = dict(meta, format=FORMAT_VERSION, n_layers=len(kv), n_tokens=len(ids),
                  dtype=str(dtype).removeprefix("torch."), checksum=_checksum(tensors))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=_encode(header))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def read_header(path: Path) -> dict:
    try:
        with safe_open(str(path), framework="pt") as f:
            return _decode(f.metadata() or {})
    except FileNotFoundError:
        raise SnapshotError(f"snapshot file missing: {path}") from None
    except Exception as e:
        raise SnapshotError(f"snapshot unreadable (truncated or corrupt): {path.name}: {e}") from None


def load(path: Path, expect_key: str | None = None, verify: bool = True) -> Snapshot:
    """Load and check a snapshot: format, key, shapes and (by default) the tensor checksum."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = _decode(f.metadata() or {})
            if meta.get("format") != FORMAT_VERSION:
                raise SnapshotError(f"snapshot {path.name}: unknown format {meta.get('format')!r}")
            if expect_key is not None and meta.get("key") != expect_key:
                raise SnapshotError(f"snapshot {path.name} was built for another key; refusing to serve it")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SnapshotError:
        raise
    except FileNotFoundError:
        raise SnapshotError(f"snapshot file missing: {path}") from None
    except Exception as e:
        raise SnapshotError(f"snapshot unreadable (truncated or corrupt): {path.name}: {e}") from None
    n_layers, n_tokens = int(meta["n_layers"]), int(meta["n_tokens"])
    try:
        kv = [(tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]) for i in range(n_layers)]
        ids = tensors["prefix_ids"]
    except KeyError as e:
        raise SnapshotError(f"snapshot {path.name}: missing tensor {e}") from None
    if ids.shape != (n_tokens,) or any(t.shape[2] != n_tokens for pair in kv for t in pair):
        raise SnapshotError(f"snapshot {path.name}: tensor shapes disagree with its header")
    if verify and _checksum(tensors) != meta.get("checksum"):
        raise SnapshotError(f"snapshot {path.name}: checksum mismatch (file was modified or damaged)")
    return Snapshot(meta=meta, kv=kv, ids=ids.tolist())


def delete(path: Path) -> None:
    path.unlink(missing_ok=True)


def expected_bytes(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, n_tokens: int) -> int:
    """The KV-size formula: 2 x layers x kv_heads x head_dim x bytes x tokens (header not included)."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize * n_tokens
