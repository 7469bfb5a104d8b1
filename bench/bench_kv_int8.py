"""Answer agreement of int8 snapshots with fp16 ones (CAG_KV_DTYPE=int8 vs float16).

The same model, corpus, questions and greedy decoding (32 tokens); only the snapshot's storage
differs. Reports the share of questions whose first 32 answer tokens are identical, the first
token where they part otherwise, and F1 (SQuAD v1.1 definition) of each with a 95% bootstrap
interval and the paired difference. Sets: corpora/handbook (its 20 written questions) and,
with --squad N, N SQuAD v1.1 dev questions over knowledge sets of --squad-tokens tokens.

    python -m bench.bench_kv_int8 [--squad 100] [--squad-tokens 4000] [--base float16] [--weights auto]

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

MAX_TOKENS = 32


def _engines(root: Path, base: str, weights: str):
    from cag.config import get_settings
    from cag.engine import Engine

    fp16 = Engine(get_settings(home=root / "base", kv_dtype=base, weights=weights))
    int8 = Engine(get_settings(home=root / "int8", kv_dtype="int8", weights=weights), lm=fp16.lm)
    return fp16, int8


def _squad_sets(lm, n: int, size: int) -> list[tuple[Path, list[dict]]]:
    from cag.compare.datasets import knowledge_sets_from_corpus, load_corpus

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
            a = fp16.ask(name, q["question"], max_tokens=MAX_TOKENS)
            b = int8.ask(name, q["question"], max_tokens=MAX_TOKENS)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--squad", type=int, default=0, help="SQuAD v1.1 dev questions (0: handbook only)")
    ap.add_argument("--squad-tokens", type=int, default=4000)
    ap.add_argument("--base", default="float16", help="the snapshot dtype int8 is compared with (CAG_KV_DTYPE)")
    ap.add_argument("--weights", default="auto", help="CAG_WEIGHTS of both engines")
    ap.add_argument("--name", default="kv-int8", help="results file name in bench/results")
    args = ap.parse_args()
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
