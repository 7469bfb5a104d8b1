"""Pieces shared by every command module: options, error handling, output, progress."""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer

from cag.config import get_settings
from cag.errors import CagError
from cag.results import human_bytes

if TYPE_CHECKING:  # imported where used: `cag --help` imports none of them
    from tqdm import tqdm

    from cag.config import Settings
    from cag.store.index import Index
    from cag.store.sync import LocalOnly, Shared

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts).")]
StoreOpt = Annotated[
    str | None,
    typer.Option("--store", help="Shared snapshot store, s3://bucket/prefix (default: CAG_HOME only). Env: CAG_STORE."),
]
ModeOpt = Annotated[
    str,
    typer.Option(
        help="cag: from the snapshot; cag+rag: the snapshot, with the BM25 top-k passages quoted before the question; "
        "full: whole knowledge in the prompt, no cache; rag: BM25 top-k passages."
    ),
]
MaxTokensOpt = Annotated[int | None, typer.Option(help="Answer length limit in tokens (clamped to CAG_ANSWER_ROOM).")]
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", help="Model: the embedded default, a Hugging Face folder or hub id. Env: CAG_MODEL."),
]


def _engine(model: str | None = None, **overrides):
    """The engine of a command, with cag.rag's retriever for `rag` and `cag+rag` (cag.answering.retrieval)."""
    from cag.engine import Engine
    from cag.rag.index import retrieve

    return Engine(get_settings(model=model, **overrides), retrieval=retrieve)


def _catalog(model: str | None = None, **overrides) -> tuple[Settings, Index, Shared | LocalOnly]:
    """Settings, the index and the shared store: what commands read before (or instead of) loading a
    model, with no torch imported (a name or a setting is refused at once)."""
    from cag.store.index import Index
    from cag.store.sync import shared_store

    s = get_settings(model=model, **overrides)
    index = Index(s.index_path)
    return s, index, shared_store(s, index)


def require_corpus(index, remote, corpus: str) -> None:
    """NotFound for a corpus neither the index nor the shared store knows, before a model loads."""
    from cag.store.sync import known_corpus

    known_corpus(index, remote, corpus)


def require_mode(mode: str) -> None:
    from cag.errors import BadInput
    from cag.results import Mode, choices

    if mode not in {m.value for m in Mode}:  # the line questions.check would give, before the model loads
        raise BadInput(f"unknown mode {mode!r}; use one of {choices(Mode)}")


def announce_load(engine, quiet: bool = False):
    """One line on a terminal while the engine's model loads, whenever that happens (a first load of a
    large model takes a while: reading, fingerprinting, packing the weights). Returns the engine."""
    if quiet or not sys.stderr.isatty():
        return engine

    def line(took: float | None) -> None:
        if took is None:
            typer.echo(f"loading model {shown(engine.settings.model)} ...", err=True, nl=False)
        else:
            typer.echo(f" {took:.1f} s", err=True)

    engine.on_load = line
    return engine


def handle_errors(fn):
    """User errors become one line on stderr and a documented exit code, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CagError as e:
            # one line, whatever the message holds
            typer.echo("error: " + shown(" ".join(str(e).splitlines())), err=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None

    return wrapper


# C0 and C1 controls, DEL, line/paragraph separators and bidi overrides: a file name holding them
# could forge lines or rewrite the terminal. Escaped in human output; --json keeps the raw text.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def shown(text: object) -> str:
    """`text` for a terminal: control characters as Python escapes (a newline in a name is `\\n`)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


def _emit(obj: dict) -> None:
    typer.echo(json.dumps(obj, ensure_ascii=False))


_human_bytes = human_bytes  # one formatter for every size the project prints


def _age(ts: float | None) -> str:
    if not ts:
        return "never"
    s = time.time() - ts
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


class _TqdmReporter:
    """Estimate line and a tokens progress bar (tokens, tokens/s, ETA), drawn only on a terminal."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.bar: tqdm | None = None
        self.tok_bar: tqdm | None = None

    BIG = 1024**2  # inputs from this size on say what is read and show tokenizing

    def reading(self, n_documents: int, n_bytes: int) -> None:
        if not self.quiet and n_bytes >= self.BIG:
            typer.echo(f"reading {n_documents} document{'s' if n_documents != 1 else ''} ({_human_bytes(n_bytes)}), "
                       f"then tokenizing them", err=True)

    def tokenizing(self, n_chars: int):
        if self.quiet or n_chars < self.BIG:
            return None
        from tqdm import tqdm

        self.tok_bar = tqdm(total=n_chars, unit="char", unit_scale=True, desc="tokenize", file=sys.stderr,
                            disable=not sys.stderr.isatty(), dynamic_ncols=True)
        return self.tok_bar.update

    def tokenized(self) -> None:
        if self.tok_bar is not None:
            self.tok_bar.close()
            self.tok_bar = None

    def estimate(self, n_tokens: int, n_bytes: int, reused: int) -> None:
        if not self.quiet:
            extra = f", reusing {reused} cached tokens" if reused else ""
            typer.echo(f"knowledge: {n_tokens} tokens -> snapshot ~{_human_bytes(n_bytes)} "
                       f"(2 x layers x kv_heads x head_dim x bytes x tokens, a window layer's last W){extra}", err=True)

    def shards(self, shards: list[dict]) -> None:
        if not self.quiet and len(shards) > 1:
            sizes = ", ".join(f"{s['n_tokens']}" for s in shards)
            typer.echo(f"knowledge larger than one context: {len(shards)} shards of {sizes} tokens, "
                       f"~{_human_bytes(sum(s['bytes'] for s in shards))} in all", err=True)

    def progress(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="tok", unit_scale=True, desc="prefill", file=sys.stderr,
                        disable=self.quiet or not sys.stderr.isatty(), dynamic_ncols=True)
        return self.bar.update

    def done(self) -> None:
        if self.bar is not None:
            self.bar.close()


