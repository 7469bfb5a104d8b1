"""report.png: quality and latency per knowledge size and mode, with 95% bootstrap error bars."""

from __future__ import annotations

from pathlib import Path

from .results import Row, label, prefix_range, shard_cap, sizes_run
from .stats import Estimate, group, mode_sort_key, stats

STYLES = {"cag": ("tab:blue", "o", "-"), "full": ("tab:red", "s", "--"), "rag-bm25": ("tab:green", "^", "-"),
          "rag-dense": ("tab:purple", "D", "-"), "cag+rag": ("black", "*", "-")}
# the shard-size sweep's cag@N, smallest cap first: cag's marker, dotted, a colour each
SWEEP_COLORS = ("tab:cyan", "tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:gray")


def _style(mode: str, sweep: list[str]) -> tuple[str, str, str]:
    if mode in sweep:
        return SWEEP_COLORS[sweep.index(mode) % len(SWEEP_COLORS)], "o", ":"
    return STYLES.get(mode, ("gray", "x", ":"))


def _seconds(e: Estimate | None) -> Estimate | None:
    if e is None:
        return None
    return Estimate(e.value / 1e3, None if e.lo is None else e.lo / 1e3, None if e.hi is None else e.hi / 1e3, e.n)


def render_png(rows: list[Row], meta: dict, sets: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(rows, meta, sets)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(rows: list[Row], meta: dict, sets: list[dict]):
    """The report's figure: F1 and answer-in-output means, TTFT and total medians, per size and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    k_main = meta.get("k_main")
    g = group(rows)
    sizes = sizes_run(sets)
    mode_keys = sorted({(m, k) for (_, m, k) in g if k is None or k == k_main}, key=lambda mk: mode_sort_key(*mk))
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    panels = [(axes[0][0], "F1 (token overlap), mean", lambda st: st["f1"], False),
              (axes[0][1], "answer in output, mean", lambda st: st["aio"], False),
              (axes[1][0], "time to first token, median (s)", lambda st: _seconds(st["ttft"]), True),
              (axes[1][1], "total time per question, median (s)", lambda st: _seconds(st["total"]), True)]
    n_modes = max(len(mode_keys), 1)
    sweep = [m for m, _ in mode_keys if m != "cag" and shard_cap(m) is not None]
    for ax, title, get, log in panels:
        for i, (m, k) in enumerate(mode_keys):
            if m == "full" and not log:
                continue  # full answers equal cag's (flagged in report.md if not), on a smaller sample
            xs, ys, lo, hi, ns = [], [], [], [], []
            for size in sizes:
                rs = g.get((size, m, k))
                e = get(stats(rs)) if rs else None
                if e is None:
                    continue
                xs.append(size)
                ys.append(e.value)
                lo.append(0.0 if e.lo is None else e.value - e.lo)
                hi.append(0.0 if e.hi is None else e.hi - e.value)
                ns.append(e.n)
            if not xs:
                continue
            # modes side by side around each size, so their error bars do not hide one another
            shift = [x * (1 + 0.012 * (i - (n_modes - 1) / 2)) for x in xs]
            color, marker, ls = _style(m, sweep)
            ax.errorbar(shift, ys, yerr=[lo, hi], marker=marker, linestyle=ls, color=color, label=label(m, k),
                        linewidth=2, capsize=3)
            if not log:
                for x, y, n in zip(shift, ys, ns):
                    ax.annotate(f"n={n}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7,
                                color=color)
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
            ax.set_xticks(sizes, [f"{size}\n({prefix_range(sets, size)})" for size in sizes])
    for ax in (axes[0][0], axes[1][0]):  # quality modes, and all modes (full included) on latency
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
    fig.suptitle(f"cag compare on {meta.get('format')}: {meta.get('model')} (greedy, {meta.get('max_tokens')} "
                 "tokens max); error bars: 95% bootstrap intervals over questions\n"
                 "quality: full is not drawn, its answers are cag's (report.md checks); latency: median per question")
    return fig
