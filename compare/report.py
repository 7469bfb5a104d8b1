"""report.md (and, through compare.plot, report.png) from the files of a compare run.

Everything is recomputed from the rows (compare.stats), so a report can be rebuilt from a run
folder alone (`rebuild`), and an interrupted run still gets a report of what it finished.
Each size's sets are read together: a size may pool several sets (further seeds) to reach the
questions asked, and every set's real prefix is listed. A set larger than the context is sharded
CAG (its shards listed, `full` said to be not asked); the shard-size sweep (`cag@N`) and routing
recall get a section of their own, next to RAG.
"""

from __future__ import annotations

import json
from pathlib import Path

from cag.results import human_bytes

from .plot import render_png
from .results import Row, label, prefix_range, read_run, ready_sets, set_snapshots, shard_cap, shards_text, sizes_run
from .stats import CI_LEVEL, N_RESAMPLES, Estimate, bootstrap, group, mismatches, mode_sort_key, paired_vs_cag, retrieves, stats


def _estimate(e: Estimate | None, value) -> str:
    """A statistic as `value [lo, hi]` (the interval only when there is one), `–` for none."""
    if e is None:
        return "–"
    return value(e.value) if e.lo is None else f"{value(e.value)} [{value(e.lo)}, {value(e.hi)}]"


def _num(e: Estimate | None, digits: int = 3) -> str:
    return _estimate(e, lambda v: f"{v:.{digits}f}")


def _diff(e: Estimate | None) -> str:
    return _estimate(e, lambda v: f"{v:+.3f}")


def _ms_value(v: float) -> str:
    return f"{v / 1e3:.2f} s" if v >= 1000 else f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def _ms(e: Estimate | None) -> str:
    return _estimate(e, _ms_value)


def _ratio(e: Estimate | None) -> str:  # `1.23x [1.10, 1.40]`: the x once, on the value
    if e is None:
        return "–"
    return f"{e.value:.2f}x" + ("" if e.lo is None else f" [{e.lo:.2f}, {e.hi:.2f}]")


