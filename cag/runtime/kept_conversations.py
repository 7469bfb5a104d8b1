"""Kept conversations: the K/V of a conversation's prompt, kept after its turn so the next turn
prefills only its new tokens.

A chat turn is the snapshot (the knowledge prefix) plus the conversation so far as its suffix
(cag.answering.chat). When a turn's question rows have been prefilled, the suffix's keys and values are copied
out of the request's slot and kept here under the snapshot's digest and the suffix's token ids. A
later request on the same snapshot whose suffix starts with kept tokens (the client sends the history
back, plus the answer and a new question) copies the longest such match into its slot and prefills
from there: matching is by tokens, no session id.

What is kept is exactly what prefilling the whole conversation from scratch writes. A question row's
bits do not depend on how the rows before it were split into turns (row-invariant products,
cag.runtime.rows.suffix_keys); where the step makes every row a decode row (cag.runtime.rows.flat: cag's
kernels on the CPU) an answer's decode rows are those bits too, and the answer is kept when it ends
(cag.runtime.decoder); elsewhere only question rows are kept. So a reused, an evicted-and-recomputed and a
`full` conversation give the same tokens. The answer the client sends back is matched as text
re-tokenized, which is what a recomputation would see too.

Bounded: an LRU under a byte budget (CAG_CONVERSATION_BYTES), also counted in the resident budget
(cag.answering.resident). Used from the decode thread; counters are read by /metrics from any thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(eq=False)
class Kept:
    key: str  # the snapshot digest the conversation's suffix continues
    ids: np.ndarray  # (n,) int64: the suffix's token ids
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer keys, values (H_kv, n, D), the slots' dtype
    nbytes: int = 0

    def __post_init__(self):
        self.nbytes = sum(t.nbytes for pair in self.kv for t in pair)

    @property
    def n(self) -> int:
        return len(self.ids)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


MIN_REUSE = 16  # fewer shared tokens (two questions that start alike) are not worth a copy: prefilled again


def _head(key: str, ids) -> tuple:
    """Where a kept conversation is found: any match of MIN_REUSE tokens or more shares its first ones."""
    return (key, tuple(int(t) for t in ids[:MIN_REUSE]))


class KeptConversations:
    def __init__(self, budget_bytes: int, kind: str = "conversation"):
        """`kind` names its counters: conversation (turns kept between requests), quote (cag.answering.quotes)."""
        self.budget_bytes, self.kind = budget_bytes, kind
        self._items: OrderedDict[int, Kept] = OrderedDict()  # id(Kept) -> Kept, oldest first
        self._heads: dict[tuple, dict[int, Kept]] = {}  # _head -> the kept conversations that start so
        self._held = 0  # bytes of _items
        self._lock = threading.Lock()
        self.stats = {f"{kind}_{k}": 0 for k in ("hits", "misses", "reused_tokens", "evictions")}

    def match(self, key: str, ids: list[int]) -> tuple[Kept | None, int]:
        """The kept conversation sharing the longest token prefix with `ids` on snapshot `key`, and
        how many of its tokens can be reused (at most len(ids) - 1: the last token's row gives the
        logits the answer starts from); none below MIN_REUSE tokens."""
        a = np.asarray(ids, dtype=np.int64)
        best, n = None, 0
        with self._lock:
            for item in self._heads.get(_head(key, ids), {}).values() if len(ids) > MIN_REUSE else ():
                if (m := common_prefix(a, item.ids)) > n:
                    best, n = item, m
            n = min(n, len(ids) - 1)
            if best is not None and n >= MIN_REUSE:
                self._items.move_to_end(id(best))
                self.stats[f"{self.kind}_hits"] += 1
                self.stats[f"{self.kind}_reused_tokens"] += n
                return best, n
            self.stats[f"{self.kind}_misses"] += 1
        return None, 0

    def keep(self, key: str, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep a copy of a suffix's K/V (`kv`: views of a request's slot, per layer (H_kv, n, D)).
        Kept conversations it extends are dropped: every match they could give, the new one gives too."""
        if len(ids) < MIN_REUSE or sum(t.nbytes for pair in kv for t in pair) > self.budget_bytes:
            return  # nothing copied
        item = Kept(key, np.asarray(ids, dtype=np.int64), [(k.clone(), v.clone()) for k, v in kv])
        with self._lock:
            head = _head(key, ids)
            for k, old in list(self._heads.get(head, {}).items()):
                if old.n <= item.n and common_prefix(old.ids, item.ids) == old.n:
                    self._drop(k)
            self._items[id(item)] = self._heads.setdefault(head, {})[id(item)] = item
            self._held += item.nbytes
            self._shrink(self.budget_bytes)

    def shrink(self, budget_bytes: int) -> None:
        """Evict the oldest until at most `budget_bytes` are kept (the resident pool's share)."""
        with self._lock:
            self._shrink(budget_bytes)

    def _shrink(self, budget: int) -> None:
        while self._items and self._held > budget:
            self._drop(next(iter(self._items)))
            self.stats[f"{self.kind}_evictions"] += 1

    def _drop(self, k: int) -> Kept:
        item = self._items.pop(k)
        bucket = self._heads[_head(item.key, item.ids)]
        del bucket[k]
        if not bucket:
            del self._heads[_head(item.key, item.ids)]
        self._held -= item.nbytes
        return item

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._heads.clear()
            self._held = 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._held

    def snapshot(self) -> dict:
        """Counters and gauges for /metrics."""
        with self._lock:
            return self.stats | {f"{self.kind}s_kept": len(self._items), f"{self.kind}_bytes": self._held}


def best_match(stores: list[tuple[KeptConversations | None, str | None]], ids: list[int]) -> tuple[Kept | None, int]:
    """The longest match of `ids` among (store, key) pairs (a None store or key is skipped)."""
    found: tuple[Kept | None, int] = (None, 0)
    for store, key in stores:
        if store is not None and key is not None and (m := store.match(key, ids))[1] > found[1]:
            found = m
    return found
