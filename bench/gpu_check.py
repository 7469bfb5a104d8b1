"""The GPU check: one script, a few minutes end to end, against whatever torch/transformers the
machine has (it prints their versions first); every figure beside the bound it is held to, the
bounds measured in the same run.

On the device (CUDA when torch sees one, else the CPU, said so), for the model (default: the embedded
SmolLM2-135M) and, on CUDA, a random 1B Llama shape built from its config (bench.bench_models):

- the device: its bf16 (the compute dtype's) GEMM rate, pinned and pageable host-to-device copies, a
  device-to-device copy;
- knowledge prefill of a ~7K-token corpus: tokens/s next to its matrix FLOPs at that GEMM rate, and
  at prefill chunks of 512, 2048 and the whole corpus;
- `cag` == `full` token for token on N questions;
- TTFT, median of 10 questions: on a resident prefix, and from the snapshot file (evicted before
  each); the snapshot load rate next to the pinned host-to-device rate;
- decoding one request: tokens/s with CUDA graphs and without, one replayed step next to reading
  its bytes once, the kernels (CUDA) and memory-writing ops of one step;
- 16 requests at once against one request (aggregate tokens/s), what the padded rows of a fixed-row
  step cost (CAG_DECODE_ROWS=W against 1, one request), and batched == alone on every token of a
  200-question run (SQuAD dev questions where CAG_DATASETS has them).

  python -m bench.gpu_check [--model M | --shape DIR] [--tokens 7000] [--questions 4] [--device auto|cpu|cuda]
                            [--no-1b] [--exact-questions N] [--budget SECONDS] [--out DIR]

Writes gpu_check.json and gpu_check.md to --out (default: $OUT when set, else bench/results), again
after every part, so a run cut off at a time limit leaves what it measured. Exit 0 when every answer
agreed (cag == full, batched == alone), 1 when one did not, 2 when a part of the run failed (the
report still holds the rest, and what failed under "failed"), 3 when parts were skipped because
they would have started past --budget (under "skipped").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cag.answering.query import Query

QUESTIONS = [
    "What does the author say about startups?",
    "Why do hackers like hard problems?",
    "What is the advice about doing what you love?",
    "What does the author think about cities?",
    "How should you choose what to work on?",
    "What is said about wealth?",
]
BIG = "llama-3.2-1b"  # bench.bench_models.SHAPES


# -- the device's own rates ------------------------------------------------------------------------
def _sync(dev: str) -> None:
    import torch

    if dev == "cuda":
        torch.cuda.synchronize()


def _best(dev: str, fn, repeat: int = 5) -> float:
    """Fastest of `repeat` runs of fn (s), after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t)
    return best


def device_rates(dev: str, dtype, nbytes: int) -> dict:
    """GEMM FLOP/s in `dtype`, and copy rates over `nbytes` (GB/s): device to device (bytes copied, each
    read and written once), host to device from pinned and from pageable memory (CUDA)."""
    import torch

    n = 8192 if dev == "cuda" else 1024
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    out = {"gemm_tflops": 2 * n**3 / _best(dev, lambda: a @ b) / 1e12, "gemm_n": n}
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    out["device_copy_gb_s"] = nbytes / _best(dev, lambda: dst.copy_(src)) / 1e9
    out["h2d_pinned_gb_s"] = out["h2d_pageable_gb_s"] = None
    if dev == "cuda":
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        out["h2d_pinned_gb_s"] = nbytes / _best(dev, lambda: dst.copy_(pinned, non_blocking=True)) / 1e9
        out["h2d_pageable_gb_s"] = nbytes / _best(dev, lambda: dst.copy_(pageable)) / 1e9
    return out


def prefill_flops(config, n: int) -> float:
    """Matrix FLOPs of prefilling n tokens: every layer's projections and MLP (2 a weight a token), and
    causal attention (QK^T and PV over n^2 / 2 pairs, 2 FLOPs a multiply-add each); the LM head, which
    a prefill for a snapshot never runs, left out."""
    t = getattr(config, "text_config", config)
    h, inter, layers = t.hidden_size, t.intermediate_size, t.num_hidden_layers
    heads, kv = t.num_attention_heads, t.num_key_value_heads
    d = getattr(t, "head_dim", None) or h // heads
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter
    return layers * (2 * n * per_layer + 2 * n * n * heads * d)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# -- one model --------------------------------------------------------------------------------------
