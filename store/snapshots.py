"""Snapshot files: one safetensors file per snapshot, published atomically, verified on load.

Layout of a file:
  tensors   layers.{i}.keys / layers.{i}.values  (1, H_kv, n_tokens, D) in the storage dtype
            prefix_ids                           (n_tokens,) int32: the token ids the KV belongs to
  metadata  str -> str; structured values are JSON: format, key, model, fingerprints, shapes
            (n_layers, n_kv_heads, n_tokens, head_dim), dtype, document spans, created, and
            `checksum` = blake3 over `name|dtype|shape|` + bytes of every tensor in name order.
The checksum covers each tensor's dtype and shape, not only its bytes: rewriting `F16` to `BF16`
in the safetensors header keeps a parseable file of the same bytes that would decode as garbage.
`header_checksum` = blake3 over every other metadata field (name and stored JSON, `checksum`
included): the spans, key, corpus, created time ... that ingest, reindex and the store's refs trust.
It is checked from the header alone (also by `read_header` and by a ranged read from the store). A
format-2 file written before it has none and is read as before (its tensors checked), so existing
snapshots keep their keys and stay current; what the engine reads of its header is validated
instead (`spans`). Load also checks every layer tensor against the header's dtype and
(1, H_kv, n_tokens, D). No pickle anywhere: safetensors holds raw tensor bytes and a JSON header only.

A model with sliding-window layers (cag.model.windows) records `windows` (per layer: W, or null for
full attention) and stores a window layer's last min(n_tokens, W) rows only, (1, H_kv, rows, D): a
question never reads the others. Load puts them back at their positions in (1, H_kv, n_tokens, D),
the rows before them zero (masked out of every window, as the rows were never there).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from cag.errors import IndexUnusable, StorageFull
from cag.model.windows import kept_rows

from . import kv_int8
from .snapshot_header import (  # noqa: F401 (re-exported: the header's names are the file's names)
    FORMAT_VERSION,
    SnapshotError,
    _check_header,
    _decode,
    _encode,
    decode_header,
    read_header,
    reading,
    spans_of,
)
from .stamps import Passed, stamp

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8}
CHECKSUMS = Passed()  # files whose checksum passed (load's trust=True skips the blake3 pass, most of a cold load)


def codec(kv_dtype: str) -> str:
    """How a storage dtype encodes the tensors, for the snapshot key: int8 names its scheme."""
    return kv_int8.CODEC if kv_dtype == "int8" else kv_dtype


@dataclass
class Snapshot:
    meta: dict  # decoded header (JSON values parsed)
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, H_kv, T, D), storage dtype (int8: dequantized fp16)
    ids: list[int]
    # an int8 snapshot's codes as stored, per layer: keys, their scales, values, their scales
    # ((1, H_kv, T, D) int8, (1, H_kv, T, D / block) fp16); what cag.kernels.native's AVX-512 attention reads
    codes: list[tuple[torch.Tensor, ...]] | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name in sorted(tensors):
        t = tensors[name]
        shape = ",".join(str(d) for d in t.shape)
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{shape}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().data if t.numel() else b"")
    return "blake3:" + h.hexdigest()


def _write_error(e: Exception, path: Path) -> Exception:
    """A failed write of a snapshot file as one line: no room (ENOSPC, quota) is StorageFull, any
    other refusal (permissions, a read-only or failing disk) IndexUnusable: CAG_HOME cannot be used."""
    found = (e.errno, e.strerror or str(e)) if isinstance(e, OSError) else _os_error_of(e)
    assert found is not None, e  # the caller passes OS errors, and only the SafetensorErrors that wrap one
    code, reason = found
    if code in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"cannot write snapshot {path.name} in {path.parent}: {reason}; nothing was kept and the "
                           "previous snapshot still answers: free space and run the ingest again")
    return IndexUnusable(f"cannot write snapshot {path.name} in {path.parent}: {reason}")


def _os_error_of(e: Exception) -> tuple[int | None, str] | None:
    """(errno or None, reason) of a SafetensorError that wraps an OS error, None for any other (a
    bug). safetensors before 0.8 says 'IoError(Os { code: 28, kind: StorageFull, message: "No space
    left on device" })', 0.8 'I/O error: No space left on device (os error 28)'."""
    text = " ".join(str(e).split())
    if m := re.search(r"code: (\d+).*?message: \"([^\"]*)\"", text):
        return int(m.group(1)), m.group(2)
    if m := re.search(r"I/O error: (.*?) \(os error (\d+)\)", text):
        return int(m.group(2)), m.group(1)
    if "IoError" in text or "I/O error" in text:  # no errno in it: the words of ENOSPC still say what it is
        return (errno.ENOSPC if "No space left" in text else None), text[:200]
    return None


