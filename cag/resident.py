"""Snapshots kept in memory between questions: an LRU of loaded snapshots, each with a few warm
request buffers whose first n positions already hold the prefix.

A request takes a buffer (`acquire`), prefills its question at positions n.., decodes, and hands
the buffer back (`release`), which only resets the write position to n: the prefix is never copied
per token and never written by a question. The pool owns its state and its lock; the engine tells
it how to load a snapshot and how to make a buffer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from cag.store.snapshots import Snapshot

from . import kv


@dataclass
class Resident:
    """A loaded snapshot plus ready request buffers (positions [0, n) hold the prefix)."""

    snap: Snapshot
    max_len: int  # buffer length: n_tokens + question room + answer room
    nbytes: int  # snapshot tensors + warm buffers, for the LRU budget
    free: list = field(default_factory=list)


class ResidentPool:
    def __init__(self, budget_bytes: int, warm_buffers: int):
        self.budget_bytes = budget_bytes
        self.warm_buffers = warm_buffers
        self._items: OrderedDict[str, Resident] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"snapshot_hits": 0, "snapshot_loads": 0}  # read by /metrics

    def acquire(self, digest: str, load: Callable[[], Resident], new_buffer: Callable[[Resident], object]):
        """(resident, buffer holding its prefix); `load` reads and verifies the file on a miss."""
        with self._lock:
            res = self._items.get(digest)
            if res is not None:
                self._items.move_to_end(digest)
                self.stats["snapshot_hits"] += 1
                if res.free:
                    return res, res.free.pop()
        if res is None:
            res = load()
            with self._lock:
                self.stats["snapshot_loads"] += 1
                self._items[digest] = res
                self._items.move_to_end(digest)
                self._shrink()
        return res, new_buffer(res)

    def release(self, digest: str, res: Resident, buffer) -> None:
        kv.set_length(buffer, res.snap.n_tokens)  # positions >= n are scratch for the next question
        with self._lock:
            if self._items.get(digest) is res and len(res.free) < self.warm_buffers:
                res.free.append(buffer)  # warm buffers make concurrent hits free; each holds (n + room) KV

    def evict(self, digest: str | None = None) -> None:
        with self._lock:
            if digest is None:
                self._items.clear()
            else:
                self._items.pop(digest, None)

    def _shrink(self) -> None:
        while len(self._items) > 1 and sum(r.nbytes for r in self._items.values()) > self.budget_bytes:
            self._items.popitem(last=False)

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
