"""Decode speed per weights format, next to its physical bound, measured side by side in one run.

For snapshots of about 1K, 2K, 4K and 7K tokens (Paul Graham essays), for each CAG_WEIGHTS format:
  * decode tokens/s over the snapshot (stop tokens ignored);
  * the physical bound: the time to read, once, the bytes one decode step must read (the weights
    in that format + the request buffer's keys and values up to that length), at the read
    bandwidth measured in this run (best of a float32 sum over a 512 MB buffer, same threads), and
    the issue's own measure beside it: a timed copy of that many bytes (512 MB copied, best rate);
  * with cag's avx512 kernels, the same step again over the prefix's int8 codes (CAG_KV_DTYPE=int8:
    about half the K/V bytes; --no-int8-kv skips it);
  * the step split: the weight products alone (every decode-row product of the model, timed
    apart) vs everything else (attention over the cache, norms, rope, sampling, Python);
  * the same decode through the transformers forward over a StaticCache (the path of models
    cag/runtime/step.py does not cover), measured alternately with the step, side by side in one run;
  * packed formats once per decode kernels setting (--kernels): cag's own (cag/kernels/native.py: attention
    on AMX tiles or by AVX512-BF16 dot products, int4/bf16 products, fused norm and rope) where they
    run here, and torch's, side by side.
The snapshot is the same for every format (prefill never uses the packed weights).
Writes bench/results/decode.json and decode.md.  Run: `python -m bench.bench_decode`.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
from pathlib import Path

import torch

from cag.config import get_settings
from cag.engine import Engine
from cag.kernels import backends, native
from cag.knowledge import verify
from cag.model import auto_weights, packed, weights
from cag.model.loading import attn_dtype
from cag.runtime import kv_cache
from cag.runtime import step as lean
from cag.runtime.generate import DecodeConfig, decode

from .common import essay_corpus, machine, step_decode_rate, write


def read_bandwidth(reps: int = 5) -> float:
    """Bytes/s of reading memory once (a sum over 512 MB of float32, best of `reps`)."""
    buf = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best


def copy_bandwidth(reps: int = 5) -> float:
    """Bytes/s of a timed copy (512 MB float32 into another buffer, best of `reps`): the issue's measure of
    the bound, beside the read above (a copy also writes what it reads, so it is the looser of the two)."""
    src, dst = torch.ones(128 * 1024 * 1024), torch.empty(128 * 1024 * 1024)
    dst.copy_(src)  # pages touched
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.nbytes / best


def forward_rate(model, cache, start: int, n: int, first: int) -> float:
    """Tokens/s of decode through the transformers forward over a StaticCache holding the prefix (the
    path of models cag/runtime/step.py does not cover): n-1 timed steps after a 1-token prompt."""
    logits = kv_cache.prefill(model, cache, [first], start)
    t = time.perf_counter()
    out = list(decode(model, cache, logits, start + 1, DecodeConfig(max_tokens=n), stops=set()))
    return (len(out) - 1) / (time.perf_counter() - t)


def paired_rates(model, cache, prefix_kv, start: int, n: int, first: int, rounds: int = 2) -> tuple[float, float]:
    """Best lean-step and best forward rate over `rounds` alternating runs (noise hits both alike)."""
    best = {True: 0.0, False: 0.0}
    for r in range(rounds):
        for use_lean in ((True, False) if r % 2 == 0 else (False, True)):
            rate = (
                step_decode_rate(model, prefix_kv, n, first)
                if use_lean
                else forward_rate(model, cache, start, n, first)
            )
            best[use_lean] = max(best[use_lean], rate)
    return best[True], best[False]


def products_ms(model, reps: int = 5) -> float:
    """One decode step's weight products alone, one row, as the lean step calls them (q/k/v and
    gate/up in one call each where their packed weights are stacked) plus the LM head, best of reps."""
    step, c = lean.for_model(model), model.config
    dtype = next(model.parameters()).dtype
    x, xo, xd = (torch.randn(1, n, dtype=dtype) for n in (c.hidden_size, step.head_dim * c.num_attention_heads,
                                                        c.intermediate_size))
    calls = [(f, v) for ly in step.fns for f, v in ((ly.qkv, x), (ly.o, xo), (ly.gate_up, x), (ly.down, xd))]
    calls.append((step.head, x))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            t = time.perf_counter()
            for f, v in calls:
                f(v)
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def weight_bytes(model) -> int:
    """Bytes a decode step reads for its products: packed copies where there are any (each stacked
    group once; bf16: its few-rows layout), else the weight."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, weights.FastLinear) and id(m.packs) not in seen:
            seen.add(id(m.packs))
            total += packed.packed_bytes(m.packs.packed)
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.nbytes
    return total


