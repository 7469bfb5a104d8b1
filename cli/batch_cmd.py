"""`cag ask NAME --questions-file FILE`: many questions on one corpus, decoded together.

Questions come one per line (blank lines and lines starting with # skipped) or as JSON lines with
a "question" field (and any other fields, e.g. an id, echoed back under "input"). Answers go out as
JSON lines in input order, each the answer JSON of `cag ask --json` plus "line" and "question"; a
question that fails gets {"line", "question", "error": {"message", "code", "exit_code"}} and the
others go on. Exit code: 0 when every question was answered, else the first failure's exit code.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from cag.cli.common import _emit
from cag.errors import BadInput, CagError, NotFound


def read_questions(path: str) -> list[tuple[int, str, dict | None]]:
    """(line number, question, the JSON object it came from or None)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read questions file {path}: {getattr(e, 'strerror', None) or e}") from None
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.startswith("{"):
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                raise BadInput(f"{path}:{no}: not valid JSON ({e.msg})") from None
            if not isinstance(obj.get("question"), str):
                raise BadInput(f"{path}:{no}: a JSON line needs a \"question\" string")
            out.append((no, obj["question"], obj))
        else:
            out.append((no, s, None))
    if not out:
        raise BadInput(f"no questions in {path}")
    return out


def ask_file(engine, corpus: str, path: str, options: dict) -> int:
    from tqdm import tqdm

    from cag.rag.answer import ask_many

    items = read_questions(path)
    if engine.index.corpus(corpus) is None:
        raise NotFound(f"unknown corpus {corpus!r}; `cag list` shows the known ones")
    t0, first_error, tokens, warnings = time.perf_counter(), 0, 0, {}
    bar = tqdm(total=len(items), unit="q", file=sys.stderr, disable=not sys.stderr.isatty(), dynamic_ncols=True)
    results = ask_many(engine, corpus, [q for _, q, _ in items], **options)
    for (no, question, obj), (_, a) in zip(items, results):
        row = {"line": no, "question": question} | ({"input": obj} if obj else {})
        if isinstance(a, CagError):
            first_error = first_error or a.exit_code
            row["error"] = {"message": str(a), "code": a.code, "exit_code": a.exit_code}
        else:
            row |= a.to_dict()
            tokens += a.completion_tokens
            warnings.update(dict.fromkeys(a.warnings))  # each once on stderr, every one in its row
        _emit(row)
        sys.stdout.flush()
        bar.update(1)
    bar.close()
    for w in warnings:
        typer.echo(f"warning: {' '.join(w.split())}", err=True)
    s = time.perf_counter() - t0
    stats = engine.stats
    batch = stats.get("decode_rows", 0) / max(1, stats.get("decode_steps", 0))
    failed = "; some failed (see their error field)" if first_error else ""
    typer.echo(f"{len(items)} questions in {s:.1f} s ({len(items) / s:.2f} q/s, {tokens / s:.1f} completion tok/s, "
               f"mean decode batch {batch:.1f}){failed}", err=True)
    return first_error
