"""report.md (and, through compare.plot, report.png) from the files of a compare run.

Everything is recomputed from the rows (compare.stats), so a report can be rebuilt from a run
folder alone (`rebuild`), and an interrupted run still gets a report of what it finished.
Each size's sets are read together: a size may pool several sets (further seeds) to reach the
questions asked, and every set's real prefix is listed. A set larger than the context is sharded
CAG (its shards listed, `full` said to be not asked); the shard-size sweep (`cag@N`) and routing
recall get a section of their own, next to RAG. The tables are built in compare.report_sets (the
knowledge sets), compare.report_tables (the results per mode) and compare.report_cells (their cells).
"""

from __future__ import annotations

import json
from pathlib import Path

from .plot import render_png
from .report_sets import sets_table
from .report_tables import overview, sharding_section, size_section
from .results import Row, read_run, sizes_run
from .stats import CI_LEVEL, N_RESAMPLES, group, mismatches


def _settings(meta: dict) -> list[str]:
    k_main = meta.get("k_main")
    dec = meta.get("decode", {})
    machine, versions = meta.get("machine", {}), meta.get("versions", {})
    stops = ", ".join(f"`{t}`" for t in dec.get("stop_tokens", []))
    resumed = meta.get("resumed") or []
    lines = [
        (
            f"model: `{meta.get('model')}`, fingerprint `{meta.get('model_fingerprint')}`; tokenizer "
            f"`{meta.get('tokenizer_fingerprint')}`; context {meta.get('max_context')} tokens; weights "
            f"{meta.get('compute_dtype')}, snapshot KV {meta.get('kv_dtype')}"
        ),
        (
            f"decoding (every mode): {dec.get('strategy')}, temperature {dec.get('temperature')}, max "
            f"{dec.get('max_tokens')} new tokens, stop tokens {stops}; the same instruction and chat layout, only the "
            "knowledge differs"
        ),
        f'instruction: "{meta.get("instruction")}"',
        (
            f"knowledge sizes: {', '.join(map(str, meta.get('sizes', [])))} tokens of documents as laid out in the "
            "prompt (with their `<document name=...>` delimiters); whole documents, seeded order (seed "
            f"{meta.get('seed')}), never truncated; each set's real prefix below"
        ),
        (
            f"questions: {meta.get('questions')} asked per size for cag and rag (k={k_main}); a size whose set holds "
            "fewer pools sets of the further seeds, each adding questions not yet drawn (max sets per size: "
            f"{meta.get('max_sets', 1)}); full on the first {meta.get('full_sample')} questions of each size; k sweep "
            f"{meta.get('ks')} on the first {meta.get('k_sample')}"
        ),
        (
            f"RAG: passages of at most {meta.get('passage_tokens')} tokens (model tokenizer, overlap "
            f"{meta.get('passage_overlap')}), cut at paragraph/line/sentence/word boundaries; BM25 "
            f"{json.dumps(meta.get('bm25'))}; dense: {meta.get('dense')}; retrieved passages go into the prompt in "
            "corpus order, named `<document>#<passage index>`"
        ),
        (
            "sharding: a set whose prefix plus the "
            f"{(meta.get('question_room') or 0) + (meta.get('answer_room') or 0)} tokens kept for question and answer "
            "exceeds the context is sharded CAG: ingested into shards that each fit (whole documents, long ones cut "
            "at paragraphs), every question routed by BM25 over the shards' text to the best shard, answered from "
            "that shard's snapshot; `full` is not asked there (no single prompt holds the set). Shard-size sweep "
            f"{', '.join(str(n) for n in meta.get('shard_tokens') or []) or '(none)'}: `cag@N` = the same set ingested "
            "into shards of at most N tokens (also where one snapshot fits), asked like cag; 0 (what fits) is `cag` "
            "itself. Routing recall@1 shard = share of the question's gold documents (as RAG's recall@k counts them) "
            "in the shard that answered; @2 shards = in the 2 best shards by routing (routing only, no generation)"
        ),
        (
            "cag+rag: the snapshot (a sharded set: the shard holding most of the retrieved passages) with the BM25 "
            "top-k passages quoted in the question's message; "
            + ("each passage's quote was prefilled after its shard before its set's first question and kept "
               "(CAG_WARM_QUOTES, cost in the sets table), so a question quoting it first prefilled only its own tokens"
               if meta.get("warm_quotes") else "quotes prefilled with each question (CAG_WARM_QUOTES off)")
        ),
        f"dataset file: `{meta.get('dataset_path')}`",
        (
            f"machine: {machine.get('platform')}, {machine.get('cpus')} CPUs, torch threads "
            f"{machine.get('torch_threads')}; torch {versions.get('torch')}, transformers "
            f"{versions.get('transformers')}; started {meta.get('started')}"
            + "".join(f", resumed {r.get('at')} (load {r.get('load_average')})" for r in resumed)
            + f", finished {meta.get('finished', '–')}; load average (1/5/15 min) {meta.get('load_average_start')} at "
            f"the start, {meta.get('load_average_end')} at the end (above the core count = the machine was shared and "
            "latencies are inflated)"
        ),
        (
            "TTFT counts from the call to the first generated token: cag includes loading the snapshot (memory-mapped, "
            "resident after the first question), full includes prefilling the whole set, rag includes reading the "
            "files, retrieval and prefilling the passages. One unrecorded warm-up question runs before the first "
            "recorded one."
        ),
        (
            "quality: EM and F1 as the SQuAD v1.1 script; F1 first sentence = F1 of the answer's first sentence "
            'only (the stricter reading: a hedge such as "1952, while ... 1953" costs precision there); answer '
            "in output = a normalized gold appears anywhere in the answer (lenient). Every cell: the value, then its "
            f"{CI_LEVEL:.0%} percentile-bootstrap interval over questions ({N_RESAMPLES} resamples, fixed seed; none "
            "when n = 1); n counts questions answered without error."
        ),
    ]
    if "shard_tokens" not in meta:  # a run from before sharded sets: every set was one snapshot
        lines = [line for line in lines if not line.startswith("sharding:")]
    return lines


