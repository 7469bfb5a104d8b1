"""Engine benchmark (issue: the CAG engine). Everything is measured side by side in one run.

For knowledge prefixes of about 1K, 2K, 4K and 7K tokens (Paul Graham essays):
  * TTFT with the snapshot (loaded from its file, not resident) vs full prefill (no cache);
  * snapshot load throughput (parse + checksum verify + tensors) vs reading the file's bytes raw;
  * snapshot bytes vs the KV formula;
  * decode tokens/s over the snapshot vs over an empty context;
  * generation with use_cache=False vs True (the classic KV-cache table).
Writes bench/results/engine.json and engine.md.  Run: `make bench` or `python -m bench.bench_engine`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.store import snapshots

from .common import essay_corpus, machine, step_decode_rate, timed, write

QUESTION = "What does the author say about startups?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1000,2000,4000,7000")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--nocache-tokens", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="compute dtype of the weights: float32 | bfloat16")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        engine = Engine(
            get_settings(home=home / "home", models_dir_override=get_settings().models_dir, dtype=args.dtype)
        )
        lm = engine.lm
        count = lambda t: len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
        rows = []
        for size in sizes:
            folder = essay_corpus(home / f"essays-{size}", size, count)
            ing = engine.ingest(str(folder), name=f"essays{size}")
            path = Path(ing.path)

            def cag_ttft():
                engine.evict()  # not resident: the snapshot is read from its file
                engine.kept.clear()  # and the question prefilled (no kept conversation's K/V reused)
                return engine.answer(Query(f"essays{size}", QUESTION, max_tokens=1))

            def full_ttft():
                return engine.answer(Query(f"essays{size}", QUESTION, max_tokens=1, mode="full"))

            t_cag, a_cag = timed(cag_ttft, args.repeat)
            t_full, a_full = timed(full_ttft, args.repeat)
            load_s, _ = timed(lambda: snapshots.load(path), args.repeat)
            raw_s, _ = timed(lambda: path.read_bytes(), args.repeat)
            nbytes = path.stat().st_size
            formula = snapshots.expected_bytes(lm.n_layers, lm.n_kv_heads, lm.head_dim, torch.float16, ing.n_tokens)

            first = lm.tokenizer.eos_token_id or 0
            dec_snap = step_decode_rate(lm.model, snapshots.load(path).kv, args.decode_tokens, first)
            empty = [(torch.empty(1, lm.n_kv_heads, 0, lm.head_dim),) * 2 for _ in range(lm.n_layers)]
            dec_empty = step_decode_rate(lm.model, empty, args.decode_tokens, first)

            ids = torch.tensor([snapshots.load(path).ids])
            n_nc = args.nocache_tokens
            t = time.perf_counter()
            lm.model.generate(ids, max_new_tokens=n_nc, min_new_tokens=n_nc, do_sample=False, use_cache=False)
            nocache_tps = n_nc / (time.perf_counter() - t)
            t = time.perf_counter()
            lm.model.generate(
                ids,
                max_new_tokens=args.decode_tokens,
                min_new_tokens=args.decode_tokens,
                do_sample=False,
                use_cache=True,
            )
            cache_tps = args.decode_tokens / (time.perf_counter() - t)

            rows.append({
                "target_tokens": size, "n_tokens": ing.n_tokens, "prefill_ms": ing.prefill_ms,
                "prefill_tok_s": ing.n_tokens / (ing.prefill_ms / 1e3),
                "ttft_cag_ms": a_cag.ttft_ms, "ttft_full_ms": a_full.ttft_ms,
                "ttft_cag_wall_ms": t_cag * 1e3, "ttft_full_wall_ms": t_full * 1e3,
                "ttft_speedup": t_full / t_cag, "same_first_token": a_cag.token_ids == a_full.token_ids,
                "load_ms": load_s * 1e3, "raw_read_ms": raw_s * 1e3, "load_vs_raw": raw_s / load_s,
                "bytes": nbytes, "formula_bytes": formula, "bytes_over_formula": nbytes / formula - 1,
                "decode_tok_s_snapshot": dec_snap, "decode_tok_s_empty": dec_empty,
                "decode_ratio": dec_snap / dec_empty,
                "generate_tok_s_use_cache_false": nocache_tps, "generate_tok_s_use_cache_true": cache_tps,
            })
            print(rows[-1], flush=True)

    head = (
        f"Machine: {machine()}. Model: {lm.name}, {args.dtype} weights, fp16 snapshots. Median of {args.repeat}.\n\n"
        "| prefix tokens | prefill tok/s | TTFT cag ms | TTFT full ms | speedup | load ms | raw read ms | load/raw | "
        "bytes vs formula | decode tok/s snap / empty | ratio | generate tok/s cache off / on |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['n_tokens']} | {r['prefill_tok_s']:.0f} | {r['ttft_cag_wall_ms']:.0f} | {r['ttft_full_wall_ms']:.0f} | "
        f"**{r['ttft_speedup']:.0f}x** | {r['load_ms']:.1f} | {r['raw_read_ms']:.1f} | {r['load_vs_raw']:.2f} | "
        f"{100 * r['bytes_over_formula']:+.2f}% | {r['decode_tok_s_snapshot']:.1f} / {r['decode_tok_s_empty']:.1f} | "
        f"{r['decode_ratio']:.2f} | {r['generate_tok_s_use_cache_false']:.2f} / "
        f"{r['generate_tok_s_use_cache_true']:.1f} |\n"
        for r in rows
    )
    foot = (
        "\nTargets: TTFT speedup >= 50x at 4K and growing with size; load/raw >= 0.8; bytes within 1% of the formula; "
        "decode ratio >= 0.7.\nTTFT includes everything after the model is loaded: stale check, snapshot read + verify "
        "(cag) or tokenizing + prefilling the knowledge (full), question prefill, first token.\n"
    )
    name = "engine" if args.dtype == "float32" else f"engine-{args.dtype}"
    write(name, {"machine": machine(), "dtype": args.dtype, "rows": rows}, head + body + foot)


if __name__ == "__main__":
    main()
