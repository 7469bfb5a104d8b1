"""Ingest: the knowledge prefilled as decode rows (cag.runtime.knowledge_kv) against fixed blocks through the
transformers forward (the float32 model, blocks of 256 rows: the path before), side by side in one run.

Speed and memory: for each size, `cag ingest` of that many tokens of essays in a fresh process per path (so
each reports its own resident memory), the two paths alternating, best of --rounds: prefill tokens/s, the
process's resident memory after the ingest (VmRSS: what stays while it serves) and its peak (VmHWM).
Quality: the same questions (the handbook's gold ones and the first --squad SQuAD v1.1 dev questions, one per
paragraph, in knowledge folders of ~1.5K tokens: bench_weights_quality) answered from snapshots prefilled each
way, decoding the same way (CAG_WEIGHTS auto): how often the first 32 tokens agree, F1 and answer in output
with 95% bootstrap intervals and the paired difference (compare.stats).

    python -m bench.bench_ingest --sizes 1000,4000 --squad 100
    python -m bench.bench_ingest --model qwen2.5-0.5b --sizes 1000 --squad 0   # a bench_models shape's GGUF

Writes bench/results/ingest.json and .md (--name).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import REPO, essay_corpus, machine, write

CHILD = "BENCH_INGEST_PATH"  # set in a child: which path it prefills with


def blocks() -> None:
    """Prefill as before: fixed blocks of 256 rows through the float32 forward, never as decode rows."""
    from cag.runtime import knowledge_kv

    knowledge_kv.rows_max = lambda lm, store: 0


def child(folder: str, home: str) -> None:
    """One ingest in this process; prints its figures as one JSON line."""
    if os.environ[CHILD] == "blocks":
        blocks()
    from cag.config import get_settings
    from cag.engine import Engine
    from cag.runtime import knowledge_kv

    engine = Engine(get_settings(home=Path(home), models_dir_override=get_settings().models_dir))
    engine.lm  # noqa: B018 - loaded (and packed) before the ingest is timed
    r = engine.ingest(folder, name="bench")
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    mib = lambda key: int(status[key].split()[0]) / 1024  # noqa: E731
    s = r.shards[0]
    print(json.dumps({"tokens": s["n_tokens"], "prefill_ms": s["prefill_ms"], "rss_mib": mib("VmRSS"),
                      "peak_mib": mib("VmHWM"), "weights": engine.lm.weights,
                      "block": knowledge_kv.block(engine.prefill(s["n_tokens"]))}))


def speed(sizes: list[int], rounds: int, work: Path) -> list[dict]:
    out = []
    for size in sizes:
        folder = essay_corpus(work / f"essays-{size}", size, lambda text: len(text) // 4)  # ~4 characters a token
        best: dict[str, dict] = {}
        for i in range(rounds):
            for path in ("rows", "blocks") if i % 2 == 0 else ("blocks", "rows"):
                home = work / f"home-{path}-{size}-{i}"  # empty: every ingest prefills
                cmd = [sys.executable, "-m", "bench.bench_ingest", "--child", str(folder), str(home)]
                run = subprocess.run(cmd, env=os.environ | {CHILD: path}, cwd=REPO, capture_output=True, text=True,
                                     check=True)
                got = json.loads(run.stdout.strip().splitlines()[-1])
                got["tok_s"] = got["tokens"] / (got["prefill_ms"] / 1e3)
                if path not in best or got["tok_s"] > best[path]["tok_s"]:
                    best[path] = got
                print(size, path, got, flush=True)
        out.append({"size": size, **{p: best[p] for p in ("rows", "blocks")}})
    return out


def quality(n_squad: int, max_tokens: int, work: Path) -> dict:
    from cag.answering.query import Query
    from cag.compare import metrics, stats
    from cag.config import get_settings
    from cag.engine import Engine
    from cag.runtime import knowledge_kv

    from .bench_weights_quality import squad_folders

    handbook = [json.loads(line) for line in (REPO / "corpora/handbook/questions.jsonl").read_text().splitlines()
                if line.strip()]
    sets = [("handbook", REPO / "corpora/handbook", [(q["question"], q["answers"]) for q in handbook])]
    sets += [(name, work / name, items) for name, items in squad_folders(work, n_squad)] if n_squad else []
    rows_path = knowledge_kv.as_rows
    answers: dict[str, list] = {}
    for path in ("blocks", "rows"):
        knowledge_kv.as_rows = rows_path
        if path == "blocks":
            blocks()
        engine = Engine(get_settings(home=work / f"home-{path}", models_dir_override=get_settings().models_dir))
        answers[path] = []
        for name, folder, items in sets:
            engine.ingest(str(folder), name=name)
            for q, golds in items:
                a = engine.answer(Query(name, q, max_tokens=max_tokens))
                answers[path].append((a.token_ids, a.answer, golds))
        engine.evict()
        print(path, "answered", len(answers[path]), flush=True)
    knowledge_kv.as_rows = rows_path
    same = [a[0] == b[0] for a, b in zip(answers["rows"], answers["blocks"])]
    out: dict = {"n": len(same), "same_tokens": sum(same) / len(same)}
    for metric, fn in (("f1", metrics.f1), ("in_output", metrics.answer_in_output)):
        per = {p: [fn(a[1], a[2]) for a in answers[p]] for p in answers}
        per["delta"] = [r - b for r, b in zip(per["rows"], per["blocks"])]
        out[metric] = {p: est.as_dict() for p, v in per.items() if (est := stats.bootstrap(v)) is not None}
    return out


def _e(e: dict, signed: bool = False) -> str:
    f = "{:+.3f}" if signed else "{:.3f}"
    ci = e.get("ci95")
    return f.format(e["value"]) + (f" [{f.format(ci[0])}, {f.format(ci[1])}]" if ci else "")


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,4000", help="knowledge tokens of each speed row ('' for none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--squad", type=int, default=100, help="SQuAD questions of the quality run (0: the handbook only)")
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", help="a bench_models shape written to a GGUF file (bench_anchor.shape_gguf)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "cag-bench-models")
    ap.add_argument("--name", default="ingest")
    args = ap.parse_args()
    if args.model:
        from .bench_anchor import shape_gguf

        os.environ["CAG_MODEL"] = str(shape_gguf(args.model, "Q4_0", args.work))
    with tempfile.TemporaryDirectory() as tmp:
        sizes = [int(s) for s in args.sizes.split(",") if s]
        fast = speed(sizes, args.rounds, Path(tmp))
        good = None if args.no_quality else quality(args.squad, args.max_tokens, Path(tmp))
    lines = [f"Machine: {machine()}. Model: {args.model or 'the embedded SmolLM2-135M'}; `auto` settings. rows: the "
             "knowledge prefilled as decode rows (cag.runtime.knowledge_kv); blocks: fixed blocks of 256 rows through "
             "the float32 transformers forward. Each ingest in a process of its own; best of "
             f"{args.rounds}, the paths alternating.", "",
             "| knowledge tokens | prefill tok/s rows / blocks | ratio | RSS after MiB rows / blocks | peak MiB rows / "
             "blocks |", "|---:|---|---:|---|---|"]
    for r in fast:
        a, b = r["rows"], r["blocks"]
        lines.append(f"| {a['tokens']:,} | {a['tok_s']:.0f} / {b['tok_s']:.0f} | {a['tok_s'] / b['tok_s']:.2f}x | "
                     f"{a['rss_mib']:.0f} / {b['rss_mib']:.0f} | {a['peak_mib']:.0f} / {b['peak_mib']:.0f} |")
    if good:
        lines += ["", f"Quality: {good['n']} questions (handbook + SQuAD), {args.max_tokens} greedy tokens, the same "
                  f"decoding; first tokens the same: {100 * good['same_tokens']:.0f}%.", "",
                  "| | rows | blocks | rows − blocks |", "|---|---|---|---|"]
        for metric, label in (("f1", "F1"), ("in_output", "answer in output")):
            m = good[metric]
            lines.append(f"| {label} | {_e(m['rows'])} | {_e(m['blocks'])} | {_e(m['delta'], True)} |")
    write(args.name, {"machine": machine(), "model": args.model, "speed": fast, "quality": good},
          "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
