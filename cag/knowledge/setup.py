"""What keying, building and verifying snapshots read: the loaded model and its prompt layout, the
settings, the index and the shared store. The engine resolves one per ingest (and per snapshot it
opens: Engine.snapshots) and hands it to knowledge's steps (ingest.py, verify.py) in place of itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cag.errors import TooLarge
from cag.hashing import hash_obj
from cag.runtime import knowledge_kv
from cag.store import snapshots as snapfiles

if TYPE_CHECKING:
    from cag.config import Settings
    from cag.model.loading import LoadedModel
    from cag.model.prompt import Layout
    from cag.store.index import Index
    from cag.store.sync import LocalOnly, Shared


@dataclass(frozen=True)
class SnapshotSetup:
    settings: Settings
    index: Index
    remote: Shared | LocalOnly  # CAG_STORE (store/sync.py); falsy without one
    lm: LoadedModel
    layout: Layout
    kv_name: str  # what snapshots are stored as (Engine.kv_name)
    # n -> how n knowledge tokens are prefilled here (cag.runtime.knowledge_kv.method: part of the key)
    prefill: Callable[[int], str]
    # (how, store dtype, ids, seed=K/V of the first rows, tick=progress) -> per layer K/V (1, H_kv, n, D) as stored
    compute: Callable[..., list]

    @property
    def kv_dtype(self):
        return snapfiles.DTYPES[self.kv_name]

    @property
    def room(self) -> int:
        """Tokens reserved after the knowledge: CAG_QUESTION_ROOM + CAG_ANSWER_ROOM."""
        return self.settings.question_room + self.settings.answer_room

    def key(self, ids: list[int], kv_name: str | None = None, prefill: str | None = None) -> str:
        """Everything that determines the tensors (stored as `kv_name` and prefilled as `prefill`, default the
        configured ones); docs/concepts.md (snapshot keys). A block's method keys as before methods were named."""
        lm, how = self.lm, prefill or self.prefill(len(ids))
        return hash_obj({
            "format": snapfiles.FORMAT_VERSION, "model": lm.fingerprint, "tokenizer": lm.tokenizer_fingerprint,
            "layout": self.layout.as_dict(), "ids": hash_obj(ids), "dtype": snapfiles.codec(kv_name or self.kv_name),
            "compute_dtype": str(lm.dtype), "prefill_block": knowledge_kv.block(how),
            **({"prefill": how} if how.startswith("rows") else {}),
        })

    def require_fit(self, n_prefix: int, what: str) -> None:
        """Refuse a knowledge prefix of `n_prefix` tokens that leaves no room for question and answer."""
        lm, room = self.lm, self.room
        if not lm.fits(n_prefix, room):
            raise TooLarge(f"{what} is {n_prefix} tokens; with {room} reserved for question and answer the "
                           f"model's context of {lm.max_context} leaves room for {lm.max_context - room}")
