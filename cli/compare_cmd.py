"""`cag compare`: CAG vs no-cache vs RAG on a QA dataset; writes results.jsonl, report.md, report.png.

Exit codes besides the common ones: 5 = the run stopped at --max-minutes before its plan was done
(incomplete, rows kept, --resume continues); 130 = interrupted by Ctrl-C (the same, by hand).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cag.cli.common import JsonOpt, ModelOpt, _emit, _engine, _TqdmReporter, handle_errors
from cag.errors import BadInput

INCOMPLETE = 5  # exit code: the run stopped before its plan was done; --resume continues it


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise BadInput(f"{what}: expected comma-separated whole numbers, got {text!r}") from None
    if not vals:
        raise BadInput(f"{what}: give at least one number")
    return vals


@handle_errors
def compare(
    dataset: Annotated[
        str,
        typer.Argument(
            help="squad or hotpot (the shared copies under ../shared/datasets, or $CAG_DATASETS), or a path: SQuAD "
            "JSON, HotpotQA JSON, or a jsonl of {question, answers, context | doc_ids}."
        ),
    ],
    format_: Annotated[
        str | None, typer.Option("--format", help="squad, hotpot or jsonl (guessed from DATASET when omitted).")
    ] = None,
    size_tokens: Annotated[
        str,
        typer.Option(
            "--size-tokens",
            help="Knowledge sizes in tokens, comma-separated; a size beyond the context is sharded CAG (routed to its "
            "best shard) and `full` is not asked there.",
        ),
    ] = "2000,4000,7000",
    questions: Annotated[
        int,
        typer.Option(
            "--questions",
            help="Questions per size (cag and rag at --k-main); a size whose set holds fewer pools sets of further "
            "seeds.",
        ),
    ] = 50,
    max_sets: Annotated[
        int,
        typer.Option(
            "--max-sets", help="Most knowledge sets pooled per size to reach --questions (each one is ingested)."
        ),
    ] = 10,
    full_sample: Annotated[
        int, typer.Option("--full-sample", help="Ask `full` (no cache) on the first N questions per size.")
    ] = 10,
    shard_tokens: Annotated[
        str | None,
        typer.Option(
            "--shard-tokens",
            help="Shard-size sweep, comma-separated token caps: each N > 0 adds the mode cag@N (every set ingested "
            "into shards of at most N tokens, routed like sharded cag, also where one snapshot fits); 0 = what fits, "
            "which is cag itself.",
        ),
    ] = None,
    modes: Annotated[
        str,
        typer.Option(
            "--modes", help="Comma-separated: cag, full, rag-bm25, rag-dense (dense needs the `dense` extra), cag+rag."
        ),
    ] = "cag,full,rag-bm25",
    k: Annotated[str, typer.Option("--k", help="RAG passages for the k sweep, comma-separated.")] = "1,3,5",
    k_main: Annotated[int, typer.Option("--k-main", help="RAG passages on every question.")] = 3,
    k_sample: Annotated[
        int, typer.Option("--k-sample", help="Run the k sweep on the first N questions per size.")
    ] = 10,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Answer length limit, the same for every mode.")] = 32,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the document order and the question draw.")] = 0,
    out: Annotated[Path | None, typer.Option("--out", help="Output folder (default: ./compare-<dataset>).")] = None,
    corpora: Annotated[
        Path | None,
        typer.Option("--corpora", help="Where each set's documents are written for ingest (default: OUT/corpora)."),
    ] = None,
    docs: Annotated[
        Path | None,
        typer.Option("--docs", help="jsonl format: the documents folder (default: docs/ next to the file)."),
    ] = None,
    batch: Annotated[
        int,
        typer.Option(
            "--batch",
            help="Answer cag rows N at a time, decoded together (cag ask --questions-file's batching): faster; their "
            "latency is then under shared load (said in the report). 1 = each alone.",
        ),
    ] = 1,
    max_minutes: Annotated[
        float | None,
        typer.Option(
            "--max-minutes",
            help="Stop asking after this many minutes (like Ctrl-C: rows kept, report written, exit code 5, --resume "
            "continues).",
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue a run in OUT: rows already in results.jsonl are skipped.")
    ] = False,
    model: ModelOpt = None,
    json_: JsonOpt = False,
):
    """Compare CAG, no-cache (full) and RAG on a QA dataset: quality and latency per knowledge size (sharded CAG beyond the context).

    Writes OUT/results.jsonl (one row per question, mode, size and k, appended as it goes: Ctrl-C keeps what is done, --resume continues), OUT/report.md and OUT/report.png. Exits 5 when --max-minutes stops the run before it is complete, 130 on Ctrl-C.
    """  # noqa: E501 (help text: its line breaks show)
    from cag.compare.results import read_rows
    from cag.compare.runner import CompareConfig, run_compare
    from cag.compare.stats import summary

    label = Path(dataset).stem.split(".")[0] if Path(dataset).exists() else dataset.lower()
    cfg = CompareConfig(
        dataset=dataset,
        format=format_,
        sizes=_ints(size_tokens, "--size-tokens"),
        questions=questions,
        max_sets=max_sets,
        full_sample=full_sample,
        modes=[m.strip() for m in modes.split(",") if m.strip()],
        ks=_ints(k, "--k"),
        k_main=k_main,
        k_sample=k_sample,
        max_tokens=max_tokens,
        seed=seed,
        out=out or Path(f"compare-{label}"),
        resume=resume,
        max_minutes=max_minutes,
        batch=batch,
        corpora=corpora,
        docs=docs,
        shard_tokens=_ints(shard_tokens, "--shard-tokens") if shard_tokens is not None else [],
    )
    cfg.validate()
    engine = _engine(model)

    def log(msg: str) -> None:
        if not json_:
            typer.echo(msg, err=True)

    result = run_compare(engine, cfg, log=log, reporter_factory=lambda: _TqdmReporter(quiet=json_))
    if json_:
        rows = read_rows(result.results_path)
        _emit({"out": str(result.out), "results": str(result.results_path), "report": str(result.out / "report.md"),
               "png": str(result.out / "report.png"), "rows_written": result.rows_written,
               "rows_total": result.rows_total, "stopped": result.stopped, "notes": result.notes,
               "complete": result.complete, "sets": [s.record() for s in result.sets],
               "summary": summary(rows, cfg.k_main)})
    else:
        typer.echo(f"{result.rows_written} new rows ({result.rows_total} in all) in {result.results_path}")
        typer.echo(f"report: {result.out / 'report.md'}, {result.out / 'report.png'}")
        if result.stopped:
            typer.echo(f"{result.stopped}: run again with --resume to continue", err=True)
    if result.interrupted:
        raise typer.Exit(130)
    if not result.complete:
        raise typer.Exit(INCOMPLETE)