class Check:
    """The figures of one model on one device; each part records its failure and lets the rest run."""

    def __init__(self, engine, args, home: Path, primary: bool, save=lambda r: None):
        self.engine, self.args, self.home, self.primary, self.save = engine, args, home, primary, save
        self.r: dict = {}

    def part(self, name: str, fn) -> None:
        """Runs one part unless the budget (--budget) is spent, then saves the report so far: a run cut
        off at a machine's time limit still leaves every figure it measured."""
        if time.monotonic() > self.args.deadline:
            self.r.setdefault("skipped", []).append(name)
            print(f"  {name}: skipped, past the --budget", flush=True)
            return
        try:
            t = time.perf_counter()
            fn()
            print(f"  {name}: {time.perf_counter() - t:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - a check reports what broke and goes on
            self.r.setdefault("failed", {})[name] = f"{type(e).__name__}: {e}"
            print(f"  {name} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        self.bounds()
        self.save(self.r)

    def ask(self, q: str, n: int, **kw):
        from cag.runtime.generate import DecodeConfig

        return self.engine.answer(
            Query(
                "check", q, max_tokens=n, decoding=DecodeConfig(max_tokens=n, min_tokens=kw.pop("min_tokens", 0)), **kw
            )
        )

    def run(self) -> dict:
        e, lm = self.engine, self.engine.lm
        dev = lm.device.type
        self.r.update(device=str(lm.device), dtype=str(lm.dtype), weights=lm.weights, model=lm.name,
                      kernels=lm.kernels, decode_rows=e.decoder.rows, max_batch=e.settings.max_batch)
        print(f"{lm.name} on {lm.device} ({lm.dtype}, weights {lm.weights})", flush=True)
        self.part("ingest", self.ingest)
        if "prefix_tokens" not in self.r:
            return self.r
        self.part("rates", lambda: self.r.update(device_rates(dev, lm.dtype, max(self.r["snapshot_bytes"], 64 << 20))))
        if self.primary:
            self.part("prefill chunks", self.chunks)
        self.part("cag == full", self.exact)
        self.part("ttft", self.ttft)
        self.part("load", self.load)
        self.part("decode", self.decode)
        self.part("kernels", self.kernels)
        self.part("concurrent", self.concurrent)
        if self.primary:
            self.part("padding", self.padding)
            self.part("batched == alone", self.batched)
        return self.r

    def bounds(self) -> None:
        r = self.r
        if r.get("gemm_tflops") and r.get("prefix_tokens"):
            flops = prefill_flops(self.engine.lm.model.config, r["prefix_tokens"])
            r["prefill_bound_tok_s"] = r["prefix_tokens"] / (flops / (r["gemm_tflops"] * 1e12))
        if r.get("step_bytes") and r.get("device_copy_gb_s"):
            # reading the step's bytes once at the device's copy rate (a copy also writes them: generous)
            r["step_bound_ms"] = r["step_bytes"] / (r["device_copy_gb_s"] * 1e9) * 1e3

    def ingest(self) -> None:
        e, lm = self.engine, self.engine.lm
        count = lambda t: len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
        from .common import essay_corpus

        e.ingest(str(essay_corpus(self.home / "warm", 400, count)), name="warm")  # kernels and handles made once
        corpus = essay_corpus(self.home / "corpus", self.args.tokens, count)
        ing = e.ingest(str(corpus), name="check")
        self.corpus, self.ing = corpus, ing
        self.r.update(prefix_tokens=ing.n_tokens, prefill_ms=ing.prefill_ms, n_shards=ing.n_shards,
                      prefill_tok_s=ing.n_tokens / (ing.prefill_ms / 1e3), snapshot_bytes=ing.bytes,
                      prefill_chunk=e.chunk)

    def chunks(self) -> None:
        e = self.engine
        keep = e.settings
        out = {}
        for chunk in (512, 2048, self.r["prefix_tokens"]):
            e.settings = keep.model_copy(update={"chunk_tokens": chunk})
            ing = e.ingest(str(self.corpus), name="check", force=True)
            out[str(chunk)] = ing.n_tokens / (ing.prefill_ms / 1e3)
        e.settings = keep
        self.r["prefill_tok_s_by_chunk"] = out

    def exact(self) -> None:
        rows = []
        for q in QUESTIONS[: self.args.questions]:
            self.engine.evict()
            cag = self.ask(q, self.args.max_tokens)
            full = self.ask(q, self.args.max_tokens, mode="full")
            rows.append({"question": q, "identical": cag.token_ids == full.token_ids, "tokens": len(cag.token_ids),
                         "ttft_cag_ms": cag.ttft_ms, "ttft_full_ms": full.ttft_ms, "load_ms": cag.load_ms})
            print(f"    {rows[-1]}", flush=True)
        self.r.update(questions=rows, all_identical=all(r["identical"] for r in rows),
                      ttft_full_ms=median(r["ttft_full_ms"] for r in rows))

    def ttft(self) -> None:
        e, qs = self.engine, self.args.questions_pool[:10]
        self.ask(qs[0], 1)  # resident
        hot, cold = [], []
        for q in qs:
            e.kept.clear()  # no earlier turn's K/V: the whole question prefilled
            hot.append(self.ask(q, 1).ttft_ms)
        for q in qs:
            e.evict()
            e.kept.clear()
            cold.append(self.ask(q, 1).ttft_ms)
        self.r.update(ttft_resident_ms=median(hot), ttft_file_ms=median(cold), ttft_cag_ms=median(cold))

    def load(self) -> None:
        e = self.engine
        digest = e.index.snapshot(self.ing.snapshot)["digest"]
        times = []
        for _ in range(3):
            e.evict()
            t = time.perf_counter()
            res = e._load_resident(digest)  # read, verify, move to the device
            _sync(e.lm.device.type)
            times.append(time.perf_counter() - t)
        self.r.update(load_gb_s=res.prefix.nbytes / min(times) / 1e9, loaded_bytes=res.prefix.nbytes)

    def decode(self) -> None:
        import torch

        e, n = self.engine, self.args.decode_tokens
        q = QUESTIONS[0]
        self.ask(q, 4)  # resident, its graph captured
        rates = [self.ask(q, n, min_tokens=n).decode_tok_s for _ in range(3)]
        res = e.resident.values()[0]
        self.r.update(
            decode_tok_s=median(rates),
            step_bytes=(e.lm.packed_bytes or sum(p.nbytes for p in e.lm.model.parameters())) + res.prefix.nbytes,
        )
        dec = e.decoder
        graphs = dec.graphs
        if graphs is None:
            return
        dec.graphs = None  # the same step launched op by op
        try:
            self.r["decode_tok_s_eager"] = median(self.ask(q, n, min_tokens=n).decode_tok_s for _ in range(2))
        finally:
            dec.graphs = graphs
        graph = res.prefix.made[graphs][0]
        W = dec.rows
        graphs.ids.copy_(torch.tensor([[0] * W, [dec.pad] * W, [0] * W]))  # every row on the padding slot
        self.r["replay_ms"] = _best("cuda", graph.replay, 50) * 1e3

    def kernels(self) -> None:
        from .kernel_count import step_kernels, step_writes

        e = self.engine
        prefix = (
            e.resident.values()[0].prefix
            if e.resident.values()
            else e._load_resident(e.index.snapshot(self.ing.snapshot)["digest"]).prefix
        )
        dec = e.decoder
        few = dec.step.few if dec.step is not None else False
        rows = dec.rows or 1
        self.r["step_ops"] = step_writes(e.lm.model, prefix, rows, few, dec.graph_room).n
        if e.lm.device.type == "cuda":
            self.r["step_cuda_kernels"] = step_kernels(e.lm.model, prefix, rows, few, dec.graph_room)

    def concurrent(self) -> None:
        e, n = self.engine, self.args.decode_tokens
        many = e.settings.max_batch
        qs = self.args.questions_pool[:many]
        self.ask(qs[0], 2)

        def rate(batch):
            t = time.perf_counter()
            with ThreadPoolExecutor(len(batch)) as pool:
                got = list(pool.map(lambda q: self.ask(q, n, min_tokens=n), batch))
            return sum(len(g.token_ids) for g in got) / (time.perf_counter() - t)

        one, together = rate(qs[:1]), rate(qs)
        self.r.update(concurrent=many, one_request_tok_s=one, concurrent_tok_s=together, concurrent_gain=together / one)

    def padding(self) -> None:
        """One request's tokens/s in steps of W rows (W - 1 of them padding) against steps of 1 row."""
        e, n = self.engine, self.args.decode_tokens
        keep = e.settings
        W = e.decoder.rows or keep.max_batch
        out = {}
        try:
            for rows in (W, 1):
                e.settings = keep.model_copy(update={"decode_rows": rows})
                e._decoder = None  # a decoder of `rows` rows (and its own graphs)
                self.ask(QUESTIONS[0], 4)
                out[rows] = median(self.ask(QUESTIONS[0], n, min_tokens=n).decode_tok_s for _ in range(2))
        finally:
            e.settings, e._decoder = keep, None
        self.r.update(padding_rows=W, decode_tok_s_rows_w=out[W], decode_tok_s_rows_1=out[1],
                      padding_cost=out[1] / out[W])

    def batched(self) -> None:
        e, n = self.engine, self.args.max_tokens
        qs = self.args.questions_pool[: self.args.exact_questions]
        alone = [self.ask(q, n).token_ids for q in qs]
        t = time.perf_counter()
        with ThreadPoolExecutor(2 * e.settings.max_batch) as pool:
            together = list(pool.map(lambda q: self.ask(q, n).token_ids, qs))
        same = sum(a == b for a, b in zip(alone, together))
        self.r.update(batched_questions=len(qs), batched_same=same, batched_identical=same == len(qs),
                      batched_tok_s=sum(map(len, together)) / (time.perf_counter() - t))
        print(f"    batched == alone: {same}/{len(qs)}", flush=True)


SHAPE_OF = "shape_of.txt"  # in a pack_shape folder: the name of the model whose shape it is


def pack_shape(dest: str | Path) -> Path:
    """The embedded model's folder without its weights (config, tokenizer, chat template) at `dest`:
    what bench/gpu_pack.sh carries to a GPU machine, where its ~90 MB of weights exceed what travels.
    `--shape` runs the check on that config with random weights: the same shapes, kernels and bytes,
    so the same speeds, and exactness checked just as bitwise."""
    import shutil

    from cag.config import DEFAULT_MODEL, get_settings
    from cag.model.loading import materialize_default

    src, dest = materialize_default(get_settings().models_dir), Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, dest / f.name)
    (dest / SHAPE_OF).write_text(DEFAULT_MODEL)
    return dest


def random_weights(shape: Path, work: Path) -> Path:
    """A model folder of `shape`'s config and tokenizer (pack_shape) with random weights: seed 0, bf16."""
    import shutil

    import torch
    import transformers

    out = work / f"{shape.name}-random"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(shape), dtype=torch.bfloat16
    )
    model.save_pretrained(out)
    for f in shape.iterdir():
        if f.is_file() and f.name not in ("config.json", "generation_config.json", SHAPE_OF):
            shutil.copy(f, out / f.name)
    print(
        f"random weights for {shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters)", flush=True
    )
    return out