def _check_room(path: Path, tensors: dict[str, torch.Tensor], raw: dict[str, str]) -> None:
    """Refuse, before a byte is written, a file the disk cannot hold: tensor bytes plus the header (the
    metadata's JSON and safetensors' index, ~100 bytes a tensor), which the KV-size formula leaves out."""
    need = (8 + len(json.dumps(raw).encode()) + sum(len(n) + 100 for n in tensors)
            + sum(t.nelement() * t.element_size() for t in tensors.values()))
    free = shutil.disk_usage(path.parent).free
    if need > free:
        raise StorageFull(f"cannot write snapshot {path.name} in {path.parent}: it needs {need} bytes and {free} are "
                          "free; nothing was kept and the previous snapshot still answers: free space and run the "
                          "ingest again")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(path: Path, kv, ids: list[int], meta: dict, dtype: torch.dtype) -> int:
    """Write to a temp file in the same folder, fsync, rename over `path`. Returns file bytes.

    A crash before the rename leaves only a dot-named temp file that nothing serves (gc removes it).
    """
    tensors: dict[str, torch.Tensor] = {"prefix_ids": torch.tensor(ids, dtype=torch.int32)}
    extra = {}
    if windows := meta.get("windows"):  # a window layer keeps its last W rows (the only ones a question reads)
        kv = [(k[:, :, k.shape[2] - (r := kept_rows(k.shape[2], w)):], v[:, :, v.shape[2] - r:])
              for (k, v), w in zip(kv, windows, strict=True)]
    if dtype == torch.int8:  # quantized blocks + fp16 scales (store/kv_int8.py)
        block, codes = kv_int8.quantize_layers(kv)
        extra = {"codec": kv_int8.CODEC, "int8_block": block}
        for i, (k_codes, k_scales, v_codes, v_scales) in enumerate(codes):
            for name, q, scale in (("keys", k_codes, k_scales), ("values", v_codes, v_scales)):
                tensors[f"layers.{i}.{name}"], tensors[f"layers.{i}.{name}.scale"] = q.contiguous(), scale.contiguous()
    else:
        for i, (k, v) in enumerate(kv):
            tensors[f"layers.{i}.keys"] = k.to(dtype).contiguous()  # safetensors needs contiguous
            tensors[f"layers.{i}.values"] = v.to(dtype).contiguous()
    header = dict(meta, **extra, format=FORMAT_VERSION, n_layers=len(kv), n_tokens=len(ids),
                  dtype=str(dtype).removeprefix("torch."), checksum=_checksum(tensors))
    if kv:  # the shape every layer tensor must have on load, from the tensors themselves
        header.update(n_kv_heads=kv[0][0].shape[1], head_dim=kv[0][0].shape[3])
    tmp, raw = path.with_name(f".{path.name}.{os.getpid()}.tmp"), _encode(header)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _check_room(path, tensors, raw)
        save_file(tensors, str(tmp), metadata=raw)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except SafetensorError as e:
        if _os_error_of(e) is None:
            raise  # not the disk: a bug, with its traceback
        raise _write_error(e, path) from None
    except OSError as e:
        raise _write_error(e, path) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def read_ids(path: Path) -> list[int]:
    """The prefix token ids alone (no KV read, no verification: for routing, never for serving)."""
    with reading(path), safe_open(str(path), framework="pt") as f:
        return f.get_tensor("prefix_ids").tolist()


