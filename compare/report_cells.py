"""The cells of report.md's tables: a statistic with its bootstrap interval, in its unit (a number,
a difference, milliseconds or seconds, a ratio), and the row every per-mode table shares.
"""

from __future__ import annotations

from .stats import Estimate


def _estimate(e: Estimate | None, value) -> str:
    """A statistic as `value [lo, hi]` (the interval only when there is one), `–` for none."""
    if e is None:
        return "–"
    return value(e.value) if e.lo is None else f"{value(e.value)} [{value(e.lo)}, {value(e.hi)}]"


def num(e: Estimate | None, digits: int = 3) -> str:
    return _estimate(e, lambda v: f"{v:.{digits}f}")


def diff(e: Estimate | None) -> str:
    return _estimate(e, lambda v: f"{v:+.3f}")


def _ms_value(v: float) -> str:
    return f"{v / 1e3:.2f} s" if v >= 1000 else f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def ms(e: Estimate | None) -> str:
    return _estimate(e, _ms_value)


def ratio(e: Estimate | None) -> str:  # `1.23x [1.10, 1.40]`: the x once, on the value
    if e is None:
        return "–"
    return f"{e.value:.2f}x" + ("" if e.lo is None else f" [{e.lo:.2f}, {e.hi:.2f}]")


TABLE_HEAD = ("| mode | n | EM | F1 | F1 first sentence | answer in output | TTFT median | TTFT p95 "
              "| total median | total p95 | retrieval median | recall@k | routing recall@1 shard "
              "| routing recall@2 shards | prompt tokens (median) |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(name: str, s: dict) -> str:
    n = f"{s['n']}" + (f" ({s['errors']} errors)" if s["errors"] else "")
    pt = "–" if not s["prompt_tokens"] else f"{s['prompt_tokens'].value:.0f}"
    return (f"| {name} | {n} | {num(s['em'])} | {num(s['f1'])} | {num(s['f1_first'])} | {num(s['aio'])} "
            f"| {ms(s['ttft'])} | {ms(s['ttft_p95'])} | {ms(s['total'])} | {ms(s['total_p95'])} "
            f"| {ms(s['retrieval'])} | {num(s.get('recall'), 2)} | {num(s.get('route1'), 2)} "
            f"| {num(s.get('route2'), 2)} | {pt} |")
