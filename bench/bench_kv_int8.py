"""Answer agreement of int8 snapshots with fp16 ones (CAG_KV_DTYPE=int8 vs float16).

The same model, corpus, questions and greedy decoding (32 tokens); only the snapshot's storage
differs. Reports the share of questions whose first 32 answer tokens are identical, the first
token where they part otherwise, and F1 (SQuAD v1.1 definition) of each with a 95% bootstrap
interval and the paired difference. Sets: corpora/handbook (its 20 written questions) and,
with --squad N, N SQuAD v1.1 dev questions over knowledge sets of --squad-tokens tokens.

    python -m bench.bench_kv_int8 [--squad 100] [--squad-tokens 4000] [--base float16] [--weights auto]

--attention times the decode attention alone instead (cag's avx512 kernel, no model): one request's
--rows query rows per K/V head over a --prefix-key prefix of --kv-heads heads, per head width of --dims,
read as the int8 codes (pair_kv8) and as the bf16 kernel reads the dequantized K/V where no codes are
read (pair_kv's pairs). --layers such prefixes, a call per layer in turn, so that each call reads its
K/V from memory as a decode step does; ms per call, best of --rounds runs, the two alternating call by call.

    python -m bench.bench_kv_int8 --attention [--dims 64,80] [--prefix 4096] [--kv-heads 8] [--name kv-int8-speed]

With cag's avx512 kernels (CAG_DECODE_KERNELS, auto on AVX512-BF16 CPUs without AMX) decode rows read an
int8 snapshot's codes as stored (q quantized to int8 per block of 32 for the scores); elsewhere the codes are
dequantized on load.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.common import REPO, machine, write
from cag.answering.query import Query

MAX_TOKENS = 32


def _engines(root: Path, base: str, weights: str):
    from cag.config import get_settings
    from cag.engine import Engine

    fp16 = Engine(get_settings(home=root / "base", kv_dtype=base, weights=weights))
    int8 = Engine(get_settings(home=root / "int8", kv_dtype="int8", weights=weights), lm=fp16.lm)
    return fp16, int8


def _squad_sets(lm, n: int, size: int) -> list[tuple[Path, list[dict]]]:
    from cag.compare.datasets import load_corpus
    from cag.compare.knowledge_sets import knowledge_sets_from_corpus

    corpus = load_corpus("squad", None)
    count = lambda text: len(lm.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    out, seen, seed = [], set(), 0
    root = Path(tempfile.mkdtemp(prefix="squad-int8-"))
    while sum(len(q) for _, q in out) < n and seed < 20:
        (ks,) = knowledge_sets_from_corpus(corpus, [size], count, n, seed)
        qs = [q for q in ks.questions if q.qid not in seen][: n - sum(len(q) for _, q in out)]
        seen |= {q.qid for q in qs}
        folder = root / f"seed-{seed}"
        folder.mkdir()
        for i, d in enumerate(ks.docs):
            (folder / f"{i:03d}.txt").write_text(f"{d.title}\n\n{d.text}\n")
        out.append((folder, [{"question": q.question, "answers": q.answers} for q in qs]))
        seed += 1
    return out


def _run(fp16, int8, sets: list[tuple[Path, list[dict]]], label: str) -> dict:
    from cag.compare.metrics import f1
    from cag.compare.stats import bootstrap

    rows = []
    for i, (folder, questions) in enumerate(sets):
        name = f"{label}-{i}"
        for eng in (fp16, int8):
            eng.ingest(str(folder), name=name)
        for q in questions:
            a = fp16.answer(Query(name, q["question"], max_tokens=MAX_TOKENS))
            b = int8.answer(Query(name, q["question"], max_tokens=MAX_TOKENS))
            same = a.token_ids == b.token_ids
            split = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                         None if same else min(len(a.token_ids), len(b.token_ids)))
            rows.append({"question": q["question"], "identical": same, "first_difference": split,
                         "f1_fp16": f1(a.answer, q["answers"]), "f1_int8": f1(b.answer, q["answers"]),
                         "answer_fp16": a.answer, "answer_int8": b.answer})
    n = len(rows)
    ident = sum(r["identical"] for r in rows)
    f_a, f_b = [r["f1_fp16"] for r in rows], [r["f1_int8"] for r in rows]
    ci = lambda v: dict(zip(("mean", "lo", "hi"), (lambda e: (e.value, e.lo, e.hi))(bootstrap(v))))  # noqa: E731
    return {"set": label, "n": n, "identical": ident, "identical_share": ident / n if n else None,
            "f1_fp16": ci(f_a), "f1_int8": ci(f_b), "f1_paired_diff": ci([y - x for x, y in zip(f_a, f_b)]),
            "rows": rows}


def attention_times(dims: list[int], n: int, heads: int, rows: int, layers: int, rounds: int) -> list[dict]:
    """Per head width: ms per decode attention call over the int8 codes and over the dequantized K/V in
    bf16 (pre-paired, as the engine serves a prefix whose codes are not read), best of `rounds` runs
    of both, each run one call per layer over `layers` prefixes of n keys, the two alternating."""
    import torch

    from cag.kernels import backends, native
    from cag.store import kv_int8

    if native.load() is None:
        raise SystemExit(f"cag's kernels cannot run here: {native.reason()}")
    op, g, out = backends.AVX512.attention_kernel, torch.Generator().manual_seed(0), []
    for d in dims:
        q = torch.randn(1, heads, rows, d, generator=g)
        ks, vs = (torch.randn(1, heads, 64, d, generator=g).bfloat16() for _ in range(2))  # a 1-key suffix
        slots, lens = torch.tensor([0]), torch.tensor([1])
        made = {"int8": [], "bf16": []}
        for _ in range(layers):
            codes = [
                kv_int8.quantize(torch.randn(1, heads, n, d, generator=g) * s, kv_int8.block_for(d)) for s in (2, 1)
            ]
            kd, vd = (kv_int8.dequantize(c, sc, torch.bfloat16)[0].contiguous() for c, sc in codes)
            made["int8"].append((kd, vd, *torch.ops.cag.pair_kv8(*(x[0].contiguous() for pair in codes for x in pair))))
            made["bf16"].append((kd, vd, *torch.ops.cag.pair_kv(kd, vd)))
        best = dict.fromkeys(made, float("inf"))
        for i in range(rounds):  # the two alternate call by call (which first, by round): the same load on both
            took = dict.fromkeys(made, 0.0)
            for layer in range(layers):
                for kind in (("int8", "bf16") if i % 2 else ("bf16", "int8")):
                    kd, vd, kt, vt = made[kind][layer]
                    t = time.perf_counter()
                    op(q, kd, vd, ks, vs, slots, lens, d ** -0.5, kt, vt)
                    took[kind] += time.perf_counter() - t
            best = {kind: min(best[kind], took[kind] / layers) for kind in made}
        read = {kind: per_layer[0][2].nbytes + per_layer[0][3].nbytes for kind, per_layer in made.items()}
        out.append({"head_dim": d, "prefix": n, "kv_heads": heads, "rows": rows, "layers": layers,
                    "ms_int8": 1e3 * best["int8"], "ms_bf16": 1e3 * best["bf16"], "bytes_int8": read["int8"],
                    "bytes_bf16": read["bf16"], "bf16_over_int8": best["bf16"] / best["int8"]})
    return out


def attention_main(args) -> None:
    t0 = time.time()
    rows = attention_times([int(d) for d in args.dims.split(",")], args.prefix, args.kv_heads, args.rows, args.layers,
                           args.rounds)
    lines = [
        "| head dim | prefix keys x K/V heads | query rows a head | int8 codes ms (MB) | bf16 kernel on dequantized "
        "K/V ms (MB) | bf16 / int8 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['head_dim']} | {r['prefix']} x {r['kv_heads']} | {r['rows']} | {r['ms_int8']:.3f} "
                     f"({r['bytes_int8'] / 1e6:.1f}) | {r['ms_bf16']:.3f} ({r['bytes_bf16'] / 1e6:.1f}) | "
                     f"{r['bf16_over_int8']:.2f}x |")
    table = (
        "\n".join(lines) + f"\n\n{machine()}; decode attention alone (cag's avx512 kernel), ms per call, one call per "
        f"layer over {args.layers} layers' prefixes, best of {args.rounds} runs, the two alternating call by call; "
        f"{time.time() - t0:.0f} s\n"
    )
    write(args.name, {"machine": machine(), "rounds": args.rounds, "rows": rows}, table)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--squad", type=int, default=0, help="SQuAD v1.1 dev questions (0: handbook only)")
    ap.add_argument("--squad-tokens", type=int, default=4000)
    ap.add_argument("--base", default="float16", help="the snapshot dtype int8 is compared with (CAG_KV_DTYPE)")
    ap.add_argument("--weights", default="auto", help="CAG_WEIGHTS of both engines")
    ap.add_argument("--name", default=None, help="results file name in bench/results (default kv-int8, kv-int8-speed)")
    ap.add_argument("--attention", action="store_true", help="time the decode attention alone, int8 codes vs bf16")
    ap.add_argument("--dims", default="64,80", help="--attention: head widths")
    ap.add_argument("--prefix", type=int, default=4096, help="--attention: prefix keys")
    ap.add_argument("--kv-heads", type=int, default=8, help="--attention: K/V heads")
    ap.add_argument("--rows", type=int, default=4, help="--attention: query rows per K/V head (query heads sharing it)")
    ap.add_argument(
        "--layers", type=int, default=16, help="--attention: prefixes called in turn (their K/V not in cache)"
    )
    ap.add_argument("--rounds", type=int, default=25, help="--attention: alternating runs (best of)")
    args = ap.parse_args()
    if args.attention:
        args.name = args.name or "kv-int8-speed"
        return attention_main(args)
    args.name = args.name or "kv-int8"
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        fp16, int8 = _engines(Path(tmp), args.base, args.weights)
        hb = REPO / "corpora" / "handbook"
        questions = [json.loads(line) for line in (hb / "questions.jsonl").read_text().splitlines() if line.strip()]
        results = [_run(fp16, int8, [(hb, questions)], "handbook")]
        if args.squad:
            results.append(_run(fp16, int8, _squad_sets(fp16.lm, args.squad, args.squad_tokens), "squad"))
    b = args.base
    lines = [f"| set | n | first 32 tokens identical | F1 {b} [95% CI] | F1 int8 [95% CI] | paired int8 - {b} |",
             "|---|---|---|---|---|---|"]
    ci = lambda c: f"{c['mean']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}]"  # noqa: E731
    for r in results:
        lines.append(f"| {r['set']} | {r['n']} | {r['identical']}/{r['n']} ({100 * r['identical_share']:.0f}%) | "
                     f"{ci(r['f1_fp16'])} | {ci(r['f1_int8'])} | {ci(r['f1_paired_diff'])} |")
    lm = fp16.lm
    setup = (f"weights {lm.weights}, decode kernels {lm.kernels} (int8 snapshots: "
             f"{'decode rows read the codes' if lm.kernels == 'avx512' else 'dequantized on load'})")
    table = "\n".join(lines) + f"\n\n{machine()}; {setup}; {time.time() - t0:.0f} s\n"
    print(table)
    write(args.name, {"machine": machine(), "max_tokens": MAX_TOKENS, "base": b, "weights": lm.weights,
                      "kernels": lm.kernels, "results": results}, table)


if __name__ == "__main__":
    main()
