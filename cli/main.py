"""The `cag` command line. Each command parses, calls the engine, prints; errors are one line.

Exit codes: 0 ok, 1 user error, 2 usage error, 3 stale corpus refused (--on-stale refuse),
4 busy (another ingest holds the corpus lock).
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from cag.cli.common import (
    JsonOpt,
    MaxTokensOpt,
    ModelOpt,
    ModeOpt,
    StoreOpt,
    _age,
    _catalog,
    _emit,
    _engine,
    _human_bytes,
    _TqdmReporter,
    announce_load,
    handle_errors,
    require_corpus,
    require_mode,
    shown,
)

app = typer.Typer(
    help="Cache-augmented generation: prefill a knowledge corpus once, answer questions from its KV snapshot.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

@app.command()
@handle_errors
def ingest(
    path: Annotated[
        str,
        typer.Argument(
            help="Folder (recursive) or file: .txt .md .html .pdf; or the name of a known corpus to refresh."
        ),
    ],
    name: Annotated[str | None, typer.Option(help="Corpus name (default: the folder or file name).")] = None,
    model: ModelOpt = None,
    force: Annotated[
        bool, typer.Option("--force", help="Rebuild from scratch even when a snapshot could be reused.")
    ] = False,
    ttl: Annotated[float | None, typer.Option(help="Seconds after which the snapshot counts as stale.")] = None,
    shard_tokens: Annotated[
        int | None,
        typer.Option(
            "--shard-tokens",
            help="Cap a shard's prompt at N tokens (default: what fits the context; 0 resets to that). Kept for "
            "refreshes.",
        ),
    ] = None,
    store: StoreOpt = None,
    json_: JsonOpt = False,
):
    """Prefill a corpus once and save its KV cache as a snapshot (incremental when documents changed)."""
    _, index, remote = _catalog(model, store=store)
    if not remote:  # a missing path or a bad name, at once (a shared store may know the name: the engine asks it)
        from cag.knowledge.corpus import resolve_source
        from cag.knowledge.names import check_corpus_name

        check_corpus_name(resolve_source(index, path, name)[0])
    engine = announce_load(_engine(model, store=store), quiet=json_)
    r = engine.ingest(
        path, name=name, force=force, ttl_s=ttl, reporter=_TqdmReporter(quiet=json_), shard_tokens=shard_tokens
    )
    if json_:
        _emit(r.to_dict())
        return
    for s in r.skipped:
        typer.echo(f"skipped: {shown(s)}", err=True)
    for w in r.warnings:
        typer.echo(f"warning: {shown(w)}", err=True)
    if r.status == "fresh":
        typer.echo(
            f"{shown(r.corpus)}: up to date (snapshot {r.snapshot[:12]}, {r.n_tokens} tokens, {r.n_documents} "
            "documents)"
        )
    else:
        tps = r.prefilled_tokens / (r.prefill_ms / 1e3) if r.prefill_ms else 0
        typer.echo(
            f"{shown(r.corpus)}: {r.status} snapshot {r.snapshot[:12]}: {r.n_documents} documents, {r.n_tokens} tokens "
            f"({r.reused_tokens} reused, {r.prefilled_tokens} prefilled in {r.prefill_ms / 1e3:.1f} s, {tps:.0f} "
            f"tok/s), {_human_bytes(r.bytes)}"
        )
    if r.n_shards > 1:
        for sh in r.shards:
            typer.echo(f"  shard {sh['shard']}: {sh['status']} {sh['snapshot'][:12]}, {sh['n_documents']} documents, "
                       f"{sh['n_tokens']} tokens, {_human_bytes(sh['bytes'])}")


@app.command()
@handle_errors
def ask(
    corpus: Annotated[str, typer.Argument(help="Corpus name (see `cag list`).")],
    question: Annotated[str | None, typer.Argument(help="The question (or --questions-file).")] = None,
    mode: ModeOpt = "cag",
    max_tokens: MaxTokensOpt = None,
    min_tokens: Annotated[
        int, typer.Option(help="No stop token before this many answer tokens (fixed-length answers, e.g. for timing).")
    ] = 0,
    k: Annotated[
        int | None, typer.Option(help="rag and cag+rag modes: passages to retrieve (default 3 for rag, 1 for cag+rag).")
    ] = None,
    retriever: Annotated[str, typer.Option(help="rag and cag+rag modes: bm25 or dense.")] = "bm25",
    on_stale: Annotated[str, typer.Option(help="serve (warn), refuse (exit 3) or refresh first.")] = "serve",
    stream: Annotated[bool, typer.Option("--stream", help="Print tokens as they are generated.")] = False,
    shards: Annotated[
        int,
        typer.Option(
            "--shards",
            help="Sharded corpora: answer from the S best shards (BM25 routing), keep the most confident answer.",
        ),
    ] = 1,
    questions_file: Annotated[
        str | None,
        typer.Option(
            "--questions-file",
            help='Answer every question of FILE (one per line, or JSON lines with a "question" field; - for stdin), '
            "decoded together in batches: JSON lines out, in input order.",
        ),
    ] = None,
    messages_file: Annotated[
        str | None,
        typer.Option(
            "--messages",
            help="Answer a conversation: FILE holds a JSON list of chat messages (system, user, assistant; the last "
            "one the user's question; - for stdin).",
        ),
    ] = None,
    model: ModelOpt = None,
    store: StoreOpt = None,
    json_: JsonOpt = False,
):
    """Answer a question from a corpus (or many, with --questions-file; or a conversation's last, with --messages)."""
    if (question is not None) + (questions_file is not None) + (messages_file is not None) != 1:
        raise typer.BadParameter(
            "give one of QUESTION, --questions-file FILE or --messages FILE", param_hint="QUESTION"
        )
    require_mode(mode)
    require_corpus(*_catalog(model, store=store)[1:], corpus)  # before torch is imported
    from cag.runtime.generate import DecodeConfig  # torch: imported when a command needs it, not at start

    engine = announce_load(_engine(model, store=store), quiet=json_)
    logging.getLogger("cag.index").addHandler(logging.NullHandler())  # its warnings come with the answer (a.warnings)
    decoding = DecodeConfig(min_tokens=min_tokens)
    if questions_file is not None:
        from cag.cli.batch_cmd import ask_file

        raise typer.Exit(
            ask_file(
                engine,
                corpus,
                questions_file,
                dict(
                    mode=mode,
                    max_tokens=max_tokens,
                    on_stale=on_stale,
                    k=k,
                    retriever=retriever,
                    shards=shards,
                    decoding=decoding,
                ),
            )
        )
    on_text = None
    if stream and not json_:
        def on_text(piece: str) -> None:
            typer.echo(piece, nl=False)
            sys.stdout.flush()
    from cag.answering.query import Query

    if mode == "cag" and shards != 1:
        n = len(engine.index.shards(corpus))
        if n and not 1 <= shards <= n:
            typer.echo(
                f"warning: --shards {shards} clamped to {max(1, min(shards, n))} ({corpus!r} has {n} shards)", err=True
            )

    messages = None
    if messages_file is not None:
        from cag.cli.chat_cmd import read_messages

        messages = read_messages(messages_file)
    a = engine.answer(Query(corpus, question, mode, max_tokens, on_stale, decoding, shards, messages, k=k,
                            retriever=retriever), on_text)
    if a.stale:
        typer.echo(f"warning: corpus {corpus!r} is stale: {shown('; '.join(a.stale_reasons))}", err=True)
    for w in a.warnings:  # e.g. a read-only index: the answer stands, its log was not written
        typer.echo(f"warning: {shown(w)}", err=True)
    if json_:
        _emit(a.to_dict())
        return
    if stream:
        typer.echo("")
    else:
        typer.echo(a.answer)
    typer.echo(f"[{a.mode}] prompt {a.prompt_tokens} tok ({a.cached_tokens} cached), answer {a.completion_tokens} tok; "
               f"load {a.load_ms:.0f} ms, ttft {a.ttft_ms:.0f} ms, total {a.total_ms:.0f} ms", err=True)


def _status_lines(s) -> list[str]:
    state = "STALE" if s.stale else "fresh"
    snap = s.snapshot[:12] if s.snapshot else "-"
    shards = f" in {s.n_shards} shards" if s.n_shards > 1 else ""
    lines = [f"{s.name}: {state}, snapshot {snap}, {s.n_documents} docs, {s.n_tokens} tokens{shards}, "
             f"{_human_bytes(s.bytes)}, model {s.model}, built {_age(s.created)}, last used {_age(s.last_used)}",
             f"  source: {s.source}"]
    lines += [f"  stale: {r}" for r in s.reasons]
    return [shown(line) for line in lines]  # a name with a newline cannot forge a line


def _statuses(model: str | None, corpus: str | None) -> list:
    """Each corpus's status (or one's), read from the index with the model's recorded fingerprints
    (cag.model.facts): no model loads, no torch is imported, unless this model was never loaded here."""
    from cag.knowledge import freshness
    from cag.model import facts as model_facts

    s, index, remote = _catalog(model)
    if corpus:
        require_corpus(index, remote, corpus)
    names = [corpus] if corpus else [r["name"] for r in index.corpora()]
    facts = model_facts.lookup(index, s) if names else None
    if names and facts is None:  # a model never loaded with these settings (or its files changed)
        engine = announce_load(_engine(model))
        facts = engine.facts()
    return [freshness.status(index, remote, s, name, facts) for name in names]


@app.command("list")
@handle_errors
def list_(model: ModelOpt = None, json_: JsonOpt = False):
    """List corpora with their snapshots, sizes, token counts, model and freshness (no model load)."""
    items = _statuses(model, None)
    if json_:
        _emit({"corpora": [s.to_dict() for s in items]})
        return
    if not items:
        typer.echo("no corpora yet: `cag ingest PATH`")
    for s in items:
        typer.echo(_status_lines(s)[0])


@app.command()
@handle_errors
def status(
    corpus: Annotated[str | None, typer.Argument(help="Corpus name; all corpora when omitted.")] = None,
    model: ModelOpt = None,
    json_: JsonOpt = False,
):
    """Freshness of one corpus (or all), with one line per reason it is stale (no model load)."""
    items = _statuses(model, corpus)
    if json_:
        _emit(items[0].to_dict() if corpus else {"corpora": [s.to_dict() for s in items]})
        return
    for s in items:
        typer.echo("\n".join(_status_lines(s)))


# Commands that live in their own modules register here (one line each).
from cag.cli.serve_cmd import serve  # noqa: E402

app.command()(serve)
from cag.cli.compare_cmd import compare  # noqa: E402

app.command()(compare)
from cag.cli.chat_cmd import chat  # noqa: E402
from cag.cli.info_cmd import info  # noqa: E402
from cag.cli.maintenance import gc, invalidate, reindex  # noqa: E402
from cag.cli.mcp_cmd import mcp  # noqa: E402

app.command()(chat)

app.command()(invalidate)
app.command()(gc)
app.command()(reindex)
app.command()(info)
app.command()(mcp)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
