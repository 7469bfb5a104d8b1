"""What a decode step reads: a shared prefix per snapshot, and one small suffix buffer per request.

A `PrefixKV` is a snapshot's K/V in the compute dtype on the compute device, held once however many
requests read it (cag.runtime.step attends to it without copying), and never written after it is built.

`Slots` are the requests' own positions: per layer one tensor (capacity, H_kv, room, D) for keys
and one for values, room = the longest suffix a request may hold (a conversation: as much of the
context as a snapshot leaves). A request takes a slot for its life and writes its question (or its
conversation) and answer K/V there; the slot's memory, not the snapshot's, is the cost of one more
concurrent request: layers x 2 x H_kv x D x dtype bytes a token it holds.

Attention reads a slot up to a width that does not depend on the request's neighbours (cag.runtime.rows),
masking the keys past the request's own; a masked key still enters the sums as 0 x value, so every
key a request has not written must be finite. The tensors are zero from the operating system (pages
no request has used cost no resident memory) and a slot is zeroed again, as far as its request wrote,
when it is given back: a request never reads another's keys or values, NaN or not.
"""

from __future__ import annotations

import math
import mmap
import threading
from dataclasses import dataclass, field

import torch

from cag.runtime import device_copy

MAX_SUFFIX = 32768  # a conversation's tokens: a slot's room is virtual memory, bounded for long-context models


@dataclass(eq=False)  # identity: requests on the same object share one read of it per layer
class PrefixKV:
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer keys, values (1, H_kv, n, D)
    n: int
    # what kernels made from it once, kept with it and gone with it: "pairs" {layer: (kt, vt)} for
    # cag.kernels.native's AVX-512 attention (cag.runtime.attention), a Graphs its captured decode step
    # (cag.runtime.cuda_graphs)
    made: dict = field(default_factory=dict, repr=False)
    # an int8 snapshot's codes per layer (store.snapshots.Snapshot.codes), on the CPU: the AVX-512
    # attention pairs them (cag.runtime.attention) and reads them in place of kv; a layer's entry is None once paired
    codes: list | None = field(default=None, repr=False)

    @classmethod
    def of(cls, kv: list, dtype: torch.dtype, device: torch.device | str, codes: list | None = None) -> PrefixKV:
        """A prefix in the compute dtype and device (a copy when either differs; a view otherwise). Host
        tensors bound for CUDA go through pinned staging (cag.runtime.device_copy), then cast there."""
        if kv and torch.device(device).type == "cuda" and kv[0][0].device.type == "cpu":
            flat = device_copy.to_device([t for pair in kv for t in pair], device)
            kv = list(zip(flat[0::2], flat[1::2]))
        kv = [(_cast(k, device, dtype), _cast(v, device, dtype)) for k, v in kv]
        keep = codes is not None and torch.device(device).type == "cpu"
        return cls(kv, kv[0][0].shape[2] if kv else 0, codes=list(codes) if codes is not None and keep else None)

    @property
    def nbytes(self) -> int:  # with the pairs made for the AVX-512 attention (bf16: as many bytes again; int8: ~half)
        made = [t for pair in self.made.get("pairs", {}).values() for t in pair]
        codes = [t for layer in self.codes or () if layer for t in layer]
        return sum(t.nbytes for t in (*(t for pair in self.kv for t in pair), *made, *codes))


def _cast(t: torch.Tensor, device, dtype: torch.dtype) -> torch.Tensor:
    """t on `device` in `dtype`. Between fp16 and bf16 on the CPU through float32: the same bits for
    every number, inf and subnormal (fp16 -> fp32 is exact, then one rounding either way) in less
    than half the time, since torch converts the two 16-bit types element by element but each step
    through fp32 vectorized."""
    if (
        {t.dtype, dtype} == {torch.float16, torch.bfloat16}
        and t.device.type == "cpu"
        and torch.device(device).type == "cpu"
    ):
        return t.float().to(dtype)
    return t.to(device, dtype)


class Slots:
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, room: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (capacity, n_kv, room, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(n_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(n_layers)]
        self.room, self.capacity = room, capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, slot: int, written: int | None = None) -> None:
        """Hand `slot` back, zeroing its first `written` positions (default: all) in every layer."""
        n = self.room if written is None else min(max(written, 0), self.room)
        if n:
            for t in (*self.k, *self.v):
                t[slot, :, :n].zero_()
        with self._lock:
            self._free.append(slot)

    @property
    def in_use(self) -> int:
        with self._lock:
            return self.capacity - len(self._free)


def _zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor whose pages cost no memory until written, on the CPU: an anonymous mapping of its
    own (zero pages from the operating system on first touch; page-aligned, so aligned for the kernels'
    vector loads), in pages of 4 KiB, never huge ones. numpy's zeros ask for transparent huge pages on
    large blocks: a request's first key in a layer would make 2 MiB of its slot resident, 96 MiB for one
    short question at 24 layers, where its own K/V is a few hundred KiB."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    # POSIX; a shared one would count as shared memory and be a forked child's too
    private = getattr(mmap, "MAP_PRIVATE", None)
    buf = mmap.mmap(-1, n, flags=private | mmap.MAP_ANONYMOUS) if private is not None else mmap.mmap(-1, n)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux: where THP is "always", too
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # the tensor holds the mapping
