"""All decoder layers of a decode step in one native call against the same layers as separate native calls,
side by side: per shape and per decode kernels (AVX-512, AVX2), one request's decode tok/s each way over a prefix
of --prefix tokens, alternating --rounds times (best of each), beside the read bound of the step (the packed
weights' bytes and the prefix's K/V read once at the read rate measured in the same run).

The two ways compute the same bits (tests/test_native.py): what differs is the cost of ~13 torch calls and 5
parallel regions a layer against one parallel region for the step. Random-weight models of bench.bench_models'
shapes (built once into --work), int4 weights, a random bf16 prefix.
Writes bench/results/<name>.{json,md}. Run: `python -m bench.bench_one_call --shapes qwen2.5-0.5b --kernels avx2`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from .common import machine, step_decode_rate, write


def measure(folder: Path, kernels: str, prefix: int, tokens: int, rounds: int, bw: float) -> dict:
    import torch

    from cag.config import get_settings
    from cag.engine import Engine
    from cag.runtime import step as lean

    os.environ |= {"CAG_MODEL": str(folder), "CAG_WEIGHTS": "int4", "CAG_DECODE_KERNELS": kernels}
    lm = Engine(get_settings()).lm
    step = lean.for_model(lm.model)
    if step is None or step.fused is None:
        raise SystemExit(f"{folder.name} on {kernels}: no one-call layers here ({lean.why_not(lm.model)})")
    cfg = lm.model.config
    g = torch.Generator().manual_seed(0)
    kv = [tuple(torch.randn(1, cfg.num_key_value_heads, prefix, lm.head_dim, generator=g).bfloat16() for _ in "kv")
          for _ in range(cfg.num_hidden_layers)]
    fused, rates = step.fused, {"one call": [], "separate": []}
    for _ in range(rounds):
        for way in rates:
            step.fused = fused if way == "one call" else None
            rates[way].append(step_decode_rate(lm.model, kv, tokens, first=7))
    step.fused = fused
    step_bytes = lm.packed_bytes + lm.kv_bytes(prefix, torch.bfloat16)
    best = {w: max(r) for w, r in rates.items()}
    return {"kernels": kernels, "one_call_tok_s": best["one call"], "separate_tok_s": best["separate"],
            "bound_tok_s": bw / step_bytes, "rounds": rates}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b", help="bench.bench_models shapes, comma-separated")
    ap.add_argument("--kernels", default="avx2,avx512", help="CAG_DECODE_KERNELS values (those that run here)")
    ap.add_argument("--prefix", type=int, default=1024, help="prefix tokens (random bf16 K/V)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens decoded per timed run")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs of each way (best of)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "cag-bench-models")
    ap.add_argument("--name", default="one-call")
    a = ap.parse_args()

    from bench.bench_decode import read_bandwidth
    from bench.bench_models import build
    from cag.kernels import native

    os.environ["CAG_HOME"] = tempfile.mkdtemp(prefix="home-", dir=a.work.parent)
    os.environ["CAG_MODELS_DIR"] = str(a.work / "models")
    runs = []
    bw = read_bandwidth()
    for shape in a.shapes.split(","):
        folder = build(shape, a.work)
        for kernels in a.kernels.split(","):
            why = native.avx2_why_not() if kernels == "avx2" else native.why_not()
            if why:
                print(f"{kernels}: skipped ({why})")
                continue
            r = {"shape": shape, **measure(folder, kernels, a.prefix, a.tokens, a.rounds, bw)}
            runs.append(r)
            print(f"{shape} {kernels}: one call {r['one_call_tok_s']:.1f} tok/s, separate {r['separate_tok_s']:.1f}, "
                  f"bound {r['bound_tok_s']:.0f}", flush=True)
    lines = [f"Machine: {machine()}; read rate {bw / 1e9:.1f} GB/s; int4 weights, one request over a "
             f"{a.prefix}-token prefix, {a.tokens} tokens a run, best of {a.rounds} alternating runs.", "",
             "| shape | kernels | one call tok/s | separate tok/s | one call / separate | read bound tok/s | "
             "bound / one call |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['shape']} | {r['kernels']} | {r['one_call_tok_s']:.1f} | {r['separate_tok_s']:.1f} | "
                     f"{r['one_call_tok_s'] / r['separate_tok_s']:.2f}x | {r['bound_tok_s']:.0f} | "
                     f"{r['bound_tok_s'] / r['one_call_tok_s']:.1f}x |")
    write(a.name, {"machine": machine(), "read_rate": bw, "prefix": a.prefix, "runs": runs}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