def load(path: Path, expect_key: str | None = None, verify: bool = True, dequant: torch.dtype | None = None,
         decode: bool = True, trust: bool = False) -> Snapshot:
    """Load and check a snapshot: format, key, dtypes and shapes against the header, and (by
    default) the checksum over every tensor's name, dtype, shape and bytes. An int8 snapshot is
    dequantized to `dequant`: fp16 (the default) to serve (half the resident bytes of fp32), fp32 where the
    values are quantized again (a refresh), since q x scale is exact in fp32 and re-quantizes to
    the same bytes. `decode=False` checks everything and leaves int8 tensors as stored (a cache fill).
    `trust=True` skips the checksum of a file this process already checked and that has not changed
    since (CHECKSUMS); every other check still runs."""
    seen, t0 = stamp(path), time.time_ns()
    with reading(path), safe_open(str(path), framework="pt") as f:
        raw = f.metadata() or {}
        meta = _decode(raw, f"snapshot {path.name}")
        if meta.get("format") != FORMAT_VERSION:
            raise SnapshotError(f"snapshot {path.name}: unknown format {meta.get('format')!r}")
        if expect_key is not None and meta.get("key") != expect_key:
            raise SnapshotError(f"snapshot {path.name} was built for another key; refusing to serve it")
        if verify:
            _check_header(raw, meta, f"snapshot {path.name}")
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    try:
        n_layers, n_tokens = int(meta["n_layers"]), int(meta["n_tokens"])
        dtype = DTYPES[meta["dtype"]]
        shape = (1, int(meta["n_kv_heads"]), n_tokens, int(meta["head_dim"])) if n_layers else None
        block = int(meta["int8_block"]) if dtype == torch.int8 else None
        if block is not None and (block < 1 or (shape and shape[3] % block)):
            raise ValueError(f"int8_block {block} does not divide head_dim")
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"snapshot {path.name}: header field missing or invalid: {e}") from None
    windows = _windows(meta, n_layers, path)
    try:
        kv = [(tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]) for i in range(n_layers)]
        ids = tensors["prefix_ids"]
    except KeyError as e:
        raise SnapshotError(f"snapshot {path.name}: missing tensor {e}") from None
    if ids.dtype != torch.int32 or tuple(ids.shape) != (n_tokens,):
        raise SnapshotError(f"snapshot {path.name}: prefix_ids disagree with its header")
    shapes = [None if shape is None else (*shape[:2], kept_rows(n_tokens, w), shape[3]) for w in windows]
    for i, pair in enumerate(kv):
        for t in pair:
            if t.dtype != dtype:
                raise SnapshotError(f"snapshot {path.name}: layer {i} is {str(t.dtype).removeprefix('torch.')}, "
                                    f"the header says {meta['dtype']}")
            if tuple(t.shape) != shapes[i]:
                raise SnapshotError(f"snapshot {path.name}: layer {i} has shape {tuple(t.shape)}, "
                                    f"the header says {shapes[i]}")
    if block is not None:
        scales = []
        for i in range(n_layers):
            want = shapes[i]
            assert want is not None  # None only without layers
            ks, vs = (tensors.get(f"layers.{i}.{name}.scale") for name in ("keys", "values"))
            if (
                ks is None
                or vs is None
                or any(t.dtype != torch.float16 or tuple(t.shape) != (*want[:3], want[3] // block) for t in (ks, vs))
            ):
                raise SnapshotError(f"snapshot {path.name}: layer {i} int8 scales missing or misshapen")
            scales.append((ks, vs))
    if verify and not (trust and CHECKSUMS.holds(path, seen)):
        CHECKSUMS.forget(path)
        if _checksum(tensors) != meta.get("checksum"):
            raise SnapshotError(f"snapshot {path.name}: checksum mismatch (file was modified or damaged)")
        CHECKSUMS.remember(path, seen, t0)  # unchanged from before the read to after the check
    if any(w is not None for w in windows):  # each layer at its positions again: (1, H_kv, n_tokens, D)
        kv = [(_in_place(k, n_tokens), _in_place(v, n_tokens)) for k, v in kv]
        if block is not None:
            scales = [(_in_place(ks, n_tokens), _in_place(vs, n_tokens)) for ks, vs in scales]
    codes: list[tuple[torch.Tensor, ...]] | None = None
    if block is not None and decode:  # dequantized once here; the request buffer copy casts to the model's dtype
        dequant = dequant or torch.float16
        codes = [(k, ks, v, vs) for (k, v), (ks, vs) in zip(kv, scales)]
        kv = kv_int8.dequantize_layers(codes, dequant)
    return Snapshot(meta=meta, kv=kv, ids=ids.tolist(), codes=codes)


def _windows(meta: dict, n_layers: int, path: Path) -> list[int | None]:
    """The header's `windows` (cag.model.windows), checked; every layer full where it has none."""
    windows = meta.get("windows")
    if windows is None:
        return [None] * n_layers
    if (not isinstance(windows, list) or len(windows) != n_layers
            or any(w is not None and (type(w) is not int or w < 1) for w in windows)):
        raise SnapshotError(f"snapshot {path.name}: header field windows is not one window (or null) per layer")
    return windows


def _in_place(t: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """A window layer's last rows (1, H_kv, r, X) at positions n_tokens-r.. of (1, H_kv, n_tokens, X), zeros before."""
    if t.shape[2] == n_tokens:
        return t
    out = t.new_zeros((*t.shape[:2], n_tokens, t.shape[3]))
    out[:, :, n_tokens - t.shape[2]:] = t
    return out


def delete(path: Path) -> None:
    CHECKSUMS.forget(path)
    path.unlink(missing_ok=True)


def expected_bytes(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, n_tokens: int,
                   windows: tuple[int | None, ...] = ()) -> int:
    """The KV-size formula: 2 x layers x kv_heads x head_dim x bytes x tokens (header not included); a
    window layer (`windows`, cag.model.windows) counts its last W tokens only."""
    rows = sum(kept_rows(n_tokens, w) for w in windows) if windows else n_layers * n_tokens
    return 2 * n_kv_heads * head_dim * dtype.itemsize * rows
