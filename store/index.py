"""The SQLite index: corpora, documents, snapshots, the documents inside each snapshot, queries.

WAL mode with a busy timeout so queries can log while an ingest writes. Schema changes are
numbered migrations recorded in `PRAGMA user_version`. Every change of state is one transaction.

A snapshot row's `status` is a fact about its file: `ready` or `corrupt`. Whether it is current or
superseded is each corpus's own view (`corpora.current_snapshot`): content-identical corpora share
one file, so "superseded" is derived, never stored: a snapshot that no corpus points to.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path

import sqlite_utils

from cag.errors import IndexUnusable, StorageFull

log = logging.getLogger("cag.index")


def _m1(db: sqlite_utils.Database) -> None:
    db.table("corpora").create(
        {"name": str, "source": str, "model": str, "ttl_s": float, "current_snapshot": str,
         "invalidated": str, "created": float, "updated": float},
        pk="name",
    )
    db.table("documents").create(
        {"corpus": str, "path": str, "content_hash": str, "size": int, "mtime": float, "ordinal": int},
        pk=("corpus", "path"),
    )
    db.table("snapshots").create(
        {"key": str, "digest": str, "corpus": str, "model": str, "model_fingerprint": str,
         "tokenizer_fingerprint": str, "n_tokens": int, "n_documents": int, "bytes": int,
         "dtype": str, "path": str, "status": str, "created": float, "last_used": float,
         "prefill_ms": float, "reused_tokens": int},
        pk="digest",
    )
    db.table("snapshots").create_index(["corpus"])
    db.table("snapshot_documents").create(
        {"snapshot": str, "path": str, "content_hash": str, "start": int, "end": int, "ordinal": int},
        pk=("snapshot", "path"),
    )
    db.table("queries").create(
        {"id": int, "corpus": str, "snapshot": str, "question": str, "answer": str, "mode": str,
         "prompt_tokens": int, "cached_tokens": int, "completion_tokens": int, "load_ms": float,
         "ttft_ms": float, "total_ms": float, "retrieval_ms": float, "created": float},
        pk="id",
    )


def _m2(db: sqlite_utils.Database) -> None:
    # "superseded" was stored on the file's row by whichever corpus moved on, which marked a
    # content-identical corpus still using that file stale. It is derived now (no corpus points
    # to the snapshot), so the stored word goes.
    db.execute("UPDATE snapshots SET status = 'ready' WHERE status = 'superseded'")


def _m3(db: sqlite_utils.Database) -> None:
    # Sharded corpora: one snapshot per shard. Shard 0 is also corpora.current_snapshot, so a
    # corpus of one shard reads exactly as before.
    db.table("shards").create({"corpus": str, "shard": int, "snapshot": str}, pk=("corpus", "shard"))
    db.execute("INSERT INTO shards (corpus, shard, snapshot) "
               "SELECT name, 0, current_snapshot FROM corpora WHERE current_snapshot IS NOT NULL")
    db.table("corpora").add_column("shard_tokens", int)  # the --shard-tokens cap, kept for refreshes


def _m4(db: sqlite_utils.Database) -> None:
    # What each model load found out (cag.model.facts), keyed by its files and settings: commands that
    # only compare fingerprints read them instead of loading the model.
    db.table("model_facts").create({"key": str, "facts": str, "recorded": float}, pk="key")


def _m5(db: sqlite_utils.Database) -> None:
    # How each snapshot's knowledge was prefilled (cag.runtime.knowledge_kv.method): one prefilled another way than
    # the configured one is sound but stale. Rows from before hold NULL: prefilled in blocks.
    db.table("snapshots").add_column("prefill", str)


MIGRATIONS = [_m1, _m2, _m3, _m4, _m5]


class Index:
    """One SQLite connection per thread (sqlite3 connections refuse other threads); WAL mode and
    the busy timeout let them work side by side, and with other processes."""

    def __init__(self, path: Path):
        self.path = path
        self._local = threading.local()
        self._query_columns: set[str] | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise IndexUnusable(f"cannot use {path.parent} for the index: {e.strerror or e}") from None
        try:
            self._migrate()
        except sqlite3.DatabaseError as e:  # "file is not a database", "unable to open", malformed
            self._local.db = None
            raise IndexUnusable(f"{path} is not a usable index ({e}); move it away and run `cag reindex` "
                                f"to rebuild it from the snapshot files") from None

    @property
    def db(self) -> sqlite_utils.Database:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = sqlite_utils.Database(self.path)
            db.execute("PRAGMA busy_timeout = 10000")
            db.enable_wal()
        return db

    def _migrate(self) -> None:
        with self.atomic():
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            for i, step in enumerate(MIGRATIONS[version:], start=version + 1):
                step(self.db)
                self.db.execute(f"PRAGMA user_version = {i}")

    @contextmanager
    def atomic(self, doing: str = "cannot write to the index"):
        """One transaction (BEGIN IMMEDIATE: writers queue on the busy timeout, never interleave). A
        write the file refuses (read-only, disk full, I/O error) is one line, `doing` first:
        IndexUnusable or StorageFull."""
        conn = self.db.conn
        if conn.in_transaction:
            yield
            return
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                if conn.in_transaction:  # SQLite rolls some failures (a full disk) back itself
                    conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        except sqlite3.OperationalError as e:
            if (refused := self._write_error(e, doing)) is None:
                raise
            raise refused from None

    def _write_error(self, e: sqlite3.OperationalError, doing: str) -> Exception | None:
        """The CagError of a write the database file refused, None for other errors (kept as they are)."""
        name = getattr(e, "sqlite_errorname", "") or ""
        if name.startswith("SQLITE_READONLY") or "readonly" in str(e):
            return IndexUnusable(f"{doing}: {self.path} is read-only ({e})")
        if name == "SQLITE_FULL" or "is full" in str(e):
            return StorageFull(f"{doing}: {self.path}: the disk is full ({e}); free space and try again")
        if name.startswith(("SQLITE_IOERR", "SQLITE_CANTOPEN")):
            return IndexUnusable(f"{doing}: {self.path} ({e})")
        return None

    def require_writable(self, doing: str) -> None:
        """Raise IndexUnusable (or StorageFull) now if the index cannot be written: a write of the
        header's user_version to itself, rolled back, so that work whose result must be recorded
        (an ingest) fails before it starts, not after."""
        conn = self.db.conn
        try:
            with self.atomic(doing):
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                conn.execute(f"PRAGMA user_version = {int(version)}")
                raise _Probe
        except _Probe:
            pass

    # -- corpora -------------------------------------------------------------------------------
    def _rows(self, table: str, where: str, params: list, order_by: str | None = None) -> list[dict]:
        """Rows as dicts by one query: the lookups every question makes (a sharded corpus's freshness
        reads each shard's rows) skip the table checks `rows_where` runs first (4 statements per
        lookup). `table`, `where` and `order_by` are this module's own constants."""
        return list(
            self.db.query(
                f"select * from [{table}] where {where}" + (f" order by {order_by}" if order_by else ""), params
            )
        )

    def corpus(self, name: str) -> dict | None:
        rows = self._rows("corpora", "name = ?", [name])
        return rows[0] if rows else None

    def corpora(self) -> list[dict]:
        return list(self.db["corpora"].rows_where(order_by="name"))

    def documents(self, corpus: str) -> list[dict]:
        return self._rows("documents", "corpus = ?", [corpus], "ordinal")

    def snapshot(self, digest: str) -> dict | None:
        rows = self._rows("snapshots", "digest = ?", [digest])
        return rows[0] if rows else None

    def snapshots(self, corpus: str | None = None) -> list[dict]:
        """All snapshot rows, or those built by `corpus` (the name in the file's header)."""
        if corpus is None:
            return list(self.db["snapshots"].rows_where(order_by="created"))
        return list(self.db["snapshots"].rows_where("corpus = ?", [corpus], order_by="created"))

    def corpora_using(self, digest: str) -> list[str]:
        """The corpora with `digest` as a current snapshot, of any shard (several when contents are identical)."""
        rows = self.db.execute("SELECT name FROM corpora WHERE current_snapshot = ? UNION "
                               "SELECT corpus FROM shards WHERE snapshot = ? ORDER BY 1", [digest, digest])
        return [r[0] for r in rows.fetchall()]

    def users(self) -> dict[str, list[str]]:
        """Every snapshot some corpus uses (any shard) -> those corpora."""
        out: dict[str, list[str]] = {}
        for digest, corpus in self.db.execute(
            "SELECT current_snapshot, name FROM corpora WHERE current_snapshot IS NOT NULL UNION SELECT snapshot, "
            "corpus FROM shards ORDER BY 2"
        ).fetchall():
            out.setdefault(digest, []).append(corpus)
        return out

    def shards(self, corpus: str) -> list[dict]:
        """The corpus's shards in order: {corpus, shard, snapshot}."""
        return self._rows("shards", "corpus = ?", [corpus], "shard")

    def superseded(self, digest: str) -> bool:
        """No corpus points to this snapshot any more (derived per corpus, never stored)."""
        return not self.corpora_using(digest)

    def snapshot_documents(self, digest: str) -> list[dict]:
        return self._rows("snapshot_documents", "snapshot = ?", [digest], "ordinal")

    def publish(self, corpus: dict, documents: list[dict], snapshot: dict, spans: Iterable[dict]) -> None:
        """Record a ready snapshot and make it the corpus's current one, all in one transaction."""
        self.publish_shards(corpus, documents, [(snapshot, spans)])

    def publish_shards(
        self, corpus: dict, documents: list[dict], shards: Sequence[tuple[dict, Iterable[dict]]]
    ) -> None:
        """Record each shard's ready snapshot (with its document spans) and make them the corpus's
        current shards, all in one transaction: readers see the old set or the new one."""
        now = time.time()
        name = corpus["name"]
        with self.atomic():
            old = self.corpus(name)
            row = dict(corpus, updated=now, current_snapshot=shards[0][0]["digest"], invalidated=None)
            row.setdefault("created", old["created"] if old else now)
            self.db.table("corpora").upsert(row, pk="name", alter=True)
            self.db.table("documents").delete_where("corpus = ?", [name])
            self.db.table("documents").insert_all([dict(d, corpus=name, ordinal=i) for i, d in enumerate(documents)])
            self.db.table("shards").delete_where("corpus = ?", [name])
            self.db.table("shards").insert_all([{"corpus": name, "shard": i, "snapshot": snap["digest"]}
                                          for i, (snap, _) in enumerate(shards)])
            # snapshots no longer used are superseded for this corpus only: nothing to write on their rows
            for snap, spans in shards:
                self.db.table("snapshots").upsert(dict(snap, status="ready"), pk="digest")
                self.db.table("snapshot_documents").delete_where("snapshot = ?", [snap["digest"]])
                self.db.table("snapshot_documents").insert_all(
                    [dict(s, snapshot=snap["digest"], ordinal=i) for i, s in enumerate(spans)])

    def set_snapshot_status(self, digest: str, status: str) -> None:
        """`ready` or `corrupt`: what the file is, the same for every corpus using it."""
        with self.atomic():
            self.db.table("snapshots").update(digest, {"status": status})

    def log_query(self, row: dict) -> str | None:
        """Record an answer; a log the file refuses (read-only, disk full) never costs the answer: a
        warning is logged and returned (the CLI prints it) instead."""
        try:
            with self.atomic("the query log could not be written"):
                if self._query_columns is None:  # an answer carries more fields than the log keeps
                    self._query_columns = set(self.db["queries"].columns_dict)
                self.db.table("queries").insert(
                    {k: v for k, v in dict(row, created=time.time()).items() if k in self._query_columns}
                )
                if row.get("snapshot") and row.get("mode") == "cag":
                    self.db.table("snapshots").update(row["snapshot"], {"last_used": time.time()})
        except (IndexUnusable, StorageFull) as e:
            log.warning("%s", e)
            return str(e)
        return None

    def model_facts(self, key: str) -> dict | None:
        rows = self._rows("model_facts", "key = ?", [key])
        return rows[0] if rows else None

    def record_model_facts(self, key: str, facts: str) -> None:
        with self.atomic("cannot record the model's facts"):
            self.db.table("model_facts").upsert({"key": key, "facts": facts, "recorded": time.time()}, pk="key")

    def queries(self, corpus: str | None = None, limit: int = 100) -> list[dict]:
        where, args = ("corpus = ?", [corpus]) if corpus else (None, None)
        return list(self.db["queries"].rows_where(where, args, order_by="id desc", limit=limit))


class _Probe(Exception):
    """Rolls require_writable's probe back."""