def render_markdown(rows: list[Row], meta: dict, sets: list[dict], notes: list[str] | None = None,
                    stopped: str | None = None) -> str:
    k_main = meta.get("k_main")
    g = group(rows)
    L = [f"# cag compare: {meta.get('format')} ({meta.get('dataset')})", ""]
    if stopped:
        L += [f"**Incomplete run ({stopped}): these tables cover the rows finished so far; `--resume` continues.**",
              ""]
    L += ["## Settings", "", *(f"- {line}" for line in _settings(meta)), ""]
    for note in notes or []:
        L += [f"> {note}", ""]
    n_pairs, bad = mismatches(rows)
    if n_pairs:
        if bad:
            L += [f"**full vs cag: {len(bad)} of {n_pairs} answers differ (they must be identical):**", ""]
            L += [f"- {b['set']} {b['qid']}: cag {b['cag']!r} / full {b['full']!r}" for b in bad]
        else:
            L += ["full vs cag: the one answer asked in both modes is identical." if n_pairs == 1 else
                  f"full vs cag: all {n_pairs} answers asked in both modes are identical."]
        L += [""]
    L += sets_table(sets, meta.get("questions"))
    L += overview(g, sets, k_main)
    L += sharding_section(g, rows, sets, k_main)
    for size in sizes_run(sets):
        L += size_section(size, g, rows, sets, k_main)
    return "\n".join(L).rstrip() + "\n"


def write_report(out: Path, rows: list[Row], meta: dict, sets: list[dict], notes: list[str] | None = None,
                 stopped: str | None = None) -> tuple[Path, Path]:
    out = Path(out)
    md = out / "report.md"
    md.write_text(render_markdown(rows, meta, sets, notes, stopped), encoding="utf-8")
    png = out / "report.png"
    render_png(rows, meta, sets, png)
    return md, png


def rebuild(out: Path) -> tuple[Path, Path]:
    """Re-render report.md/report.png of a finished (or stopped) run from its files alone."""
    meta, sets, rows = read_run(out)
    return write_report(out, rows, meta, sets, meta.get("notes"), meta.get("stopped"))
