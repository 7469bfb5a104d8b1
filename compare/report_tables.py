"""report.md's result tables: the overview (F1 and TTFT per mode and size), one section per size
(every mode with its intervals, paired differences against cag, retrieval and routing hits, the k
sweep), and sharded CAG against RAG (shard size, routing recall next to recall@k).
"""

from __future__ import annotations

from .report_cells import TABLE_HEAD, diff, ms, num, ratio, table_row
from .results import Row, label, prefix_range, ready_sets, set_snapshots, shard_cap, shards_text, sizes_run
from .stats import bootstrap, mode_sort_key, paired_vs_cag, retrieves, stats


def _not_asked(sets: list[dict], size: int, mode: str) -> bool:
    """Every set of the size skipped this mode (e.g. `full` beyond the context)."""
    ready = [s for s in ready_sets(sets) if s["size"] == size]
    return bool(ready) and all(mode in (s.get("skipped_modes") or {}) for s in ready)


def _sharded(sets: list[dict], size: int, mode: str = "cag") -> bool:
    return any(len(set_snapshots(s, mode)) > 1 for s in ready_sets(sets) if s["size"] == size)


def overview(g: dict, sets: list[dict], k_main) -> list[str]:
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
            cells.append(f"{num(st['f1'], 2)} / {ms(st['ttft'])} (n={st['n']})")
        L += [f"| {label(m, k)} | " + " | ".join(cells) + " |"]
    return L + [""]


def size_section(size: int, g: dict, rows: list[Row], sets: list[dict], k_main) -> list[str]:
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
        L += [table_row(label(m, k), stats(rs))]
    L += [""]
    size_rows = [r for r in rows if r.size == size]
    paired = [p for p in paired_vs_cag(size_rows) if p["k"] is None or p["k"] == k_main]
    if paired:
        L += ["Paired against cag on the same questions (mean of per-question differences, mode − cag; TTFT: "
              "median of per-question ratios, mode / cag):", "",
              "| mode | questions in both | ΔF1 | ΔF1 first sentence | Δanswer in output | TTFT ratio |",
              "|---|---:|---:|---:|---:|---:|"]
        L += [f"| {label(p['mode'], p['k'])} | {p['n']} | {diff(p['f1'])} | {diff(p['f1_first'])} "
              f"| {diff(p['aio'])} | {ratio(p['ttft_ratio'])} |" for p in paired]
        L += [""]
    for (_, m, k), rs in main:
        st = stats(rs)
        if retrieves(m) and st.get("recall") is not None:
            L += [(f"- {label(m, k)}: gold document(s) all retrieved for {st['hit_rate']:.0%} of questions "
                   f"(missed {st['n_miss']}); F1 {num(st['f1_hit'], 2)} when retrieved, "
                   f"{num(st['f1_miss'], 2)} when missed.")]
        if st.get("route1") is not None:
            L += [(f"- {label(m, k)}: gold document(s) all in the shard that answered for {st['route_hit_rate']:.0%} "
                   f"of questions (missed {st['route_n_miss']}); F1 {num(st['route_f1_hit'], 2)} when routed to "
                   f"them, {num(st['route_f1_miss'], 2)} when not; routing median {ms(st['routing'])}.")]
    # k sweep on its sample, next to cag on the same questions.
    sweep = [(key, rs) for key, rs in items if retrieves(key[1]) and key[2] not in (None, k_main)]
    if sweep:
        qids = {(r.set, r.qid) for _, rs in sweep for r in rs}
        L += ["", f"k sweep on the first {len(qids)} questions (cag and full on the same questions for reference):",
              "", TABLE_HEAD]
        for (_, m, k), rs in items:
            sub = [r for r in rs if (r.set, r.qid) in qids]
            if sub:
                L += [table_row(label(m, k), stats(sub))]
    return L + [""]


def sharding_section(g: dict, rows: list[Row], sets: list[dict], k_main) -> list[str]:
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
                vs_f1 = diff(bootstrap([a.f1_first - b.f1_first for a, b in pairs
                                         if a.f1_first is not None and b.f1_first is not None]))
                vs_ttft = ratio(bootstrap([a.ttft_ms / b.ttft_ms for a, b in pairs if a.ttft_ms and b.ttft_ms],
                                           "median"))
                if pairs:
                    vs_f1 += f" (n={len(pairs)})"
            L += [f"| {size} | {label(m, k)} | {shards} | {st['n']} | {num(st['f1_first'], 2)} | {num(st['aio'], 2)} "
                  f"| {ms(st['ttft'])} | {num(st.get('route1'), 2)} | {num(st.get('route2'), 2)} "
                  f"| {num(st.get('recall'), 2)} | {vs_f1} | {vs_ttft} |"]
    return L + [""]
