"""Named user-facing errors. Each maps once to a CLI exit code and an HTTP status.

Exit codes: 1 user error (bad input, bad setting, unknown name, corrupt snapshot or store object,
unusable or read-only index, full disk ...), 2 command-line usage (typer's own), 3 refused because
the corpus is stale under the `refuse` policy, 4 busy (lock held, or another machine published the
corpus first), 5 `cag compare` incomplete (stopped at --max-minutes; --resume continues), 6 snapshot
store unreachable; the CLI adds 130 for an interrupt.
"""

from __future__ import annotations


class CagError(Exception):
    exit_code = 1
    http_status = 400
    code = "bad_request"


class BadInput(CagError):
    """Input the user can fix: empty question, unreadable document, unsupported option."""


class BadSettings(CagError):
    """A CAG_* variable or flag outside its valid range (see the README's Settings table)."""

    code = "bad_settings"


class IndexUnusable(CagError):
    """The index database cannot be used: not a SQLite file, unreadable, or its folder is a file."""

    http_status = 503
    code = "index_unusable"


class NotFound(CagError):
    http_status = 404
    code = "not_found"


class TooLarge(CagError):
    """Knowledge or question that does not fit the context window."""

    http_status = 413
    code = "too_large"


class ContextExceeded(CagError):
    """A conversation (with its answer) longer than the context left after the knowledge: OpenAI's
    context_length_exceeded."""

    http_status = 400
    code = "context_length_exceeded"


class ModelError(CagError):
    """A model that cannot be loaded or is not supported (e.g. sliding-window attention)."""

    http_status = 400
    code = "model_error"


class ModelChanged(ModelError):
    """The loaded model's weights file changed on disk: weights read from it would no longer be the
    ones its fingerprint names. 503: the server cannot answer until it is restarted."""

    http_status = 503
    code = "model_changed"


class SnapshotCorrupt(CagError):
    """A snapshot file that fails verification: truncated, tampered with, or built for another key.
    503: the server cannot serve that corpus until it is rebuilt (a refresh job does that)."""

    http_status = 503
    code = "snapshot_corrupt"


class StaleRefused(CagError):
    exit_code = 3
    http_status = 409
    code = "stale"


class Busy(CagError):
    exit_code = 4
    http_status = 429
    code = "busy"


class StoreConflict(Busy):
    """Another ingest (on another machine) published the corpus's ref in the shared store first."""


class StoreUnreachable(IndexUnusable):
    """The shared snapshot store (CAG_STORE) cannot be reached or refuses access; what the local
    cache holds is still served. Its HTTP code is the index's: the store is the shared index."""

    exit_code = 6


class StoreCorrupt(SnapshotCorrupt):
    """An object of a reachable shared store that cannot be used: a corpus's ref that is not a ref,
    or a blob it names that is missing or unreadable. Exit 1 and 503 like a corrupt snapshot (never
    6: the store answered); `cag ingest NAME` rebuilds what is missing and writes the ref again."""


class StorageFull(CagError):
    """This machine's disk has no room (ENOSPC, quota) for a snapshot or the index: nothing
    half-written is kept and the previous snapshot still answers. Free space and ingest again."""

    http_status = 507
    code = "insufficient_storage"
