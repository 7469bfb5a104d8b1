"""This machine and the shared store: the local SQLite index is a cache of the store's refs, and
`CAG_HOME/snapshots/` a bounded cache of its blobs.

What the engine calls (cag/engine.py, cag/knowledge/ingest.py, cag/knowledge/upkeep.py):
  put_blob(path, digest)        after a snapshot file is saved, before anything names it
  publish(corpus, docs, rows, expect)   the ref, conditionally, before the local index publishes
  pull(corpus)                  at the start of an ingest: adopt the store's ref if it moved (a ref
                                that is corrupt or names a missing blob is not adopted: the ingest
                                rebuilds and overwrites it)
  source_of(corpus)             `cag ingest NAME` of a corpus this machine knows only from the store
  lookup(corpus)                before a question: adopt the store's ref on a miss, and every
                                CAG_STORE_REF_TTL_S for a known corpus (best effort: when the store
                                is unreachable, a known corpus keeps being served from the cache)
  ensure_local(digest, path)    before a snapshot file is read: fetch and verify it when missing
  adopt_all() / gc(...)         `cag reindex` and `cag gc`
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Literal

from cag.errors import NotFound, StoreCorrupt, StoreUnreachable
from cag.knowledge.names import name_problem

from . import cache
from .index import Index
from .remote import Ref, RemoteStore
from .snapshot_header import SnapshotError, spans_of


def shared_store(settings, index: Index) -> Shared | LocalOnly:
    """The shared store of these settings, or (CAG_STORE unset) a falsy stand-in whose lookups do
    nothing and whose files are the local ones, so callers need no branch."""
    return Shared(settings, index) if settings.store else LocalOnly()


class LocalOnly:
    """No shared store: snapshots live in CAG_HOME only."""

    def __bool__(self) -> Literal[False]:  # `if remote:` tells the type checker it is a Shared
        return False

    def lookup(self, corpus: str) -> bool:
        return False

    def ensure_local(self, digest: str, path: Path) -> Path:
        return path


def known_corpus(index: Index, remote: Shared | LocalOnly, corpus: str) -> dict:
    """The index row of `corpus`, after the shared store's ref is looked up (on a miss, and every
    CAG_STORE_REF_TTL_S); NotFound for a corpus neither knows. No model, no torch."""
    remote.lookup(corpus)
    row = index.corpus(corpus)
    if row is None:
        raise NotFound(f"unknown corpus {corpus!r}; `cag list` shows the known ones")
    return row


def _host() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Shared:
    def __init__(self, settings, index: Index, remote: RemoteStore | None = None):
        self.settings, self.index = settings, index
        self.remote = remote or RemoteStore(settings.store)
        self.folder: Path = settings.snapshots_dir
        self._checked: dict[str, float] = {}  # corpus -> when its ref was last looked up
        self._lock = threading.Lock()

    # -- blobs -----------------------------------------------------------------------------------
    def put_blob(self, path: Path, digest: str) -> None:
        self.remote.put_blob(path, digest)

    def ensure_local(self, digest: str, path: Path) -> Path:
        """The blob as a verified local file: fetched into the cache when missing (SnapshotError
        when the store's copy fails verification), then the cache is trimmed to its budget. A
        local copy that failed verification before (its row says corrupt) is fetched again: the
        store's copy heals this machine's cache, or fails verification in its turn."""
        row = self.index.snapshot(digest)
        healing = row is not None and row["status"] == "corrupt"
        if not path.exists() or healing:
            with self._lock:  # one fill per blob at a time in this process
                if healing:
                    path.unlink(missing_ok=True)
                if not path.exists():
                    cache.fill(self.remote, digest, path)
                    self.trim(keep={digest})
                if healing:
                    self.index.set_snapshot_status(digest, "ready")
        cache.touch(path)
        return path

    def trim(self, keep: AbstractSet[str] = frozenset()) -> list[str]:
        sizes: dict[str, int] | None = None

        def in_store(digest: str, size: int) -> bool:
            nonlocal sizes
            if sizes is None:
                try:
                    sizes = {b["digest"]: b["bytes"] for b in self.remote.blobs()}
                except StoreUnreachable:
                    sizes = {}  # cannot tell: evict nothing
            return sizes.get(digest) == size

        return cache.evict(self.folder, self.settings.store_cache_bytes, set(keep), in_store)

    # -- refs ------------------------------------------------------------------------------------
    def publish(self, corpus: dict, documents: list[dict], snapshots: list[dict], expect: Ref | None) -> Ref:
        """Write the corpus's ref naming `snapshots` (their blobs are already uploaded)."""
        body = {"corpus": corpus["name"], "source": corpus["source"], "model": corpus["model"],
                "ttl_s": corpus.get("ttl_s"), "shard_tokens": corpus.get("shard_tokens"),
                "shards": [s["digest"] for s in snapshots],
                "documents": [{"path": d["path"], "content_hash": d["content_hash"]} for d in documents],
                "created": time.time(), "generation": (expect.generation + 1) if expect else 1, "host": _host()}
        ref = self.remote.put_ref(body, expect)
        self._checked[corpus["name"]] = time.monotonic()
        return ref

    def pull(self, corpus: str) -> Ref | None:
        """The store's ref of `corpus` for an ingest that will write it (None: not in the store),
        adopted into the index if it differs. A ref that is corrupt, or that names a blob missing or
        unreadable, is not adopted: the ingest rebuilds from the source and its conditional write
        (expecting this ref's ETag) replaces it. That is how `cag ingest NAME` heals the store."""
        ref = self.remote.get_ref(corpus, broken_ok=True)
        if ref is not None and not ref.broken and self._differs(corpus, ref):
            try:
                self.adopt(ref)
            except SnapshotError:
                pass
        self._checked[corpus] = time.monotonic()
        return ref

    def source_of(self, corpus: str) -> str | None:
        """The source folder the store's ref of `corpus` records (None: no such corpus, or a corrupt
        ref), so that `cag ingest NAME` works on a machine that knows the corpus only from the store."""
        if not corpus or "/" in corpus or corpus.startswith((".", "~")):
            return None
        ref = self.remote.get_ref(corpus, broken_ok=True)
        source = ref.body.get("source") if ref is not None and not ref.broken else None
        return source if isinstance(source, str) and source else None

    def lookup(self, corpus: str) -> bool:
        """Bring the index up to the store for a question on `corpus`. A corpus unknown here is looked
        up always (StoreUnreachable when the store cannot say); a known one at most every
        CAG_STORE_REF_TTL_S, and an unreachable store then leaves it as it is. True if it changed."""
        known = self.index.corpus(corpus) is not None
        last = self._checked.get(corpus)
        if known and last is not None and time.monotonic() - last < self.settings.store_ref_ttl_s:
            return False
        try:
            ref = self.remote.get_ref(corpus)
        except (StoreUnreachable, StoreCorrupt):
            if known:
                return False  # the cache still serves what it holds (a corrupt ref waits for `cag ingest`)
            raise
        self._checked[corpus] = time.monotonic()
        if ref is None or not self._differs(corpus, ref):
            return False
        try:
            self.adopt(ref)
        except SnapshotError as e:  # a blob missing, or with a header unreadable or edited
            raise StoreCorrupt(
                f"corpus {corpus!r} in the store: {e}; run `cag ingest {corpus}` to rebuild it"
            ) from None
        return True

    def _differs(self, corpus: str, ref: Ref) -> bool:
        return [r["snapshot"] for r in self.index.shards(corpus)] != ref.shards

    def adopt(self, ref: Ref) -> None:
        """Make the index say what the ref says: its snapshot rows (from the blobs' headers: two
        ranged reads each, unless the blob is cached here), documents and shards, in one transaction.
        A ref whose corpus name breaks the naming rule of `cag ingest` (a hand-written or foreign
        ref: `.hidden`, a trailing space, a bidi override) is refused as a corrupt one is."""
        name = ref.body["corpus"]
        if why := name_problem(name):
            raise StoreCorrupt(f"ref of {name!r} in {self.remote.url} is refused: invalid corpus name: {why}; "
                               "remove or rename it in the store")
        shards = []
        for digest in ref.shards:
            path = self.folder / f"{digest}.safetensors"
            if path.exists():
                from .snapshot_header import read_header

                meta, size = read_header(path), path.stat().st_size
            else:
                meta, size = self.remote.read_header(digest)
            if not isinstance(meta.get("key"), str):
                raise SnapshotError(f"snapshot {digest[:12]}: header has no key")
            shards.append((_snapshot_row(digest, meta, size, path), spans_of(meta, f"snapshot {digest[:12]}")))
        b = ref.body
        corpus = {"name": b["corpus"], "source": b.get("source"), "model": b.get("model"), "ttl_s": b.get("ttl_s"),
                  "shard_tokens": b.get("shard_tokens")}
        # size -1: hash on check
        docs = [{"path": d["path"], "content_hash": d["content_hash"], "size": -1, "mtime": 0.0}
                for d in b.get("documents", [])]
        if len(shards) > 1:  # routing reads every shard's token ids from its local file
            for row, _ in shards:
                self.ensure_local(row["digest"], Path(row["path"]))
        self.index.publish_shards(corpus, docs, shards)

    def adopt_all(self) -> tuple[list[str], list[dict]]:
        """Adopt every ref in the store (`cag reindex`). Returns the corpora adopted and the refs
        refused ({corpus, why}): a ref that is corrupt, badly named, or names a blob missing or
        unreadable is reported, and every sound one is still adopted. An unreachable store stops it."""
        out, refused = [], []
        for corpus in self.remote.ref_names():
            try:
                ref = self.remote.get_ref(corpus)  # StoreCorrupt: not a ref
                if ref is None:
                    continue  # deleted since the listing
                if self._differs(corpus, ref):
                    self.adopt(ref)
            except StoreCorrupt as e:
                refused.append({"corpus": corpus, "why": str(e)})
                continue
            except SnapshotError as e:
                refused.append({"corpus": corpus, "why": f"corpus {corpus!r} in the store: {e}; "
                                                         f"run `cag ingest {corpus}` to rebuild it"})
                continue
            out.append(corpus)
        return sorted(out), refused

    # -- gc --------------------------------------------------------------------------------------
    def gc(self, dry_run: bool) -> tuple[list[dict], list[dict]]:
        """Blobs in the store that no ref names and that are older than CAG_STORE_GC_GRACE_S (an
        ingest elsewhere uploads its blobs before it writes the ref that names them: the grace
        period covers that window). Never a blob a ref names. Returns (deleted, kept) entries."""
        named = {d for ref in self.remote.refs() for d in ref.shards}
        now, deleted, kept = time.time(), [], []
        for b in self.remote.blobs():
            if b["digest"] in named:
                continue
            entry = {"digest": b["digest"], "corpus": None, "bytes": b["bytes"]}
            if now - b["modified"] < self.settings.store_gc_grace_s:
                kept.append(
                    dict(
                        entry,
                        why=f"in the store, named by no ref, younger than {self.settings.store_gc_grace_s:g} s (an "
                        "ingest may be about to name it)",
                    )
                )
                continue
            if not dry_run:
                self.remote.delete_blob(b["digest"])
            deleted.append(dict(entry, why="in the store, named by no ref"))
        return deleted, kept


def _snapshot_row(digest: str, meta: dict, size: int, path: Path) -> dict:
    spans = meta["spans"]  # checked by spans_of
    return {
        "key": meta["key"],
        "digest": digest,
        "corpus": meta.get("corpus"),
        "model": meta.get("model"),
        "model_fingerprint": meta.get("model_fingerprint"),
        "tokenizer_fingerprint": meta.get("tokenizer_fingerprint"),
        "n_tokens": meta.get("n_tokens"),
        "n_documents": len(spans),
        "bytes": size,
        "dtype": meta.get("dtype"),
        "path": str(path),
        "created": meta.get("created"),
        "last_used": None,
        "prefill_ms": meta.get("prefill_ms"),
        "reused_tokens": meta.get("reused_tokens", 0),
    }
