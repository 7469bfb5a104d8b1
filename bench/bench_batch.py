"""Batched decoding against each question alone: agreement and throughput, in one run.

Questions: corpora/handbook's gold questions and the first N SQuAD v1.1 dev questions (one per
paragraph, paragraphs packed into knowledge folders of about 4,000 tokens, so a batch shares a
prefix as a served corpus's questions do). Every question is answered alone (one after another:
a batch of one) and then all of a folder's questions at once (`cag.rag.answer.ask_many`, decoded
together up to CAG_MAX_BATCH), greedy, from the same resident snapshot. Reported: the share of
answers whose tokens are identical (the issue's bar: at least 99%), where the others first differ,
and the wall time and completion tokens/s of both passes.
Writes bench/results/batch.json and .md.  Run: `python -m bench.bench_batch [--squad 180]`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.rag.answer import ask_many

from .bench_weights_quality import squad_folders
from .common import REPO, machine, write


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--squad", type=int, default=180)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--folder-tokens", type=int, default=4000)
    args = ap.parse_args()
    handbook = [
        json.loads(line)["question"]
        for line in (REPO / "corpora/handbook/questions.jsonl").read_text().splitlines()
        if line.strip()
    ]
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(get_settings(home=Path(tmp) / "home", models_dir_override=get_settings().models_dir))
        sets = [("handbook", handbook)] + [(name, [q for q, _ in items]) for name, items in
                                           squad_folders(Path(tmp), args.squad, args.folder_tokens)]
        for name, _ in sets:
            engine.ingest(str(REPO / "corpora/handbook") if name == "handbook" else str(Path(tmp) / name), name=name)
            print("ingested", name, flush=True)
        # first forwards (allocator, kernels) outside the timings
        engine.answer(Query("handbook", handbook[0], max_tokens=2))
        rows, t_alone, t_batch, tok_alone, tok_batch, steps, batch_rows = [], 0.0, 0.0, 0, 0, 0, 0
        for name, questions in sets:
            t0 = time.perf_counter()
            alone = [engine.answer(Query(name, q, max_tokens=args.max_tokens)) for q in questions]
            t1 = time.perf_counter()
            before = engine.stats
            batched = [a for _, a in ask_many(engine, name, questions, max_tokens=args.max_tokens)]
            t2 = time.perf_counter()
            steps += engine.stats["decode_steps"] - before["decode_steps"]
            batch_rows += engine.stats["decode_rows"] - before["decode_rows"]
            t_alone, t_batch = t_alone + t1 - t0, t_batch + t2 - t1
            tok_alone += sum(a.completion_tokens for a in alone)
            tok_batch += sum(a.completion_tokens for a in batched)
            for q, a, b in zip(questions, alone, batched):
                rows.append(
                    {
                        "set": name,
                        "question": q,
                        "identical": a.token_ids == b.token_ids,
                        "first_difference": first_difference(a.token_ids, b.token_ids),
                        "alone": a.answer,
                        "batched": b.answer,
                    }
                )
            print(name, f"{sum(r['identical'] for r in rows)}/{len(rows)} identical so far", flush=True)
    same = sum(r["identical"] for r in rows)
    res = {
        "machine": machine(),
        "loadavg": os.getloadavg(),
        "n": len(rows),
        "identical": same,
        "share": same / len(rows),
        "max_batch": engine.settings.max_batch,
        "weights": engine.lm.weights,
        "kernels": engine.lm.kernels,
        "mean_batch": batch_rows / max(1, steps),  # the batched passes only
        "alone_s": t_alone,
        "batched_s": t_batch,
        "alone_tok_s": tok_alone / t_alone,
        "batched_tok_s": tok_batch / t_batch,
        "differences": [r for r in rows if not r["identical"]],
    }
    md = (
        f"Machine: {res['machine']} (load average at the end {'/'.join(f'{x:.1f}' for x in res['loadavg'])}). "
        f"SmolLM2-135M, weights {res['weights']}, decode kernels {res['kernels']}, fp16 snapshots, greedy, "
        f"{args.max_tokens} tokens; {len(handbook)} handbook + {len(rows) - len(handbook)} SQuAD questions (folders of "
        f"~{args.folder_tokens} tokens).\n\n"
        "| answers identical, batched vs alone | alone: wall s, completion tok/s | batched: wall s, completion tok/s, "
        "mean decode batch | speed-up |\n"
        "|---|---|---|---|\n"
        f"| {same}/{len(rows)} ({100 * res['share']:.1f}%) | {t_alone:.0f} s, {res['alone_tok_s']:.1f} | {t_batch:.0f} "
        f"s, {res['batched_tok_s']:.1f}, {res['mean_batch']:.1f} | {t_alone / t_batch:.2f}x |\n"
    )
    if res["differences"]:
        md += "\nAnswers that differ (first differing token index):\n\n" + "".join(
            f"- {r['set']}: {r['question']!r} at token {r['first_difference']}: {r['alone']!r} vs {r['batched']!r}\n"
            for r in res["differences"])
    write("batch", res, md)
    print(md)


if __name__ == "__main__":
    main()
