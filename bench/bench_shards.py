"""Sharded corpus benchmark: knowledge far larger than the context, measured side by side in one run.

Ingests every Paul Graham essay (~140K tokens) as one corpus, which `cag ingest` splits into
shards that each fit the context, and a single ~7K-token corpus. Then, with snapshots read from
their files (not resident):
  * snapshot bytes vs the KV formula, per shard;
  * TTFT of the sharded corpus (routing + one shard load + question) vs TTFT of the single 7K
    snapshot (target <= 1.3x);
  * TTFT from the routed shard's snapshot vs prefilling that same shard from scratch (`full` mode
    over the routed shard; target >= 100x);
  * routing time, and whether `--shards 2` changes the answer.
Writes bench/results/shards.json and shards.md.  Run: `python -m bench.bench_shards`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine

from .common import ESSAYS, essay_corpus, machine, timed, write

QUESTIONS = [
    "What does the author say about how to start a startup?",
    "Why do great hackers like to work on hard problems?",
    "What is the advice about doing what you love?",
    # its essay was alone in the smallest shard (3.8K tokens) when shards were packed by first fit: the
    # floor of the speedup against a prefill from scratch, which shrinks with the square of the shard's
    # length while the question's pass does not (even packing now leaves no shard that small)
    "What makes an essay useful, according to the author?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=5, help="cold asks per side, alternating (median)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--essays", type=int, default=0, help="only the first N essays (a quick run); 0: all")
    ap.add_argument("--kv-dtype", default=None, help="snapshot dtype (CAG_KV_DTYPE; default: the setting's, auto); "
                    "results go to shards-<dtype>.md when set")
    ap.add_argument("--home", help="keep the corpora here (a rerun reuses their snapshots instead of ingesting "
                                   "again; the ingest time reported is then the first run's); default: a temp dir")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(args.home or tmp)
        home.mkdir(parents=True, exist_ok=True)
        over = {"kv_dtype": args.kv_dtype} if args.kv_dtype else {}
        engine = Engine(get_settings(home=home / "home", models_dir_override=get_settings().models_dir, **over))
        lm = engine.lm
        all_essays = home / "essays"
        all_essays.mkdir(exist_ok=True)
        for p in sorted(ESSAYS.glob("*.txt"))[: args.essays or None]:
            shutil.copy(p, all_essays / p.name)
        big = engine.ingest(str(all_essays), name="essays")
        count = lambda t: len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
        engine.ingest(str(essay_corpus(home / "essays-7k", 7000, count)), name="essays7k")
        shard_rows = []
        for s in big.shards:
            formula = lm.kv_bytes(s["n_tokens"], engine.kv_dtype)
            shard_rows.append({**s, "formula_bytes": formula, "bytes_over_formula": s["bytes"] / formula - 1})

        load_before = os.getloadavg()
        engine.answer(Query("essays", "warm up", max_tokens=1))  # the router is built once per set of shard snapshots
        rows = []
        for q in QUESTIONS:
            def cold(corpus, **kw):
                engine.evict()  # read the snapshot from its file each time
                engine.kept.clear()  # and prefill the question (no kept conversation's K/V reused)
                return engine.answer(Query(corpus, q, max_tokens=1, **kw))

            big_times, one_times = [], []
            for _ in range(args.repeat):  # alternating: a load spike on this shared host hits both sides
                t, a_big = timed(lambda: cold("essays"), 1)
                big_times.append(t)
                t, a_one = timed(lambda: cold("essays7k"), 1)
                one_times.append(t)
            t_big, t_one = statistics.median(big_times), statistics.median(one_times)
            t_full, a_full = timed(lambda: engine.answer(Query("essays", q, max_tokens=1, mode="full")), 1)
            shard = a_big.shards[0]["shard"]
            long = engine.answer(Query("essays", q, max_tokens=args.max_tokens))
            two = engine.answer(Query("essays", q, max_tokens=args.max_tokens, shards=2))
            full = engine.answer(Query("essays", q, max_tokens=args.max_tokens, mode="full"))
            rows.append({
                "question": q, "shard": shard, "shard_tokens": a_big.cached_tokens, "routing_ms": a_big.routing_ms,
                "ttft_sharded_ms": t_big * 1e3, "ttft_single_7k_ms": t_one * 1e3, "ratio_vs_7k": t_big / t_one,
                "ttft_shard_from_scratch_ms": t_full * 1e3, "speedup_vs_scratch": t_full / t_big,
                "single_7k_tokens": a_one.cached_tokens, "cag_equals_full": long.token_ids == full.token_ids,
                "two_shards_chose": next(s["shard"] for s in two.shards if s["chosen"]),
                "two_shards_same_answer": two.token_ids == long.token_ids,
                "ttft_sharded_all_ms": [round(t * 1e3, 1) for t in big_times],
                "ttft_single_7k_all_ms": [round(t * 1e3, 1) for t in one_times],
            })
            print(rows[-1], flush=True)

    head = (
        f"Machine: {machine()}. Model: {lm.name}, weights {lm.weights} (attention over "
        f"{str(lm.attn_dtype).removeprefix('torch.')} K/V), {engine.kv_name} snapshots. Corpus: {big.n_documents} "
        f"essays, {big.n_tokens:,} tokens in {big.n_shards} shards, "
        + (
            f"ingested in {big.prefill_ms / 1e3:.0f} s ({big.n_tokens / (big.prefill_ms / 1e3):.0f} tok/s). "
            if big.prefill_ms > 1e3
            else "snapshots reused from an earlier ingest (--home). "
        )
        + f"Median of {args.repeat} cold asks a side, sharded and single alternating, snapshots read from their files. "
        f"Load average (1, 5, 15 min) before / after: {tuple(round(x, 2) for x in load_before)} / "
        f"{tuple(round(x, 2) for x in os.getloadavg())}.\n\n"
        "| shard | tokens | bytes | vs formula |\n|---|---|---|---|\n"
    )
    head += "".join(f"| {s['shard']} | {s['n_tokens']:,} | {s['bytes']:,} | {100 * s['bytes_over_formula']:+.2f}% |\n"
                    for s in shard_rows)
    head += (
        "\n| question | routed shard | routing ms | TTFT sharded | TTFT single 7K | ratio | TTFT shard from scratch | "
        "speedup | cag == full | --shards 2 chose |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['question']} | {r['shard']} ({r['shard_tokens']:,} tok) | {r['routing_ms']:.1f} | "
        f"{r['ttft_sharded_ms']:.0f} ms | {r['ttft_single_7k_ms']:.0f} ms | **{r['ratio_vs_7k']:.2f}x** | "
        f"{r['ttft_shard_from_scratch_ms'] / 1e3:.1f} s | **{r['speedup_vs_scratch']:.0f}x** | {r['cag_equals_full']} "
        f"| {r['two_shards_chose']} |\n"
        for r in rows
    )
    foot = ("\nTargets: TTFT at 100K+ tokens <= 1.3x a single 7K snapshot's; >= 100x faster than prefilling the routed "
            "shard from scratch; bytes within 1% of the formula per shard.\n")
    write(
        f"shards-{args.kv_dtype}" if args.kv_dtype else "shards",
        {
            "machine": machine(),
            "kv_dtype": engine.kv_name,
            "corpus_tokens": big.n_tokens,
            "n_shards": big.n_shards,
            "ingest_ms": big.prefill_ms,
            "shards": shard_rows,
            "rows": rows,
        },
        head + body + foot,
    )


if __name__ == "__main__":
    main()
