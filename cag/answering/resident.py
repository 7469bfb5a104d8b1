"""Snapshots kept in memory between questions: an LRU of loaded snapshots, each as a `PrefixKV`
(its K/V in the compute dtype on the compute device), held once and read by every request on it.

A request never writes the prefix: its question and answer go to its own suffix slot (cag.runtime.slots),
so concurrent requests on one snapshot share it with no copy. The pool owns its state and its
lock; the engine tells it how to load a snapshot.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cag.kernels import native
from cag.runtime.slots import PrefixKV
from cag.store.snapshots import Snapshot

if TYPE_CHECKING:
    from cag.model.loading import LoadedModel


@dataclass
class Resident:
    """A loaded, verified snapshot (its header and ids; its tensors live on as `prefix`)."""

    snap: Snapshot
    prefix: PrefixKV

    @property
    def nbytes(self) -> int:
        return self.prefix.nbytes

    @classmethod
    def of(cls, snap: Snapshot, lm: LoadedModel) -> Resident:
        """A verified snapshot made resident: its K/V in `lm`'s attention dtype on its device, once (every
        request reads it); the storage-dtype tensors are let go."""
        prefix = PrefixKV.of(snap.kv, lm.attn_dtype, lm.device, codes_read(lm, snap.codes))
        snap.kv, snap.codes = [], None
        return cls(snap, prefix)


def codes_read(lm: LoadedModel, codes: list | None) -> list | None:
    """An int8 snapshot's codes where decode rows read them (cag.kernels.native's AVX-512 attention, heads of
    native.INT8_HEAD_DIMS, 80 included), else None: the prefix is then its dequantized K/V."""
    return codes if lm.backend.int8_codes and lm.head_dim in native.INT8_HEAD_DIMS else None


class ResidentPool:
    """`kept`: stores of kept K/V (cag.runtime.kept_conversations: conversations, then warmed quotes), counted in the
    same budget. Past it, snapshots other than the one just asked for go first (least recently used), then the
    kept stores in that order: per byte a kept row is worth ~100x a snapshot's (a 16K-token SmolLM2 snapshot,
    350 MiB, reloads from the page cache in 0.1-0.2 s; a 4.6 MiB warmed quote costs ~1 s of prefill to make again)."""

    def __init__(self, budget_bytes: int, kept: list | None = None):
        self.budget_bytes = budget_bytes
        self.kept = kept or []
        self._items: OrderedDict[str, Resident] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"snapshot_hits": 0, "snapshot_loads": 0}  # read by /metrics

    def get(self, digest: str, load: Callable[[], Resident]) -> Resident:
        """The resident snapshot; `load` reads and verifies the file on a miss. An evicted one stays
        valid for the requests still holding it."""
        with self._lock:
            res = self._items.get(digest)
            if res is not None:
                self._items.move_to_end(digest)
                self.stats["snapshot_hits"] += 1
                # a prefix grows once decoding makes its pairs (cag.runtime.attention): the budget holds then too
                self._shrink()
                return res
        res = load()
        with self._lock:
            self.stats["snapshot_loads"] += 1
            self._items[digest] = res
            self._items.move_to_end(digest)
            self._shrink()
        return res

    def evict(self, digest: str | None = None) -> None:
        with self._lock:
            if digest is None:
                self._items.clear()
            else:
                self._items.pop(digest, None)

    def _shrink(self) -> None:
        held = sum(r.nbytes for r in self._items.values())
        kept = sum(s.nbytes for s in self.kept)
        while len(self._items) > 1 and held + kept > self.budget_bytes:  # the last one asked for stays
            held -= self._items.popitem(last=False)[1].nbytes
        for i, store in enumerate(self.kept):  # the later stores' bytes stay while an earlier one shrinks
            store.shrink(max(0, self.budget_bytes - held - sum(s.nbytes for s in self.kept[i + 1:])))
            held += store.nbytes

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._items

    def values(self) -> list[Resident]:
        with self._lock:
            return list(self._items.values())

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._items.values())
