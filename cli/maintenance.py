"""`cag invalidate`, `cag gc`, `cag reindex`: index upkeep commands (no model needed).

Only the typer layer: options, their checks, and printing; what the commands do is cag.knowledge.upkeep's."""

from __future__ import annotations

from typing import Annotated

import typer

from cag.config import get_settings
from cag.errors import BadInput

from .common import JsonOpt, StoreOpt, _emit, _human_bytes, handle_errors, shown


def _index_and_settings(store: str | None = None):
    # sqlite-utils (and torch, via cag.knowledge.upkeep) load per command, not at start-up
    from cag.store.index import Index

    s = get_settings(store=store)
    return s, Index(s.index_path)


@handle_errors
def invalidate(
    corpus: Annotated[
        str | None, typer.Argument(help="Corpus to mark invalid (all corpora with --doc when omitted).")
    ] = None,
    doc: Annotated[
        str | None,
        typer.Option(
            "--doc", help="Only corpora whose snapshot contains this document (path relative to the corpus root)."
        ),
    ] = None,
    json_: JsonOpt = False,
):
    """Mark a corpus (or the snapshots containing a document) invalid; `ask --on-stale` decides what happens next."""
    if corpus is None and doc is None:
        raise typer.BadParameter("give a corpus name, --doc PATH, or both")
    from cag.knowledge import upkeep

    _, index = _index_and_settings()
    marked = upkeep.invalidate(index, corpus, doc)
    if json_:
        _emit({"invalidated": marked})
    else:
        typer.echo(shown(f"invalidated: {', '.join(marked)}"))


@handle_errors
def gc(
    max_bytes: Annotated[
        int | None,
        typer.Option("--max-bytes", help="Keep snapshots within this many bytes, deleting least recently used first."),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only print what would be deleted.")] = False,
    include_current: Annotated[
        bool, typer.Option("--include-current", help="Allow deleting a corpus's current snapshot to meet --max-bytes.")
    ] = False,
    store: StoreOpt = None,
    json_: JsonOpt = False,
):
    """Delete snapshots no corpus uses, corrupt ones and leftover temp files, then LRU ones over --max-bytes."""
    if max_bytes is not None and max_bytes < 0:
        raise BadInput(f"--max-bytes must be 0 or more, got {max_bytes}")
    from cag.knowledge import upkeep

    settings, index = _index_and_settings(store)
    r = upkeep.gc(settings, index, max_bytes=max_bytes, dry_run=dry_run, include_current=include_current)
    if json_:
        _emit(r.to_dict())
        return
    verb = "would delete" if dry_run else "deleted"
    for d in r.deleted:
        typer.echo(shown(f"{verb} {_label(d)} ({d['corpus'] or '-'}, {_human_bytes(d['bytes'])}): {d['why']}"))
    for d in r.kept:
        typer.echo(shown(f"kept {_label(d)} ({d['corpus'] or '-'}, {_human_bytes(d['bytes'])}): {d['why']}"))
    typer.echo(
        f"{'would free' if dry_run else 'freed'} {_human_bytes(r.freed_bytes)}; kept {_human_bytes(r.kept_bytes)}"
    )


def _label(d: dict) -> str:
    """Snapshots by short digest; files that are not in the index by their whole name."""
    return d["digest"][:12] if d["corpus"] else d["digest"]


@handle_errors
def reindex(store: StoreOpt = None, json_: JsonOpt = False):
    """Rebuild the snapshot index from the snapshot files' own headers and, with a shared store, its refs."""
    from cag.knowledge import upkeep

    settings, index = _index_and_settings(store)
    r = upkeep.reindex(settings, index)
    if json_:
        _emit(r)
        return
    typer.echo(shown(f"indexed {r['snapshots']} snapshots for corpora: {', '.join(r['corpora']) or '-'}"))
    for name in r["unreadable"]:
        typer.echo(shown(f"unreadable, skipped: {name}"), err=True)
    for ref in r.get("store_refused", []):  # the sound refs are adopted all the same: exit 0, as for unreadable files
        typer.echo(shown(f"store ref refused, not adopted: {ref['why']}"), err=True)
