"""The numbers of a compare report: per-group statistics with 95% bootstrap intervals, and the
paired difference of each mode against `cag` on the same questions.

Everything is a pure function of the rows. The bootstrap is the percentile bootstrap over
questions, numpy only, with a fixed seed and `N_RESAMPLES` resamples, so rebuilding a report
from the same rows gives the same intervals. With one value there is no interval.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .results import Row, shard_cap

N_RESAMPLES = 1000
CI_SEED = 0
CI_LEVEL = 0.95
MODE_ORDER = {"cag": 0, "full": 1, "rag-bm25": 2, "rag-dense": 3, "cag+rag": 4}


def retrieves(mode: str) -> bool:
    """Modes that retrieve top-k passages (and have a k): RAG's, and cag+rag's quote."""
    return mode.startswith("rag") or mode == "cag+rag"

_STATS: dict[str, Callable] = {
    "mean": lambda a, axis=None: np.mean(a, axis=axis),
    "median": lambda a, axis=None: np.median(a, axis=axis),
    "p95": lambda a, axis=None: np.percentile(a, 95, axis=axis),
}


@dataclass(frozen=True)
class Estimate:
    """A statistic of n values and its bootstrap interval (lo/hi None when n < 2)."""

    value: float
    lo: float | None
    hi: float | None
    n: int

    def as_dict(self) -> dict:
        return {"value": self.value, "ci95": None if self.lo is None else [self.lo, self.hi], "n": self.n}


def bootstrap(values: Iterable[float | None], stat: str = "mean", n_resamples: int = N_RESAMPLES,
              seed: int = CI_SEED, level: float = CI_LEVEL) -> Estimate | None:
    """`stat` (mean, median, p95) of the values that are not None, with its percentile bootstrap
    interval: resample the values with replacement `n_resamples` times, take the statistic of
    each resample, and keep the central `level` of those. None when there is no value."""
    f = _STATS[stat]
    arr = np.asarray([float(v) for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return None
    value = float(f(arr))
    if arr.size < 2:
        return Estimate(value, None, None, 1)
    rng = np.random.default_rng(seed)
    resampled = f(arr[rng.integers(0, arr.size, size=(n_resamples, arr.size))], axis=1)  # (n_resamples,)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(resampled, [tail, 100 - tail])
    return Estimate(value, float(lo), float(hi), int(arr.size))


def _vals(rows: list[Row], name: str) -> list:
    return [getattr(r, name) for r in rows]


def stats(rows: list[Row]) -> dict:
    """Quality and latency of one group of rows (one size, mode and k); Estimates or None."""
    ok = [r for r in rows if r.ok]
    out: dict[str, Any] = {"n": len(ok), "errors": len(rows) - len(ok),
           "em": bootstrap(_vals(ok, "em")), "f1": bootstrap(_vals(ok, "f1")),
           "f1_first": bootstrap(_vals(ok, "f1_first")), "aio": bootstrap(_vals(ok, "answer_in_output")),
           "ttft": bootstrap(_vals(ok, "ttft_ms"), "median"), "ttft_p95": bootstrap(_vals(ok, "ttft_ms"), "p95"),
           "total": bootstrap(_vals(ok, "total_ms"), "median"),
           "total_p95": bootstrap(_vals(ok, "total_ms"), "p95"),
           "retrieval": bootstrap(_vals(ok, "retrieval_ms"), "median"),
           "prompt_tokens": bootstrap(_vals(ok, "prompt_tokens"), "median")}
    if any(r.retrieval_recall is not None for r in ok):
        hit = [r for r in ok if r.retrieval_hit]
        miss = [r for r in ok if r.retrieval_hit is False]
        out.update(recall=bootstrap(_vals(ok, "retrieval_recall")),
                   hit_rate=float(np.mean([bool(r.retrieval_hit) for r in ok])),
                   f1_hit=bootstrap(_vals(hit, "f1")), f1_miss=bootstrap(_vals(miss, "f1")), n_miss=len(miss))
    routed = [r for r in ok if r.routing_recall is not None]
    if routed:  # sharded cag: is the gold in the shard that answered / in the 2 best shards
        hit = [r for r in routed if r.routing_recall == 1]
        miss = [r for r in routed if r.routing_recall is not None and r.routing_recall < 1]
        out.update(
            route1=bootstrap(_vals(routed, "routing_recall")),
            route2=bootstrap(_vals(routed, "routing_recall2")),
            route_hit_rate=len(hit) / len(routed),
            route_f1_hit=bootstrap(_vals(hit, "f1")),
            route_f1_miss=bootstrap(_vals(miss, "f1")),
            route_n_miss=len(miss),
            routing=bootstrap(_vals(routed, "routing_ms"), "median"),
            n_shards=bootstrap(_vals(routed, "n_shards"), "median"),
        )
    return out


def group(rows: list[Row]) -> dict[tuple, list[Row]]:
    """Rows by (size, mode, k): the sets pooled for one size are read together."""
    g: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        g[(r.size, r.mode, r.k)].append(r)
    return g


def mode_sort_key(mode: str, k: int | None) -> tuple:
    """cag, then the sweep's cag@N by N, then full, rag-bm25, rag-dense, cag+rag, each by k."""
    cap = shard_cap(mode)
    return (MODE_ORDER["cag"] if cap is not None else MODE_ORDER.get(mode, 9), cap or 0, k or 0)