def question_pool(n: int) -> list[str]:
    """n distinct questions: SQuAD dev's (CAG_DATASETS) where they are, else the essay ones numbered."""
    try:
        from cag.compare.datasets import load_squad

        qs = list(dict.fromkeys(q.question for q in load_squad().questions))
    except Exception:  # noqa: BLE001 - no datasets here: the check still runs
        qs = []
    qs = qs or [f"{q} (point {i + 1})" for i in range(n) for q in QUESTIONS]
    return (qs * (n // len(qs) + 1))[:n]


def run(args, save=lambda report: None) -> dict:
    import torch
    import transformers

    from cag.config import get_settings
    from cag.engine import Engine
    from cag.runtime import attention

    report: dict = {"torch": torch.__version__, "transformers": transformers.__version__,
                    "cuda_available": torch.cuda.is_available(),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    print(f"torch {report['torch']}, transformers {report['transformers']}, gpu: {report['gpu'] or 'none'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        base = {"device": args.device, "models_dir_override": get_settings().models_dir}
        if args.shape:
            args.model = str(random_weights(Path(args.shape), home))
            of = Path(args.shape) / SHAPE_OF
            report["random_weights_of"] = of.read_text().strip() if of.exists() else Path(args.shape).name
        engine = Engine(get_settings(home=home / "home", **base, **({"model": args.model} if args.model else {})))
        on_cuda = engine.lm.device.type == "cuda"
        if not on_cuda:
            print("no CUDA device: the check runs on the CPU (the GPU figures are still to be measured)", flush=True)
        args.exact_questions = args.exact_questions or (200 if on_cuda else 2 * args.questions)
        args.questions_pool = question_pool(max(args.exact_questions, 16, 10))
        report.update(Check(engine, args, home / "a", primary=True, save=lambda r: save({**report, **r})).run())
        # the suffix attention CUDA decodes with (cag.runtime.attention.probe_cuda)
        report["cuda_suffix"] = attention.CUDA_SUFFIX["way"]
        del engine
        if on_cuda and not args.no_1b and time.monotonic() > args.deadline:
            report.setdefault("skipped", []).append(BIG)
        elif on_cuda and not args.no_1b:
            from .bench_models import build

            try:
                path = build(BIG, home / "models", tokenizer=Path(args.shape) if args.shape else None)
                big = Engine(get_settings(home=home / "home-1b", **base, model=str(path)))
                report[BIG] = Check(big, args, home / "b", primary=False, save=lambda r: save({**report, BIG: r})).run()
            except Exception as e:  # noqa: BLE001
                report.setdefault("failed", {})[BIG] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
    return report


def table(report: dict) -> str:
    def f(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    lines = [f"torch {report['torch']}, transformers {report['transformers']}, device {report.get('device')} "
             f"({report['gpu'] or 'no GPU'}), CUDA suffix attention: {report.get('cuda_suffix')}", ""]
    if report.get("random_weights_of"):
        lines += [
            f"Random weights (seed 0) of {report['random_weights_of']}'s config and its tokenizer: the same shapes and "
            "speeds.",
            "",
        ]
    for r in [report, *([report[BIG]] if BIG in report else [])]:
        lines += [
            f"**{r.get('model')}** ({r.get('dtype')}, weights {r.get('weights')}, {r.get('prefix_tokens')}-token "
            f"prefix, decode rows {r.get('decode_rows')}, GEMM {f(r.get('gemm_tflops'), '.3g')} TFLOP/s)",
            "",
            "| measure | measured | bound or target |",
            "|---|---|---|",
            f"| knowledge prefill, tok/s (chunk {r.get('prefill_chunk')}) | {f(r.get('prefill_tok_s'))} | "
            f"{f(r.get('prefill_bound_tok_s'))} (its matrix FLOPs at the GEMM rate) |",
        ]
        if r.get("prefill_tok_s_by_chunk"):
            lines.append(
                "| prefill tok/s by chunk | "
                + ", ".join(f"{k}: {v:.0f}" for k, v in r["prefill_tok_s_by_chunk"].items())
                + " | |"
            )
        lines += [
            f"| TTFT resident / from the file, ms (median of 10) | {f(r.get('ttft_resident_ms'), '.1f')} / "
            f"{f(r.get('ttft_file_ms'), '.1f')} | full prompt: {f(r.get('ttft_full_ms'), '.1f')} |",
            f"| snapshot load, GB/s | {f(r.get('load_gb_s'), '.2f')} | pinned {f(r.get('h2d_pinned_gb_s'), '.1f')}, "
            f"pageable {f(r.get('h2d_pageable_gb_s'), '.1f')} host-to-device; device copy "
            f"{f(r.get('device_copy_gb_s'), '.0f')} |",
            f"| decode, one request, tok/s: graphs (eager) | {f(r.get('decode_tok_s'), '.1f')} "
            f"({f(r.get('decode_tok_s_eager'), '.1f')}) | "
            f"{f(1e3 / r['step_bound_ms'] if r.get('step_bound_ms') else None)} (its bytes once a step) |",
            f"| one replayed step, ms | {f(r.get('replay_ms'), '.2f')} | {f(r.get('step_bound_ms'), '.2f')} |",
            f"| one step: CUDA kernels / ops writing memory | {r.get('step_cuda_kernels', '-')} / "
            f"{r.get('step_ops', '-')} | |",
            f"| {r.get('concurrent')} requests at once vs one, tok/s | {f(r.get('concurrent_tok_s'))} vs "
            f"{f(r.get('one_request_tok_s'))} ({f(r.get('concurrent_gain'), '.1f')}x) | 10x |",
        ]
        if "padding_cost" in r:
            lines.append(
                f"| padding: one request at {r['padding_rows']} rows vs 1 row, tok/s | {r['decode_tok_s_rows_w']:.1f} "
                f"vs {r['decode_tok_s_rows_1']:.1f} | costs {r['padding_cost']:.2f}x |"
            )
        if "questions" in r:
            lines.append(f"| cag == full | {sum(q['identical'] for q in r['questions'])}/{len(r['questions'])} | all |")
        if "batched_questions" in r:
            lines.append(
                f"| batched == alone, questions | {r['batched_same']}/{r['batched_questions']} "
                f"({r['batched_tok_s']:.0f} tok/s together) | all |"
            )
        if r.get("failed"):
            lines.append(f"\nfailed: {r['failed']}")
        if r.get("skipped"):
            lines.append(f"\nskipped, past the --budget: {', '.join(r['skipped'])}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: CAG_MODEL or the embedded one)")
    ap.add_argument(
        "--shape", default=None, help="a model folder without weights (pack_shape): its config with random weights"
    )
    ap.add_argument("--tokens", type=int, default=7000)
    ap.add_argument("--questions", type=int, default=4, help="questions asked in cag and full mode")
    ap.add_argument("--max-tokens", type=int, default=24, help="answer tokens of the exactness questions")
    ap.add_argument("--decode-tokens", type=int, default=64, help="answer tokens of the decode rate runs")
    ap.add_argument(
        "--exact-questions",
        type=int,
        default=0,
        help="batched == alone questions (0: 200 on CUDA, else 2 x --questions)",
    )
    ap.add_argument("--no-1b", action="store_true", help=f"skip the {BIG} shape (run on CUDA only)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument(
        "--budget",
        type=float,
        default=0,
        help="seconds: parts that would start later are skipped, and say so (0: no limit)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    args.deadline = time.monotonic() + args.budget if args.budget else float("inf")

    def save(report: dict) -> str | None:
        report["wall_s"] = time.perf_counter() - t
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        if "torch" in report and "device" in report:
            md = table(report)
            (out / "gpu_check.md").write_text(md)
            return md
        return None

    try:
        report = run(args, save)
    except Exception as e:  # noqa: BLE001 - a check script reports what broke, with its versions
        report = {"failed": {"run": f"{type(e).__name__}: {e}"}, "traceback": traceback.format_exc()}
        print(report["traceback"], file=sys.stderr)
    md = save(report)
    if md:
        print(md)
    failed = report.get("failed") or (report.get(BIG) or {}).get("failed")
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
        sys.exit(2)
    agreed = (
        report.get("all_identical", True)
        and report.get("batched_identical", True)
        and (report.get(BIG) or {}).get("all_identical", True)
    )
    if not agreed:
        sys.exit(1)
    skipped = report.get("skipped") or (report.get(BIG) or {}).get("skipped")
    if skipped:
        print(f"skipped, past the --budget: {skipped}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
