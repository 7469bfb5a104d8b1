"""cag+rag against RAG on the same questions, from a `cag compare` run's rows: per k, the paired mean
difference (cag+rag - RAG) of F1 first sentence and answer-in-output, and the median TTFT ratio, with
bootstrap intervals (compare.stats). Prints a markdown table.

    python -m bench.paired_hybrid bench/results/compare-squad-hybrid
"""

from __future__ import annotations

import sys
from pathlib import Path

from compare.results import read_rows
from compare.stats import bootstrap


def fmt(e, pct: bool = False, ratio: bool = False) -> str:
    if e is None:
        return "–"
    f = (lambda x: f"{x:.2f}x") if ratio else (lambda x: f"{x:+.3f}")
    return f"{f(e.value)} [{f(e.lo)}, {f(e.hi)}]" if e.lo is not None else f(e.value)


def main(folder: str) -> None:
    rows = [r for r in read_rows(Path(folder) / "results.jsonl") if r.ok]
    by: dict = {}
    for r in rows:
        by.setdefault((r.size, r.mode, r.k), {})[(r.set, r.qid)] = r
    print("| size | cag+rag | against | n | ΔF1 first sentence | Δanswer in output | TTFT ratio |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for size, hk in sorted({(s, k) for s, m, k in by if m == "cag+rag"}):
        refs = sorted(((m, k) for s, m, k in by if s == size and m.startswith("rag")), key=lambda x: (x[0], x[1] or 0))
        for ref in refs:
            h, g = by[(size, "cag+rag", hk)], by[(size, *ref)]
            both = sorted(set(h) & set(g))
            d_f1 = bootstrap([h[q].f1_first - g[q].f1_first for q in both])
            d_aio = bootstrap([float(h[q].answer_in_output) - float(g[q].answer_in_output) for q in both])
            ratio = bootstrap([h[q].ttft_ms / g[q].ttft_ms for q in both], "median")
            print(f"| {size} | k={hk} | {ref[0]} k={ref[1]} | {len(both)} | {fmt(d_f1)} | {fmt(d_aio)} "
                  f"| {fmt(ratio, ratio=True)} |")


if __name__ == "__main__":
    main(sys.argv[1])