def paired_vs_cag(rows: list[Row]) -> list[dict]:
    """For each mode (and k) other than cag among `rows` (one size): the questions asked in both
    it and cag, and the mean per-question difference (mode - cag) of F1, first-sentence F1 and
    answer-in-output, plus the median per-question TTFT ratio (mode / cag), each with its
    bootstrap interval. Pairing removes the spread between questions, which dominates these
    unpaired means at small n."""
    cag = {(r.set, r.qid): r for r in rows if r.mode == "cag" and r.ok}
    others: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        if r.mode != "cag" and r.ok and (r.set, r.qid) in cag:
            others[(r.mode, r.k)].append(r)
    out = []
    for (mode, k), rs in sorted(others.items(), key=lambda it: mode_sort_key(*it[0])):
        base = [cag[(r.set, r.qid)] for r in rs]

        def diff(name, rs=rs, base=base):
            return bootstrap([None if getattr(a, name) is None or getattr(b, name) is None
                              else getattr(a, name) - getattr(b, name) for a, b in zip(rs, base)])

        ratio = bootstrap([a.ttft_ms / b.ttft_ms if a.ttft_ms and b.ttft_ms else None for a, b in zip(rs, base)],
                          "median")
        out.append({"mode": mode, "k": k, "n": len(rs), "f1": diff("f1"), "f1_first": diff("f1_first"),
                    "aio": diff("answer_in_output"), "ttft_ratio": ratio})
    return out


def mismatches(rows: list[Row]) -> tuple[int, list[dict]]:
    """Questions asked in both cag and full mode, and those whose answers differ."""
    by = {(r.set, r.qid, r.mode): r for r in rows if r.ok and r.mode in ("cag", "full")}
    pairs = [(by[(s, q, "cag")], by[(s, q, "full")]) for (s, q, m) in by if m == "full" and (s, q, "cag") in by]
    bad = [{"set": c.set, "qid": c.qid, "cag": c.answer, "full": f.answer}
           for c, f in pairs if c.answer != f.answer]
    return len(pairs), bad


def _value(e: Estimate | None) -> float | None:
    return None if e is None else e.value


def _ci(e: Estimate | None) -> list[float] | None:
    return None if e is None or e.lo is None or e.hi is None else [e.lo, e.hi]  # lo and hi: both or neither


def summary(rows: list[Row], k_main: int | None = None) -> list[dict]:
    """One record per (size, mode, k): the numbers of the tables, with 95% intervals, for --json."""
    out = []
    groups = group(rows)
    paired = {}
    for size in sorted({s for s, _, _ in groups}):
        for p in paired_vs_cag([r for r in rows if r.size == size]):
            paired[(size, p["mode"], p["k"])] = p
    for (size, mode, k), rs in sorted(groups.items(), key=lambda it: (it[0][0], *mode_sort_key(*it[0][1:]))):
        st = stats(rs)
        rec = {"size": size, "sets": sorted({r.set for r in rs}), "mode": mode, "k": k, "n": st["n"],
               "errors": st["errors"], "main": k is None or k == k_main}
        for name, key in (("em", "em"), ("f1", "f1"), ("f1_first_sentence", "f1_first"),
                          ("answer_in_output", "aio"), ("ttft_ms_median", "ttft"), ("ttft_ms_p95", "ttft_p95"),
                          ("total_ms_median", "total"), ("total_ms_p95", "total_p95"),
                          ("retrieval_ms_median", "retrieval"), ("recall_at_k", "recall"),
                          ("routing_recall_at_1_shard", "route1"), ("routing_recall_at_2_shards", "route2"),
                          ("routing_ms_median", "routing")):
            rec[name], rec[name + "_ci95"] = _value(st.get(key)), _ci(st.get(key))
        vs = paired.get((size, mode, k))
        if vs:
            rec["vs_cag"] = {"n": vs["n"], **{name: vs[name].as_dict() if vs[name] else None
                                             for name in ("f1", "f1_first", "aio", "ttft_ratio")}}
        out.append(rec)
    return out
