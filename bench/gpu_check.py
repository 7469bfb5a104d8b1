"""The GPU check: one script, a few minutes end to end, against whatever torch/transformers the
machine has (it prints their versions first).

On the device (CUDA when torch sees one, else the CPU, said so): ingest a ~7K-token corpus with the
model, answer N questions in `cag` and `full` mode (the tokens must be identical), and report
prefill tokens/s, TTFT cag vs full, whether the questions asked together answer as alone, snapshot load GB/s (file -> checksum -> device) next to the
device's own copy bandwidth measured in the same run, and decode tokens/s (on a resident prefix,
with CUDA graphs and without, and for the first question on a freshly loaded one).

  python -m bench.gpu_check [--model M] [--tokens 7000] [--questions 4] [--device auto|cpu|cuda] [--out DIR]

Writes gpu_check.json and gpu_check.md to --out (default: $OUT when set, else bench/results).
Exit 0 when every answer agreed (cag == full, and batched == alone), 1 when one did not, 2 when the run itself failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

QUESTIONS = [
    "What does the author say about startups?",
    "Why do hackers like hard problems?",
    "What is the advice about doing what you love?",
    "What does the author think about cities?",
    "How should you choose what to work on?",
    "What is said about wealth?",
]


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy of `nbytes` (best of 5)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def run(args) -> dict:
    import torch
    import transformers

    from cag.config import get_settings
    from cag.engine import Engine

    from .common import essay_corpus

    report: dict = {"torch": torch.__version__, "transformers": transformers.__version__,
                    "cuda_available": torch.cuda.is_available(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    print(f"torch {report['torch']}, transformers {report['transformers']}, gpu: {report['gpu'] or 'none'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        over = {"home": home / "home", "device": args.device, "models_dir_override": get_settings().models_dir}
        if args.model:
            over["model"] = args.model
        engine = Engine(get_settings(**over))
        lm = engine.lm
        report.update(device=str(lm.device), dtype=str(lm.dtype), weights=lm.weights, model=lm.name)
        if args.device == "auto" and lm.device.type == "cpu":
            print("no CUDA device: the check runs on the CPU (the GPU figures are still to be measured)", flush=True)
        count = lambda t: len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
        ing = engine.ingest(str(essay_corpus(home / "corpus", args.tokens, count)), name="check")
        report.update(prefix_tokens=ing.n_tokens, prefill_ms=ing.prefill_ms, n_shards=ing.n_shards,
                      prefill_tok_s=ing.n_tokens / (ing.prefill_ms / 1e3), snapshot_bytes=ing.bytes)
        rows = []
        for q in QUESTIONS[: args.questions]:
            engine.evict()
            cag = engine.ask("check", q, max_tokens=args.max_tokens)
            full = engine.ask("check", q, max_tokens=args.max_tokens, mode="full")
            rows.append({"question": q, "identical": cag.token_ids == full.token_ids, "tokens": len(cag.token_ids),
                         "ttft_cag_ms": cag.ttft_ms, "ttft_full_ms": full.ttft_ms, "load_ms": cag.load_ms,
                         "decode_tok_s": cag.decode_tok_s})
            print(rows[-1], flush=True)
        # decode on a resident prefix (its CUDA graph captured by the first question), and the same
        # answers with each kernel launched from Python (CAG_CUDA_GRAPHS=false), side by side
        graphs = engine.decoder.graphs
        for r in rows:
            warm = engine.ask("check", r["question"], max_tokens=args.max_tokens)
            r.update(decode_tok_s_warm=warm.decode_tok_s)
            if graphs is not None:
                engine.decoder.graphs = None
                eager = engine.ask("check", r["question"], max_tokens=args.max_tokens)
                engine.decoder.graphs = graphs
                r.update(decode_tok_s_eager=eager.decode_tok_s, eager_identical=eager.token_ids == warm.token_ids)
            print({k: v for k, v in r.items() if "decode" in k or "eager" in k}, flush=True)
        if graphs is not None:  # one replayed step on the GPU alone, next to reading its bytes once
            prefix = engine.resident.values()[0].prefix
            graph = prefix.made["cuda_graph"][0]
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                graph.replay()  # rewrites the K/V of the position it was last given: a free slot's
            torch.cuda.synchronize()
            report.update(replay_ms=(time.perf_counter() - t) / 50 * 1e3,
                          step_bytes=sum(p.nbytes for p in lm.model.parameters()) + prefix.nbytes)
        # the same questions asked together (one batch per step) must answer as they did alone
        alone = [engine.ask("check", q, max_tokens=args.max_tokens).token_ids for q in QUESTIONS[: args.questions]]
        t = time.perf_counter()
        with ThreadPoolExecutor(args.questions) as pool:
            together = list(pool.map(lambda q: engine.ask("check", q, max_tokens=args.max_tokens).token_ids, QUESTIONS[: args.questions]))
        report.update(batched_identical=together == alone, batched_tok_s=sum(map(len, together)) / (time.perf_counter() - t))
        print(f"batched == alone: {together == alone}", flush=True)
        if engine.decoder.apart:  # why CUDA runs each request apart: the batch in one forward, as on the CPU
            engine.decoder.apart = False
            with ThreadPoolExecutor(args.questions) as pool:
                one = list(pool.map(lambda q: engine.ask("check", q, max_tokens=args.max_tokens).token_ids, QUESTIONS[: args.questions]))
            engine.decoder.apart = True
            report.update(one_forward_identical=one == alone)
            print(f"one forward for the batch == alone: {one == alone}", flush=True)
        engine.evict()
        row = engine.index.snapshot(ing.snapshot)
        dev = lm.device.type
        t = time.perf_counter()
        res = engine._load_resident(row["digest"])  # read, verify, move to the device
        if dev == "cuda":
            torch.cuda.synchronize()
        load_s = time.perf_counter() - t
        nbytes = res.prefix.nbytes  # what landed on the device, in the compute dtype
        report.update(host_to_device_gb_s=None)
        if dev == "cuda":  # pageable host memory to the device: the copy a snapshot load ends with
            host = torch.empty(nbytes, dtype=torch.uint8)
            t = time.perf_counter()
            host.to(dev)
            torch.cuda.synchronize()
            report.update(host_to_device_gb_s=nbytes / (time.perf_counter() - t) / 1e9)
        report.update(questions=rows, all_identical=all(r["identical"] for r in rows),
                      load_gb_s=nbytes / load_s / 1e9, device_copy_gb_s=copy_bandwidth(dev, nbytes) / 1e9,
                      ttft_cag_ms=sorted(r["ttft_cag_ms"] for r in rows)[len(rows) // 2],
                      ttft_full_ms=sorted(r["ttft_full_ms"] for r in rows)[len(rows) // 2],
                      decode_tok_s_cold=sorted((r["decode_tok_s"] or 0) for r in rows)[len(rows) // 2],
                      decode_tok_s=sorted((r["decode_tok_s_warm"] or 0) for r in rows)[len(rows) // 2],
                      decode_tok_s_eager=sorted((r.get("decode_tok_s_eager") or 0) for r in rows)[len(rows) // 2] or None)
    if "step_bytes" in report:  # reading the step's bytes once at the device's copy rate (a copy also writes them: generous)
        report["step_bound_ms"] = report["step_bytes"] / (report["device_copy_gb_s"] * 1e9) * 1e3
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: CAG_MODEL or the embedded one)")
    ap.add_argument("--tokens", type=int, default=7000)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        report = run(args)
    except Exception as e:  # noqa: BLE001 - a check script reports what broke, with its versions
        report = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(report["traceback"], file=sys.stderr)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    if "error" in report:
        sys.exit(2)
    md = (f"torch {report['torch']}, transformers {report['transformers']}, device {report['device']} "
          f"({report['gpu'] or 'no GPU'}), {report['dtype']}, weights {report['weights']}, model {report['model']}\n\n"
          f"| prefix tokens | prefill tok/s | TTFT cag / full (median) | load GB/s vs host-to-device / device copy GB/s | decode tok/s: resident prefix (eager), first question | cag == full | batched == alone (tok/s together) |\n"
          f"|---|---|---|---|---|---|---|\n"
          f"| {report['prefix_tokens']} | {report['prefill_tok_s']:.0f} | {report['ttft_cag_ms']:.0f} / "
          f"{report['ttft_full_ms']:.0f} ms | {report['load_gb_s']:.2f} vs {f'{h:.1f}' if (h := report['host_to_device_gb_s']) else '-'} / {report['device_copy_gb_s']:.1f} | "
          f"{report['decode_tok_s']:.1f}{f' ({e:.1f})' if (e := report['decode_tok_s_eager']) else ''}, {report['decode_tok_s_cold']:.1f} | {sum(r['identical'] for r in report['questions'])}/{len(report['questions'])} | "
          f"{report['batched_identical']} ({report['batched_tok_s']:.1f}) |\n")
    if report.get("replay_ms"):
        md += (f"\nOne decode step replayed alone: {report['replay_ms']:.2f} ms on the GPU; reading its "
               f"{report['step_bytes'] / 1e6:.0f} MB once at the copy rate: {report['step_bound_ms']:.2f} ms\n")
    (out / "gpu_check.md").write_text(md)
    print(md)
    sys.exit(0 if report["all_identical"] and report["batched_identical"] else 1)


if __name__ == "__main__":
    main()