def vs_fp32(rows: list[dict]) -> None:
    """Each row's decode rate over the fp32 row's (one prefix size); None without an fp32 row
    (`--formats int4`)."""
    base = next((r["decode_tok_s"] for r in rows if r["weights"] == "fp32" and "kv" not in r), None)
    for r in rows:
        r["vs_fp32"] = r["decode_tok_s"] / base if base else None


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1000,2000,4000,7000")
    ap.add_argument("--formats", default="fp32,bf16,int8,int4")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating lean/forward runs per cell (best of)")
    ap.add_argument("--kernels", default="amx,avx512,avx2,torch",
                    help="CAG_DECODE_KERNELS settings for the packed formats (those that run here; avx2: int4 alone)")
    ap.add_argument("--no-int8-kv", dest="int8_kv", action="store_false",
                    help="skip the rows over int8 K/V (CAG_KV_DTYPE=int8, read by the avx512 kernels)")
    ap.add_argument("--name", default="decode", help="results file name in bench/results (a partial run: another name)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    sizes = [int(s) for s in args.sizes.split(",")]
    formats = [f for f in args.formats.split(",") if f]

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        engine = Engine(get_settings(home=home / "home", models_dir_override=get_settings().models_dir, weights="fp32"))
        lm = engine.lm
        models = {}  # (format, decode kernels) -> model
        here = lambda k: (  # noqa: E731
            k == "torch"
            or (native.load_avx2() if k == "avx2" else native.load() is not None and (k == "avx512" or native.tiles()))
        )
        kernels = [k for k in args.kernels.split(",") if here(k)]
        for fmt in formats:
            # avx2: int4's products
            for ker in ["torch"] if fmt == "fp32" else [k for k in kernels if k != "avx2" or fmt == "int4"]:
                m = lm.model if fmt == "fp32" else copy.deepcopy(lm.model)  # cag's products pack their own layout
                weights.apply(m, fmt, backends.BY_NAME[ker])
                backends.attach(m, backends.BY_NAME[ker])
                models[fmt, ker] = m
        # the verdict a server here uses (cached)
        auto = auto_weights.choose(lm.model, "auto", get_settings().models_dir)
        bw, cbw = read_bandwidth(), copy_bandwidth()
        # Products (and the bandwidth) are timed again next to every decode cell and the best kept:
        # one load spike at the start must not stand for the whole run.
        prod = {key: products_ms(m) for key, m in models.items()}
        count = lambda t: len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
        first = lm.tokenizer.eos_token_id or 0
        rows = []
        for size in sizes:
            ing = engine.ingest(str(essay_corpus(home / f"essays-{size}", size, count)), name=f"essays{size}")
            snap = verify.open_snapshot(engine.snapshots(), engine.index.snapshot(ing.snapshot))
            for (fmt, ker), model in models.items():
                cache = kv_cache.new_cache(model, ing.n_tokens + engine.room)
                kv_cache.load_into(cache, snap.kv, lm.dtype)
                assert lean.why_not(model) is None, lean.why_not(model)
                tps, fwd = paired_rates(model, cache, snap.kv, ing.n_tokens, args.decode_tokens, first, args.rounds)
                prod[fmt, ker] = min(prod[fmt, ker], products_ms(model))
                rows.append(
                    {
                        "n_tokens": ing.n_tokens,
                        "weights": fmt,
                        "kernels": ker,
                        "decode_tok_s": tps,
                        "step_ms": 1e3 / tps,
                        "weight_bytes": weight_bytes(model),
                        "forward_tok_s": fwd,
                        # the prefix and request buffer, in the dtype the step attends in (bf16 with packed weights)
                        "cache_bytes": lm.kv_bytes(ing.n_tokens, attn_dtype(fmt, lm.dtype, lm.device)),
                        "lean_over_forward": tps / fwd,
                    }
                )
                print(rows[-1], flush=True)
                if ker == "avx512" and args.int8_kv:  # the same step over the prefix's int8 codes (CAG_KV_DTYPE=int8)
                    deq, codes = kv_cache.stored(snap.kv, torch.int8)  # what `cag` reads from an int8 snapshot
                    tps8 = max(
                        step_decode_rate(model, deq, args.decode_tokens, first, codes=codes) for _ in range(args.rounds)
                    )
                    int8_bytes = sum(t.nbytes for layer in codes for t in layer)
                    rows.append(
                        rows[-1]
                        | {
                            "kv": "int8",
                            "decode_tok_s": tps8,
                            "step_ms": 1e3 / tps8,
                            "cache_bytes": int8_bytes,
                            "lean_over_forward": tps8 / fwd,
                        }
                    )
                    print(rows[-1], flush=True)
            bw = max(bw, read_bandwidth(reps=3))
            cbw = max(cbw, copy_bandwidth(reps=3))
            vs_fp32([r for r in rows if r["n_tokens"] == ing.n_tokens])
        for r in rows:  # with the best products time and bandwidth of the whole run
            p = r["products_ms"] = prod[r["weights"], r["kernels"]]
            r["rest_ms"], r["forward_rest_ms"] = r["step_ms"] - p, 1e3 / r["forward_tok_s"] - p
            r["bound_ms"] = (r["weight_bytes"] + r["cache_bytes"]) / bw * 1e3
            r["step_over_bound"] = r["step_ms"] / r["bound_ms"]
            r["copy_bound_ms"] = (r["weight_bytes"] + r["cache_bytes"]) / cbw * 1e3
            r["step_over_copy"] = r["step_ms"] / r["copy_bound_ms"]

    head = (
        f"Machine: {machine()}. Model: {lm.name}, {lm.dtype} compute, read bandwidth {bw / 1e9:.1f} GB/s, copy "
        f"bandwidth {cbw / 1e9:.1f} GB/s of bytes copied (best of each measured in this run). `auto` picks **{auto}** "
        f"here. {args.decode_tokens} tokens per rate, best of {args.rounds} runs alternating the lean step and the "
        f"transformers forward. Load average (1, 5, 15 min) before / after: {load_before} / {os.getloadavg()}.\n\n"
        "| prefix tokens | weights | kernels | K/V | decode tok/s (lean step) | transformers forward tok/s | lean / "
        "forward | vs fp32 | step ms | bound ms (weights + cache read once) | step / bound | timed copy of those bytes "
        "ms | step / copy | weight products ms | rest ms (lean) | rest ms (forward) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['n_tokens']} | {r['weights']} | {r['kernels']} | {r.get('kv', 'as computed')} | {r['decode_tok_s']:.1f} "
        f"| {r['forward_tok_s']:.1f} | {r['lean_over_forward']:.2f}x | {_times(r['vs_fp32'])} | {r['step_ms']:.1f} | "
        f"{r['bound_ms']:.1f} ({r['weight_bytes'] / 1e6:.0f} + {r['cache_bytes'] / 1e6:.0f} MB) | "
        f"{r['step_over_bound']:.2f} | {r['copy_bound_ms']:.1f} | {r['step_over_copy']:.2f} | {r['products_ms']:.1f} | "
        f"{r['rest_ms']:.1f} | {r['forward_rest_ms']:.1f} |\n"
        for r in rows
    )
    foot = (
        "\nTargets: with the `auto` format, step within 1.5x of the bound at 4K and decode >= 1.5x fp32 at 4K. Two "
        "bounds: the bytes read once at the best read rate (a sum over 512 MB), and the issue's own measure, a timed "
        "copy of that many bytes (which also writes them: the looser one). K/V 'int8': the prefix's int8 codes "
        "(CAG_KV_DTYPE=int8) read by the avx512 attention, the forward column unchanged (it reads bf16). 'rest' is a "
        "decode step less its weight products: attention over the cache, norms, rope, sampling and the Python of 30 "
        "layers; the lean step (cag/runtime/step.py) cuts the forward's per-layer Python, mask and cache bookkeeping. "
        "The products are timed as separate calls, each with its own overhead: int4 on cag's kernels runs all layers "
        "of a step in one call (cag/runtime/all_layers.py), so there 'rest' is what the step takes beyond those "
        "separate calls.\n"
    )
    write(
        args.name,
        {
            "machine": machine(),
            "auto": auto,
            "read_bandwidth": bw,
            "copy_bandwidth": cbw,
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "rows": rows,
        },
        head + body + foot,
    )


if __name__ == "__main__":
    main()
