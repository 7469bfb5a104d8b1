"""A corpus as the engine sees it: where its files are, one writer at a time, its documents in
prompt order."""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

from cag.errors import BadInput, Busy, NotFound, TooLarge
from cag.hashing import hash_obj
from cag.knowledge import documents
from cag.results import human_bytes
from cag.store.index import Index


def resolve_source(index: Index, target: str, name: str | None) -> tuple[str, Path]:
    """(corpus name, source path). A bare name of a known corpus means that corpus (its recorded
    source), even when a folder of the same name sits in the working directory; anything else is
    a path, and the corpus is named after it unless `name` is given."""
    row = index.corpus(target)
    if row and os.sep not in target and not target.startswith((".", "~")):
        return name if name is not None else target, Path(row["source"])
    p = Path(target).expanduser()
    if p.exists():
        p = p.resolve()
        return name if name is not None else (p.stem if p.is_file() else p.name), p
    raise NotFound(f"no such file, folder or corpus: {target}")


@contextmanager
def writer_lock(home: Path, corpus: str):
    """One writer per corpus across processes: a second ingest of it fails with Busy instead of racing."""
    locks = home / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{hash_obj(corpus)[7:23]}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(f"corpus {corpus!r} is being ingested by another process; try again when it finishes") from None
        yield


def read_corpus(
    index: Index, source: Path, corpus: str | None, limits=None, reporter=None
) -> tuple[list[documents.Document], list[str]]:
    """Documents in prompt order, and what was skipped. Documents already in the corpus keep their
    place and new ones are appended (sorted by name), so adding a document re-prefills only it.

    `limits` (Settings: CAG_MAX_DOCUMENT_BYTES, CAG_MAX_CORPUS_BYTES; their defaults when None) are
    checked on the files' sizes before anything is read: a corpus too large to finish is refused at
    once, naming the file (or the total), the limit and the setting that raises it. `reporter.reading`
    hears how much is about to be read."""
    if not source.exists():
        raise NotFound(f"source missing: {source}")
    entries, skipped = documents.scan(source)
    if not entries:
        what = (
            f" (skipped unsupported: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''})" if skipped else ""
        )
        raise BadInput(f"no supported documents in {source}{what}; supported: {', '.join(sorted(documents.SUPPORTED))}")
    max_doc, max_corpus = input_limits(limits)
    for e in entries:
        if e.size > max_doc:
            raise documents.too_large(e.name, e.size, max_doc)
    total = sum(e.size for e in entries)
    if total > max_corpus:
        raise TooLarge(
            f"{source} holds {human_bytes(total)} in {len(entries)} documents; a corpus may be at most "
            f"{human_bytes(max_corpus)} (CAG_MAX_CORPUS_BYTES={max_corpus}): raise it, or ingest a part of it"
        )
    if (reading := getattr(reporter, "reading", None)) is not None:
        reading(len(entries), total)
    known = {d["path"]: d["ordinal"] for d in index.documents(corpus)} if corpus else {}
    entries.sort(key=lambda e: (e.name not in known, known.get(e.name, 0), e.name))
    docs = [documents.read(e, max_doc) for e in entries]
    empty = [d.name for d in docs if not d.text.strip()]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise BadInput(f"every document in {source} is empty")
    return docs, skipped + [f"{n} (empty)" for n in empty]


def input_limits(limits=None) -> tuple[int, int]:
    """(CAG_MAX_DOCUMENT_BYTES, CAG_MAX_CORPUS_BYTES) of `limits` (Settings), or their defaults."""
    from cag.config import Settings

    fields = Settings.model_fields
    return tuple(getattr(limits, k, None) or fields[k].default for k in ("max_document_bytes", "max_corpus_bytes"))
