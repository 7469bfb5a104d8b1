"""report.md and report.png from the rows of a compare run (results.jsonl).

Everything is recomputed from the rows, so a report can be rebuilt from a results file alone
(`write_report`), and an interrupted run still gets a report of what it finished.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from cag.units import human_bytes

from .metrics import summarize

MODE_ORDER = {"cag": 0, "full": 1, "rag-bm25": 2, "rag-dense": 3}


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r.get("error")]


def _mean(rows, key) -> float | None:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return float(np.mean(vals)) if vals else None


def _stat(rows, key) -> dict | None:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return summarize(vals) if vals else None


def stats(rows: list[dict]) -> dict:
    """Quality and latency of one group of rows (one set, mode and k)."""
    ok = _ok(rows)
    out = {"n": len(ok), "errors": len(rows) - len(ok), "em": _mean(ok, "em"), "f1": _mean(ok, "f1"),
           "aio": _mean(ok, "answer_in_output"), "ttft": _stat(ok, "ttft_ms"), "total": _stat(ok, "total_ms"),
           "retrieval": _stat(ok, "retrieval_ms"), "prompt_tokens": _stat(ok, "prompt_tokens"),
           "completion_tokens": _stat(ok, "completion_tokens")}
    if any(r.get("retrieval_recall") is not None for r in ok):
        hit = [r for r in ok if r.get("retrieval_hit")]
        miss = [r for r in ok if r.get("retrieval_hit") is False]
        out.update(recall=_mean(ok, "retrieval_recall"), hit_rate=float(np.mean([bool(r["retrieval_hit"]) for r in ok])),
                   f1_hit=_mean(hit, "f1"), f1_miss=_mean(miss, "f1"), n_miss=len(miss))
    return out


def group(rows: list[dict]) -> dict[tuple, list[dict]]:
    g: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        g[(r["set"], r["mode"], r.get("k"))].append(r)
    return g


def _label(mode: str, k) -> str:
    return f"{mode} k={k}" if k is not None else mode


def _sort_key(item):
    (_, mode, k), _ = item
    return (MODE_ORDER.get(mode, 9), k or 0)


def _f(x, fmt="{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


def _ms(s: dict | None, key: str) -> str:
    if not s:
        return "–"
    v = s[key]
    return f"{v / 1e3:.2f} s" if v >= 1000 else f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


_bytes = human_bytes  # one formatter for every size the project prints


TABLE_HEAD = ("| mode | n | EM | F1 | answer in output | TTFT median | TTFT p95 | total median | total p95 "
              "| retrieval median | recall@k | prompt tokens (median) |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _table_row(label: str, s: dict) -> str:
    recall = "–" if s.get("recall") is None else f"{s['recall']:.2f}"
    pt = "–" if not s["prompt_tokens"] else f"{s['prompt_tokens']['median']:.0f}"
    n = f"{s['n']}" + (f" ({s['errors']} errors)" if s["errors"] else "")
    return (f"| {label} | {n} | {_f(s['em'])} | {_f(s['f1'])} | {_f(s['aio'])} | {_ms(s['ttft'], 'median')} "
            f"| {_ms(s['ttft'], 'p95')} | {_ms(s['total'], 'median')} | {_ms(s['total'], 'p95')} "
            f"| {_ms(s['retrieval'], 'median')} | {recall} | {pt} |")


def mismatches(rows: list[dict]) -> tuple[int, list[dict]]:
    """Questions asked in both cag and full mode, and those whose answers differ."""
    by = {(r["set"], r["qid"], r["mode"]): r for r in _ok(rows) if r["mode"] in ("cag", "full")}
    pairs = [(by[(s, q, "cag")], by[(s, q, "full")]) for (s, q, m) in by if m == "full" and (s, q, "cag") in by]
    bad = [{"set": c["set"], "qid": c["qid"], "cag": c["answer"], "full": f["answer"]}
           for c, f in pairs if c["answer"] != f["answer"]]
    return len(pairs), bad


def summary(rows: list[dict], k_main: int | None = None) -> list[dict]:
    """One record per (set, mode, k): the numbers of the tables, for --json and the README."""
    out = []
    for (s, mode, k), rs in sorted(group(rows).items(), key=lambda it: (it[0][0], *_sort_key(it))):
        st = stats(rs)
        out.append({"set": s, "size": rs[0]["size"], "mode": mode, "k": k, "n": st["n"], "em": st["em"],
                    "f1": st["f1"], "answer_in_output": st["aio"],
                    "ttft_ms_median": st["ttft"]["median"] if st["ttft"] else None,
                    "ttft_ms_p95": st["ttft"]["p95"] if st["ttft"] else None,
                    "total_ms_median": st["total"]["median"] if st["total"] else None,
                    "total_ms_p95": st["total"]["p95"] if st["total"] else None,
                    "retrieval_ms_median": st["retrieval"]["median"] if st["retrieval"] else None,
                    "recall_at_k": st.get("recall"), "main": k is None or k == k_main})
    return out


def render_markdown(rows: list[dict], meta: dict, sets: list[dict], notes: list[str] | None = None,
                    stopped: str | None = None) -> str:
    k_main = meta.get("k_main")
    g = group(rows)
    L = [f"# cag compare: {meta.get('format')} ({meta.get('dataset')})", ""]
    if stopped:
        L += [f"**Incomplete run ({stopped}): these tables cover the rows finished so far; `--resume` continues.**",
              ""]
    dec = meta.get("decode", {})
    machine, versions = meta.get("machine", {}), meta.get("versions", {})
    stops = ", ".join(f"`{t}`" for t in dec.get("stop_tokens", []))
    settings = [
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
        (f"questions: up to {meta.get('questions')} per size for cag and rag (k={k_main}); full on the first "
         f"{meta.get('full_sample')}; k sweep {meta.get('ks')} on the first {meta.get('k_sample')}"),
        (f"RAG: passages of at most {meta.get('passage_tokens')} tokens (model tokenizer, overlap "
         f"{meta.get('passage_overlap')}), cut at paragraph/line/sentence/word boundaries; BM25 "
         f"{json.dumps(meta.get('bm25'))}; dense: {meta.get('dense')}; retrieved passages go into the prompt in "
         "corpus order, named `<document>#<passage index>`"),
        f"dataset file: `{meta.get('dataset_path')}`",
        (f"machine: {machine.get('platform')}, {machine.get('cpus')} CPUs, torch threads "
         f"{machine.get('torch_threads')}; torch {versions.get('torch')}, transformers "
         f"{versions.get('transformers')}; started {meta.get('started')}, finished {meta.get('finished', '–')}; "
         f"load average (1/5/15 min) {meta.get('load_average_start')} at the start, "
         f"{meta.get('load_average_end')} at the end (above the core count = the machine was shared and "
         "latencies are inflated)"),
        ("TTFT counts from the call to the first generated token: cag includes loading the snapshot "
         "(memory-mapped, resident after the first question), full includes prefilling the whole set, "
         "rag includes reading the files, retrieval and prefilling the passages. One unrecorded warm-up "
         "question runs before the first recorded one."),
    ]
    L += ["## Settings", "", *(f"- {line}" for line in settings), ""]
    for note in notes or []:
        L += [f"> {note}", ""]

    n_pairs, bad = mismatches(rows)
    if n_pairs:
        if bad:
            L += [f"**full vs cag: {len(bad)} of {n_pairs} answers differ (they must be identical):**", ""]
            L += [f"- {b['set']} {b['qid']}: cag {b['cag']!r} / full {b['full']!r}" for b in bad]
        else:
            L += [f"full vs cag: all {n_pairs} answers asked in both modes are identical."]
        L += [""]

    # Cross-size overview (main k only).
    sizes = [s for s in sets if not s.get("skipped")]
    L += ["## Overview (F1 / median TTFT)", "",
          ("`full` is asked on a sample only: its answers must equal `cag`'s (checked above), so its quality "
          "columns describe that sample; compare quality between cag and rag, latency across all modes."), ""]
    mode_keys = sorted({(m, k) for (_, m, k) in g if k is None or k == k_main},
                       key=lambda mk: (MODE_ORDER.get(mk[0], 9), mk[1] or 0))
    L += ["| mode | " + " | ".join(f"{s['size']}" for s in sizes) + " |",
          "|---|" + "---:|" * len(sizes)]
    for m, k in mode_keys:
        cells = []
        for s in sizes:
            rs = g.get((s["name"], m, k))
            if not rs:
                cells.append("–")
                continue
            st = stats(rs)
            cells.append(f"{_f(st['f1'], '{:.2f}')} / {_ms(st['ttft'], 'median')} (n={st['n']})")
        L += [f"| {_label(m, k)} | " + " | ".join(cells) + " |"]
    L += [""]

    for s in sets:
        L += [f"## {s['name']} (size {s['size']})", ""]
        if s.get("skipped"):
            L += [f"Skipped: {s['skipped']}.", ""]
            continue
        ing = s.get("ingest") or {}
        L += [(f"{s['n_documents']} documents, {s['doc_tokens']} document tokens, real prefix "
              f"{s['prefix_tokens']} tokens, {s['n_questions']} questions.")]
        if ing:
            tps = ing["n_tokens"] / (ing["prefill_ms"] / 1e3) if ing.get("prefill_ms") else 0
            L += [f"One-time ingest cost: cag prefill {ing['prefill_ms'] / 1e3:.1f} s ({tps:.0f} tok/s), snapshot "
                  f"{_bytes(ing['bytes'])}" + (" (snapshot reused from an earlier run; its build time shown)"
                                               if ing.get("status") == "fresh" else "")
                  + "".join(f"; {m} index {v['build_ms']:.0f} ms over {v['n_passages']} passages"
                            for m, v in (s.get("rag_index") or {}).items()) + "."]
        L += ["", TABLE_HEAD]
        items = sorted(((key, rs) for key, rs in g.items() if key[0] == s["name"]), key=_sort_key)
        main = [(key, rs) for key, rs in items if key[2] is None or key[2] == k_main]
        for (_, m, k), rs in main:
            L += [_table_row(_label(m, k), stats(rs))]
        L += [""]
        misses = [(key, stats(rs)) for key, rs in main if key[1].startswith("rag")]
        for (_, m, k), st in misses:
            if st.get("recall") is not None:
                L += [(f"- {_label(m, k)}: gold document(s) all retrieved for {st['hit_rate']:.0%} of questions "
                      f"(missed {st['n_miss']}); F1 {_f(st['f1_hit'], '{:.2f}')} when retrieved, "
                      f"{_f(st['f1_miss'], '{:.2f}')} when missed.")]
        # k sweep on its sample, next to cag on the same questions.
        sweep = [(key, rs) for key, rs in items if key[1].startswith("rag") and key[2] not in (None, k_main)]
        if sweep:
            qids = {r["qid"] for _, rs in sweep for r in rs}
            L += ["", f"k sweep on the first {len(qids)} questions (cag and full on the same questions for reference):",
                  "", TABLE_HEAD]
            for (_, m, k), rs in items:
                if m in ("cag", "full") or m.startswith("rag"):
                    sub = [r for r in rs if r["qid"] in qids]
                    if sub:
                        L += [_table_row(_label(m, k), stats(sub))]
        L += [""]
    return "\n".join(L).rstrip() + "\n"


def render_png(rows: list[dict], meta: dict, sets: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    k_main = meta.get("k_main")
    g = group(rows)
    sizes = [s for s in sets if not s.get("skipped")]
    mode_keys = sorted({(m, k) for (_, m, k) in g if k is None or k == k_main},
                       key=lambda mk: (MODE_ORDER.get(mk[0], 9), mk[1] or 0))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    panels = [(axes[0][0], "F1 (token overlap)", lambda st: st["f1"], False),
              (axes[0][1], "answer in output", lambda st: st["aio"], False),
              (axes[1][0], "time to first token, median (s)", lambda st: st["ttft"]["median"] / 1e3 if st["ttft"] else None, True),
              (axes[1][1], "total time per question, median (s)", lambda st: st["total"]["median"] / 1e3 if st["total"] else None, True)]
    styles = {"cag": ("tab:blue", "o", "-"), "full": ("tab:red", "s", "--"), "rag-bm25": ("tab:green", "^", "-"),
              "rag-dense": ("tab:purple", "D", "-")}
    for ax, title, get, log in panels:
        for m, k in mode_keys:
            if m == "full" and not log:
                continue  # full answers equal cag's (flagged in report.md if not), on a smaller sample
            xs, ys = [], []
            for s in sizes:
                rs = g.get((s["name"], m, k))
                if rs and stats(rs)["n"]:
                    y = get(stats(rs))
                    if y is not None:
                        xs.append(s["size"])
                        ys.append(y)
            if xs:
                color, marker, ls = styles.get(m, ("gray", "x", ":"))
                ax.plot(xs, ys, marker=marker, linestyle=ls, color=color, label=_label(m, k), linewidth=2)
        ax.set_title(title)
        ax.set_xlabel("knowledge size, tokens (real prompt prefix)")
        ax.grid(True, which="both", alpha=0.3)
        if log:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
        else:
            ax.set_ylim(0, 1)
        if sizes:
            ax.set_xticks([s["size"] for s in sizes], [f"{s['size']}\n({s['prefix_tokens']})" for s in sizes])
    for ax in (axes[0][0], axes[1][0]):  # quality modes, and all modes (full included) on latency
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
    fig.suptitle(f"cag compare on {meta.get('format')}: {meta.get('model')} (greedy, {meta.get('max_tokens')} tokens max)\n"
                 "quality: full is not drawn, its answers are cag's (report.md checks); latency: median per question")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, rows: list[dict], meta: dict, sets: list[dict], notes: list[str] | None = None,
                 stopped: str | None = None) -> tuple[Path, Path]:
    out = Path(out)
    md = out / "report.md"
    md.write_text(render_markdown(rows, meta, sets, notes, stopped), encoding="utf-8")
    png = out / "report.png"
    render_png(rows, meta, sets, png)
    return md, png


def rebuild(out: Path) -> tuple[Path, Path]:
    """Re-render report.md/report.png of a finished (or stopped) run from its files alone."""
    out = Path(out)
    meta = json.loads((out / "run.json").read_text(encoding="utf-8"))
    sets = json.loads((out / "sets.json").read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    return write_report(out, rows, meta, sets, meta.get("notes"), meta.get("stopped"))
