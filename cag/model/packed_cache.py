"""The packed copies of a model's weights kept on disk, so that a later load reads them instead of
packing again (quantizing int4 groups was most of a load: bench/JOURNAL.md, 2026-12-06).

One safetensors file per model and packing under `CAG_MODELS_DIR/packed/`, named
`<model fingerprint>-<packing key>.safetensors`. The key holds everything the packed bytes depend
on: the model fingerprint (its weights and config), the format, the kernel layout (cag's AVX-512 or
AVX2 products, or torch's), the compute dtype, the code that packs (a digest of cag/model/layouts.py and packed.py)
and torch's version. Tensors are named `<matrix>/<packing>/<i>`; the header holds the key and a blake3
checksum over every tensor's name, dtype, shape and bytes, checked at each load: a file whose
checksum or key does not match is deleted and the weights packed again. A file is written once
complete (a temporary name, then a rename), and only where packing made every copy (never a mix).
oneDNN's packed bf16 layout has no storage to keep: those copies are made at each load (cheap).
Best effort: a cache that cannot be read or written only costs the packing.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
from pathlib import Path

import blake3
import torch
from safetensors.torch import load_file, save_file

from cag.hashing import hash_obj

log = logging.getLogger("cag.packed")
_current: contextvars.ContextVar[tuple[PackedCache, str] | None] = contextvars.ContextVar("cag_packed", default=None)


def _code_digest() -> str:
    """The code that makes the packed bytes: the layouts, and which layout each kernel path takes."""
    h = hashlib.sha256()
    for name in ("layouts.py", "packed.py"):
        h.update(Path(__file__).with_name(name).read_bytes())
    return h.hexdigest()[:16]


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{','.join(map(str, t.shape))}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().data if t.numel() else b"")
    return "blake3:" + h.hexdigest()


class PackedCache:
    """The packed copies of one model in one packing: read from its file where it holds them, else
    recorded as `apply` makes them and written by `save`."""

    def __init__(self, folder: Path, fingerprint: str, packing: dict):
        self.key = hash_obj({"fingerprint": fingerprint, **packing, "code": _code_digest(), "torch": torch.__version__})
        self.prefix = fingerprint.split(":")[-1][:16]
        self.path = folder / f"{self.prefix}-{self.key.split(':')[-1][:32]}.safetensors"
        self.stored = self._read()
        self.made: dict[str, torch.Tensor] = {}
        self.missed = False

    def _read(self) -> dict[str, torch.Tensor] | None:
        if not self.path.exists():
            return None
        try:
            from safetensors import safe_open

            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(self.path))  # copies in memory: the kernels' own allocations, aligned
            if meta.get("key") != self.key or meta.get("checksum") != _checksum(tensors):
                raise ValueError("key or checksum mismatch")
            return tensors
        except Exception as e:  # noqa: BLE001 - truncated, edited, unreadable: pack again
            log.warning("packed weights %s not used (%s): packing again", self.path.name, e)
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)
            return None

    @property
    def hit(self) -> bool:
        return self.stored is not None and not self.missed

    def matrix(self, name: str):
        """Within it, `packed` reads and records the copies of matrix `name`."""
        return _Scope(self, name)

    def get(self, name: str, how: str, make, w: torch.Tensor):
        """The copy `make(w)` of matrix `name` packed as `how` (a tuple of tensors): stored, or made and recorded."""
        prefix = f"{name}/{how}/"
        if self.stored is not None and f"{prefix}0" in self.stored:
            out: list[torch.Tensor] = []
            while f"{prefix}{len(out)}" in self.stored:
                out.append(self.stored[f"{prefix}{len(out)}"])
            return tuple(out)
        self.missed = True
        out = make(w)
        for i, t in enumerate(out):
            self.made[f"{prefix}{i}"] = t
        return out

    def save(self) -> None:
        """Write the recorded copies where this load packed them all (nothing read from the file)."""
        if not self.made or self.stored is not None:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tensors = {k: v.contiguous() for k, v in self.made.items()}
            save_file(tensors, str(tmp), metadata={"key": self.key, "checksum": _checksum(tensors)})
            os.replace(tmp, self.path)
            for old in self.path.parent.glob(f"{self.prefix}-*.safetensors"):  # this model's older packings
                if old != self.path:
                    old.unlink(missing_ok=True)
        except Exception as e:  # noqa: BLE001 - a full or read-only disk: the next load packs again
            log.warning("packed weights not kept (%s)", e)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self.made = {}


class _Scope:
    def __init__(self, cache: PackedCache, name: str):
        self.cache, self.name = cache, name

    def __enter__(self):
        self.token = _current.set((self.cache, self.name))

    def __exit__(self, *exc):
        _current.reset(self.token)


def packed(how: str, make, w: torch.Tensor):
    """`make(w)` (a tuple of tensors), or its stored copy where a cache is open for the matrix being packed
    (weights.apply)."""
    scope = _current.get()
    if scope is None:
        return make(w)
    cache, name = scope
    return cache.get(name, how, make, w)