TABLE_HEAD = ("| mode | n | EM | F1 | F1 first sentence | answer in output | TTFT median | TTFT p95 "
              "| total median | total p95 | retrieval median | recall@k | routing recall@1 shard "
              "| routing recall@2 shards | prompt tokens (median) |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _table_row(name: str, s: dict) -> str:
    n = f"{s['n']}" + (f" ({s['errors']} errors)" if s["errors"] else "")
    pt = "–" if not s["prompt_tokens"] else f"{s['prompt_tokens'].value:.0f}"
    return (f"| {name} | {n} | {_num(s['em'])} | {_num(s['f1'])} | {_num(s['f1_first'])} | {_num(s['aio'])} "
            f"| {_ms(s['ttft'])} | {_ms(s['ttft_p95'])} | {_ms(s['total'])} | {_ms(s['total_p95'])} "
            f"| {_ms(s['retrieval'])} | {_num(s.get('recall'), 2)} | {_num(s.get('route1'), 2)} "
            f"| {_num(s.get('route2'), 2)} | {pt} |")


def _settings(meta: dict) -> list[str]:
    k_main = meta.get("k_main")
    dec = meta.get("decode", {})
    machine, versions = meta.get("machine", {}), meta.get("versions", {})
    stops = ", ".join(f"`{t}`" for t in dec.get("stop_tokens", []))
    resumed = meta.get("resumed") or []
    lines = [
        (f"model: `{meta.get('model')}`, fingerprint `{meta.get('model_fingerprint')}`; tokenizer "
         f"`{meta.get('tokenizer_fingerprint')}`; context {meta.get('max_context')} tokens; weights "
         f"{meta.get('compute_dtype')}, snapshot KV {meta.get('kv_dtype')}"),
        (f"decoding (every mode): {dec.get('strategy')}, temperature {dec.get('temperature')}, max "
         f"{dec.get('max_tokens')} new tokens, stop tokens {stops}; the same instruction and chat layout, "
         "only the knowledge differs"),
        f"instruction: \"{meta.get('instruction')}\"",
        (f"knowledge sizes: {', '.join(map(str, meta.get('sizes', [])))} tokens of documents as laid out in "
         f"the prompt (with their `<document name=...>` delimiters); whole documents, seeded order "
         f"(seed {meta.get('seed')}), never truncated; each set's real prefix below"),
        (f"questions: {meta.get('questions')} asked per size for cag and rag (k={k_main}); a size whose set "
         f"holds fewer pools sets of the further seeds, each adding questions not yet drawn (max sets per "
         f"size: {meta.get('max_sets', 1)}); full on the first {meta.get('full_sample')} questions of each size; "
         f"k sweep {meta.get('ks')} on the first {meta.get('k_sample')}"),
        (f"RAG: passages of at most {meta.get('passage_tokens')} tokens (model tokenizer, overlap "
         f"{meta.get('passage_overlap')}), cut at paragraph/line/sentence/word boundaries; BM25 "
         f"{json.dumps(meta.get('bm25'))}; dense: {meta.get('dense')}; retrieved passages go into the prompt in "
         "corpus order, named `<document>#<passage index>`"),
        (f"sharding: a set whose prefix plus the {(meta.get('question_room') or 0) + (meta.get('answer_room') or 0)} tokens "
         "kept for question and answer exceeds the context is sharded CAG: ingested into shards that each fit "
         "(whole documents, long ones cut at paragraphs), every question routed by BM25 over the shards' text to "
         "the best shard, answered from that shard's snapshot; `full` is not asked there (no single prompt holds "
         "the set). Shard-size sweep "
         f"{', '.join(str(n) for n in meta.get('shard_tokens') or []) or '(none)'}: `cag@N` = the same set "
         "ingested into shards of at most N tokens (also where one snapshot fits), asked like cag; 0 (what fits) "
         "is `cag` itself. Routing recall@1 shard = share of the question's gold documents (as RAG's recall@k "
         "counts them) in the shard that answered; @2 shards = in the 2 best shards by routing (routing only, "
         "no generation)"),
        f"dataset file: `{meta.get('dataset_path')}`",
        (f"machine: {machine.get('platform')}, {machine.get('cpus')} CPUs, torch threads "
         f"{machine.get('torch_threads')}; torch {versions.get('torch')}, transformers "
         f"{versions.get('transformers')}; started {meta.get('started')}"
         + "".join(f", resumed {r.get('at')} (load {r.get('load_average')})" for r in resumed)
         + f", finished {meta.get('finished', '–')}; load average (1/5/15 min) {meta.get('load_average_start')} "
         f"at the start, {meta.get('load_average_end')} at the end (above the core count = the machine was "
         "shared and latencies are inflated)"),
        ("TTFT counts from the call to the first generated token: cag includes loading the snapshot "
         "(memory-mapped, resident after the first question), full includes prefilling the whole set, "
         "rag includes reading the files, retrieval and prefilling the passages. One unrecorded warm-up "
         "question runs before the first recorded one."),
        (f"quality: EM and F1 as the SQuAD v1.1 script; F1 first sentence = F1 of the answer's first sentence "
         "only (the stricter reading: a hedge such as \"1952, while ... 1953\" costs precision there); answer "
         "in output = a normalized gold appears anywhere in the answer (lenient). Every cell: the value, then "
         f"its {CI_LEVEL:.0%} percentile-bootstrap interval over questions ({N_RESAMPLES} resamples, fixed "
         "seed; none when n = 1); n counts questions answered without error."),
    ]
    if "shard_tokens" not in meta:  # a run from before sharded sets: every set was one snapshot
        lines = [line for line in lines if not line.startswith("sharding:")]
    return lines


def _reused(snaps: list[dict]) -> str:
    """" (reused)" when every snapshot existed already, " (2 of 9 shards reused)" when some did."""
    n = sum(x.get("status") == "fresh" for x in snaps)
    if not n:
        return ""
    return " (reused)" if n == len(snaps) else f" ({n} of {len(snaps)} shards reused)"


def _sets_table(sets: list[dict], asked: int | None) -> list[str]:
    L = ["## Knowledge sets", "",
         "| size | set | documents | document tokens | real prefix | questions | cag prefill | snapshot "
         "| cag shards | rag index |",
         "|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for s in sets:
        if s.get("skipped"):
            L += [f"| {s['size']} | {s['name']} | {s.get('n_documents') or '–'} | {s.get('doc_tokens') or '–'} "
                  f"| {s.get('prefix_tokens') or '–'} | – | skipped: {s['skipped']} | | | |"]
            continue
        snaps = set_snapshots(s)
        prefill = sum(x.get("prefill_ms") or 0 for x in snaps)
        reused = _reused(snaps)
        size_b = sum(x.get("bytes") or 0 for x in snaps)
        snap = (human_bytes(size_b) + (f" in {len(snaps)} snapshots" if len(snaps) > 1 else "")) if snaps else "–"
        rag = "; ".join(f"{m} {v['build_ms']:.0f} ms, {v['n_passages']} passages"
                        for m, v in (s.get("rag_index") or {}).items()) or "–"
        shards = shards_text(snaps)
        if len(snaps) > 1 and s.get("router_ms") is not None:
            shards += f"; router {s['router_ms']:.0f} ms"
        for mode, why in (s.get("skipped_modes") or {}).items():
            if shard_cap(mode) is None:  # a sweep variant's skip is in the sweep's table
                shards += f"; {mode} not asked: {why}"
        L += [f"| {s['size']} | {s['name']} | {s['n_documents']} | {s['doc_tokens']:,} | {s['prefix_tokens']:,} "
              f"| {s['n_questions']} | {prefill / 1e3:.1f} s{reused} | {snap} | {shards} "
              f"| {rag} |"]
    L += ["", "Real prefix = the tokens of the knowledge prefix the engine builds (chat template head, documents "
          "with their delimiters, template middle); sets of one nominal size differ. cag prefill and snapshot "
          "are the one-time cost of each set ((reused) = a snapshot with the same key existed already, e.g. from "
          "an earlier run or an identical shard, its build time shown); cag "
          "shards: 1 when the set fits the context, else the shards (tokens each) and the time to build their "
          "router."]
    variants = [(s, m, v) for s in ready_sets(sets) for m, v in (s.get("variants") or {}).items()]
    if variants:
        L += ["", "Shard-size sweep ingests (the same sets, shards of at most N tokens):", "",
              "| size | set | mode | shards | prefill | snapshots |", "|---:|---|---|---|---:|---:|"]
        for s, m, v in variants:
            if v.get("skipped"):
                L += [f"| {s['size']} | {s['name']} | {m} | skipped: {v['skipped']} | | |"]
                continue
            snaps = v.get("snapshots") or []
            prefill = sum(x.get("prefill_ms") or 0 for x in snaps)
            reused = _reused(snaps)
            L += [f"| {s['size']} | {s['name']} | {m} | {shards_text(snaps)} "
                  f"| {prefill / 1e3:.1f} s{reused} "
                  f"| {human_bytes(sum(x.get('bytes') or 0 for x in snaps))} |"]
    if asked:
        for size in dict.fromkeys(s["size"] for s in sets):
            got = sum(s["n_questions"] for s in ready_sets(sets) if s["size"] == size)
            n_sets = len([s for s in ready_sets(sets) if s["size"] == size])
            if got < asked:
                L += ["", f"**Size {size}: {got} of the {asked} questions asked** "
                          f"({n_sets} set{'s' if n_sets != 1 else ''} pooled)."]
    return L + [""]


def _not_asked(sets: list[dict], size: int, mode: str) -> bool:
    """Every set of the size skipped this mode (e.g. `full` beyond the context)."""
    ready = [s for s in ready_sets(sets) if s["size"] == size]
    return bool(ready) and all(mode in (s.get("skipped_modes") or {}) for s in ready)


def _sharded(sets: list[dict], size: int, mode: str = "cag") -> bool:
    return any(len(set_snapshots(s, mode)) > 1 for s in ready_sets(sets) if s["size"] == size)


def _overview(g: dict, sets: list[dict], k_main) -> list[str]:
    sizes = sizes_run(sets)
    L = ["## Overview (F1 / median TTFT, n questions)", "",
         ("`full` is asked on a sample only: its answers must equal `cag`'s (checked above), so its quality "
          "columns describe that sample; compare quality between cag and rag, latency across all modes."), ""]
    mode_keys = sorted({(m, k) for (_, m, k) in g if k is None or k == k_main}, key=lambda mk: mode_sort_key(*mk))
    L += ["| mode | " + " | ".join(f"{size} (prefix {prefix_range(sets, size)})" for size in sizes) + " |",
          "|---|" + "---:|" * len(sizes)]
    for m, k in mode_keys:
        cells = []
        for size in sizes:
            rs = g.get((size, m, k))
            if not rs:
                cells.append(("not asked (beyond the context)" if m == "full" else "not asked")
                             if _not_asked(sets, size, m) else "–")
                continue
            st = stats(rs)
            cells.append(f"{_num(st['f1'], 2)} / {_ms(st['ttft'])} (n={st['n']})")
        L += [f"| {label(m, k)} | " + " | ".join(cells) + " |"]
    return L + [""]


def _size_section(size: int, g: dict, rows: list[Row], sets: list[dict], k_main) -> list[str]:
    names = [s["name"] for s in ready_sets(sets) if s["size"] == size]
    L = [f"## Size {size}", "", f"Sets: {', '.join(names)}; real prefix {prefix_range(sets, size)} tokens.", ""]
    if _sharded(sets, size):
        shards = "; ".join(shards_text(set_snapshots(s)) for s in ready_sets(sets) if s["size"] == size)
        L += [f"Beyond the context: **cag is sharded CAG** here (shards: {shards}), each question answered from "
              "the shard the router chose.", ""]
    skipped: dict[tuple, list[str]] = {}
    for s in ready_sets(sets):
        if s["size"] == size:
            for m, why in (s.get("skipped_modes") or {}).items():
                skipped.setdefault((m, why), []).append(s["name"])
    L += [f"- {m} not asked on {', '.join(names)}: {why}." for (m, why), names in skipped.items()]
    if skipped:
        L += [""]
    L += [TABLE_HEAD]
    items = sorted(((key, rs) for key, rs in g.items() if key[0] == size), key=lambda it: mode_sort_key(*it[0][1:]))
    main = [(key, rs) for key, rs in items if key[2] is None or key[2] == k_main]
    for (_, m, k), rs in main:
        L += [_table_row(label(m, k), stats(rs))]
    L += [""]
    size_rows = [r for r in rows if r.size == size]
    paired = [p for p in paired_vs_cag(size_rows) if p["k"] is None or p["k"] == k_main]
    if paired:
        L += ["Paired against cag on the same questions (mean of per-question differences, mode − cag; TTFT: "
              "median of per-question ratios, mode / cag):", "",
              "| mode | questions in both | ΔF1 | ΔF1 first sentence | Δanswer in output | TTFT ratio |",
              "|---|---:|---:|---:|---:|---:|"]
        L += [f"| {label(p['mode'], p['k'])} | {p['n']} | {_diff(p['f1'])} | {_diff(p['f1_first'])} "
              f"| {_diff(p['aio'])} | {_ratio(p['ttft_ratio'])} |" for p in paired]
        L += [""]
    for (_, m, k), rs in main:
        st = stats(rs)
        if retrieves(m) and st.get("recall") is not None:
            L += [(f"- {label(m, k)}: gold document(s) all retrieved for {st['hit_rate']:.0%} of questions "
                   f"(missed {st['n_miss']}); F1 {_num(st['f1_hit'], 2)} when retrieved, "
                   f"{_num(st['f1_miss'], 2)} when missed.")]
        if st.get("route1") is not None:
            L += [(f"- {label(m, k)}: gold document(s) all in the shard that answered for {st['route_hit_rate']:.0%} "
                   f"of questions (missed {st['route_n_miss']}); F1 {_num(st['route_f1_hit'], 2)} when routed to "
                   f"them, {_num(st['route_f1_miss'], 2)} when not; routing median {_ms(st['routing'])}.")]
    # k sweep on its sample, next to cag on the same questions.
    sweep = [(key, rs) for key, rs in items if retrieves(key[1]) and key[2] not in (None, k_main)]
    if sweep:
        qids = {(r.set, r.qid) for _, rs in sweep for r in rs}
        L += ["", f"k sweep on the first {len(qids)} questions (cag and full on the same questions for reference):",
              "", TABLE_HEAD]
        for (_, m, k), rs in items:
            sub = [r for r in rs if (r.set, r.qid) in qids]
            if sub:
                L += [_table_row(label(m, k), stats(sub))]
    return L + [""]


def _sharding_section(g: dict, rows: list[Row], sets: list[dict], k_main) -> list[str]:
    """Sharded CAG against plain cag and RAG, per size: shards, quality, TTFT, routing recall next to
    RAG's recall@k, and the paired difference against RAG on the same questions. Only when a run has
    sharded sets or a shard-size sweep."""
    sizes = sizes_run(sets)
    cag_modes = sorted({m for (_, m, _) in g if shard_cap(m) is not None}, key=lambda m: mode_sort_key(m, None))
    if not any(m != "cag" for m in cag_modes) and not any(_sharded(sets, size) for size in sizes):
        return []
    rag_keys = sorted({(m, k) for (_, m, k) in g if retrieves(m) and k == k_main},
                      key=lambda mk: mode_sort_key(*mk))
    L = ["## Sharded CAG: shard size, routing recall, RAG", "",
         ("Per size: plain cag (one snapshot where the set fits the context, shards that fit it beyond), the "
          "shard-size sweep cag@N, and RAG at k = the main k. Routing recall@1 shard / @2 shards (sharded "
          "corpora only) sits next to RAG's recall@k: the share of the gold documents the model could read. "
          "Against the RAG row, paired on the same questions: mean ΔF1 first sentence (mode − RAG) and "
          "median TTFT ratio (mode / RAG; below 1: faster than RAG)."), "",
         "| size | mode | shards | n | F1 first sentence | answer in output | TTFT median | routing recall@1 shard "
         "| routing recall@2 shards | recall@k | vs RAG: ΔF1 first sentence | vs RAG: TTFT ratio |",
         "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in sizes:
        size_rows = [r for r in rows if r.size == size]
        ref = rag_keys[0] if rag_keys else None
        ref_rows = {(r.set, r.qid): r for r in size_rows if ref and (r.mode, r.k) == ref and r.ok}
        for m, k in [(m, None) for m in cag_modes] + rag_keys:
            rs = g.get((size, m, k))
            if not rs:
                continue
            st = stats(rs)
            if shard_cap(m) is not None:
                shards = "; ".join(shards_text(set_snapshots(s, m)) for s in ready_sets(sets) if s["size"] == size)
            else:
                shards = "–"
            vs_f1, vs_ttft = "–", "–"
            if shard_cap(m) is not None and ref_rows:
                pairs = [(r, ref_rows[(r.set, r.qid)]) for r in rs if r.ok and (r.set, r.qid) in ref_rows]
                vs_f1 = _diff(bootstrap([a.f1_first - b.f1_first for a, b in pairs
                                         if a.f1_first is not None and b.f1_first is not None]))
                vs_ttft = _ratio(bootstrap([a.ttft_ms / b.ttft_ms for a, b in pairs if a.ttft_ms and b.ttft_ms],
                                           "median"))
                if pairs:
                    vs_f1 += f" (n={len(pairs)})"
            L += [f"| {size} | {label(m, k)} | {shards} | {st['n']} | {_num(st['f1_first'], 2)} | {_num(st['aio'], 2)} "
                  f"| {_ms(st['ttft'])} | {_num(st.get('route1'), 2)} | {_num(st.get('route2'), 2)} "
                  f"| {_num(st.get('recall'), 2)} | {vs_f1} | {vs_ttft} |"]
    return L + [""]


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
    L += _sets_table(sets, meta.get("questions"))
    L += _overview(g, sets, k_main)
    L += _sharding_section(g, rows, sets, k_main)
    for size in sizes_run(sets):
        L += _size_section(size, g, rows, sets, k_main)
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
