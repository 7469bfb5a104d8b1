"""Decode speed per weights format, next to its physical bound, measured side by side in one run.

For snapshots of about 1K, 2K, 4K and 7K tokens (Paul Graham essays), for each CAG_WEIGHTS format:
  * decode tokens/s over the snapshot (stop tokens ignored);
  * the physical bound: the time to read, once, the bytes one decode step must read (the weights
    in that format + the request buffer's keys and values up to that length), at the read
    bandwidth measured in this run (best of a float32 sum over a 512 MB buffer, same threads);
  * the step split: the weight products alone (every decode-row product of the model, timed
    apart) vs everything else (attention over the cache, norms, rope, sampling, Python).
The snapshot is the same for every format (prefill never uses the packed weights).
Writes bench/results/decode.json and decode.md.  Run: `python -m bench.bench_decode`.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch

from cag import kv, weights
from cag.config import get_settings
from cag.engine import Engine
from cag.generate import DecodeConfig, decode

from .common import essay_corpus, machine, write


def read_bandwidth(reps: int = 5) -> float:
    """Bytes/s of reading memory once (a sum over 512 MB of float32, best of `reps`)."""
    buf = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best


def decode_rate(model, cache, start: int, n: int, first: int) -> float:
    logits = kv.prefill(model, cache, [first], start)
    t = time.perf_counter()
    out = list(decode(model, cache, logits, start + 1, DecodeConfig(max_tokens=n), stops=set()))
    return len(out) / (time.perf_counter() - t)


def products_ms(model, reps: int = 5) -> float:
    """One decode step's weight products alone: every linear of the model on one row, best of reps."""
    lins = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, weights.FastLinear))]
    dtype = next(model.parameters()).dtype
    xs = [torch.randn(1, 1, m.in_features, dtype=dtype) for m in lins]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            t = time.perf_counter()
            for m, x in zip(lins, xs):
                m(x)
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def weight_bytes(model) -> int:
    """Bytes a decode step reads for its products: packed copies where there are any, else the weight."""
    total = 0
    for m in model.modules():
        if isinstance(m, weights.FastLinear):
            total += sum(t.nbytes for t in (m.packed if isinstance(m.packed, tuple) else (m.packed,)))
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.nbytes
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1000,2000,4000,7000")
    ap.add_argument("--formats", default="fp32,bf16,int8,int4")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    formats = [f for f in args.formats.split(",") if f]

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        engine = Engine(get_settings(home=home / "home", models_dir_override=get_settings().models_dir, weights="fp32"))
        lm = engine.lm
        models = {}
        for fmt in formats:
            models[fmt] = lm.model if fmt == "fp32" else copy.deepcopy(lm.model)
            weights.apply(models[fmt], fmt)
        auto = weights.choose(lm.model, "auto")
        bw = read_bandwidth()
        prod = {fmt: products_ms(m) for fmt, m in models.items()}
        count = lambda t: len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
        first = lm.tokenizer.eos_token_id or 0
        rows = []
        for size in sizes:
            ing = engine.ingest(str(essay_corpus(home / f"essays-{size}", size, count)), name=f"essays{size}")
            snap = engine.open_snapshot(engine.index.snapshot(ing.snapshot))
            cache_bytes = lm.kv_bytes(ing.n_tokens)  # the request buffer is in the compute dtype
            for fmt, model in models.items():
                cache = kv.new_cache(model, ing.n_tokens + engine.room)
                kv.load_into(cache, snap.kv, lm.dtype)
                tps = decode_rate(model, cache, ing.n_tokens, args.decode_tokens, first)
                step_ms = 1e3 / tps
                wbytes = weight_bytes(model)
                bound_ms = (wbytes + cache_bytes) / bw * 1e3
                rows.append({"n_tokens": ing.n_tokens, "weights": fmt, "decode_tok_s": tps, "step_ms": step_ms,
                             "weight_bytes": wbytes, "cache_bytes": cache_bytes, "bound_ms": bound_ms,
                             "step_over_bound": step_ms / bound_ms, "products_ms": prod[fmt],
                             "rest_ms": step_ms - prod[fmt]})
                print(rows[-1], flush=True)
            for r in rows[-len(models):]:
                r["vs_fp32"] = r["decode_tok_s"] / next(x["decode_tok_s"] for x in rows[-len(models):] if x["weights"] == "fp32")

    head = (f"Machine: {machine()}. Model: {lm.name}, {lm.dtype} compute, read bandwidth {bw / 1e9:.1f} GB/s "
            f"(measured in this run). `auto` picks **{auto}** here. {args.decode_tokens} tokens per rate.\n\n"
            "| prefix tokens | weights | decode tok/s | vs fp32 | step ms | bound ms (weights + cache read once) | step / bound | weight products ms | rest ms |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['n_tokens']} | {r['weights']} | {r['decode_tok_s']:.1f} | {r['vs_fp32']:.2f}x | {r['step_ms']:.1f} | "
        f"{r['bound_ms']:.1f} ({r['weight_bytes'] / 1e6:.0f} + {r['cache_bytes'] / 1e6:.0f} MB) | {r['step_over_bound']:.2f} | "
        f"{r['products_ms']:.1f} | {r['rest_ms']:.1f} |\n" for r in rows)
    foot = ("\nTargets: with the `auto` format, step within 1.5x of the bound at 4K and decode >= 1.5x fp32 at 4K. "
            "'rest' is a decode step less its weight products: attention over the cache, norms, rope, sampling and "
            "the Python of 30 layers.\n")
    write("decode", {"machine": machine(), "auto": auto, "read_bandwidth": bw, "rows": rows}, head + body + foot)


if __name__ == "__main__":
    main()
