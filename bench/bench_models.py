"""Decode speed, TTFT, ingest rate and peak memory per model family and size and per weights format,
each decode rate beside its read bound, measured in one run.

Models are random-weight ones built from transformers configs (the shapes of the families users run,
at a small size and at 0.5B / 1B / 3B scale) with the embedded model's tokenizer, built once into
--work. For each (shape, format) two child processes of their own (so that each peak memory is its own):
  * `ingest` loads the model (CAG_WEIGHTS=format) and ingests an essay corpus of about --tokens
    tokens: the ingest rate and its peak RSS;
  * `serve` loads it again and answers from that snapshot, as a server does: --questions questions
    (32 tokens each, stop tokens ignored by the decode rate's definition: tokens after the first per
    second), TTFT and decode tok/s, medians; the decode path (`cag info`'s: fast step or transformers
    forward, kernels), the bytes of the weights a decode step reads in that format, and its peak RSS
    (VmHWM), against the model's weights as a bf16 checkpoint holds them plus the snapshot's K/V
    (issue 31's memory target).
The read bound of a step: those weight bytes plus the K/V bytes of the prefix, read once at the read
bandwidth measured here (a float32 sum over 512 MB, best of 5, as bench/bench_decode.py measures it).
Writes bench/results/models.json and models.md.
Run: `python -m bench.bench_models [--shapes small,0.5b,1b] [--formats fp32,bf16,int4]`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cag.answering.query import Query

from .common import essay_corpus, family_config, machine, write

# name: (family, hidden, layers, heads, kv heads, intermediate, tied embeddings)
SHAPES = {
    "llama": ("llama", 256, 4, 4, 2, 768, True),
    "mistral": ("mistral", 256, 4, 4, 2, 768, True),
    "qwen2": ("qwen2", 256, 4, 4, 2, 768, True),
    "qwen3": ("qwen3", 256, 4, 4, 2, 768, True),
    "phi3": ("phi3", 256, 4, 4, 2, 768, True),
    "granite": ("granite", 256, 4, 4, 2, 768, True),
    "olmo2": ("olmo2", 256, 4, 4, 2, 768, True),
    "llama-h96": ("llama", 384, 4, 4, 2, 1024, True),
    "llama-h80": ("llama", 320, 4, 4, 2, 896, True),
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 4864, True),
    "llama-3.2-1b": ("llama", 2048, 16, 32, 8, 8192, True),
    "llama-3.2-3b": ("llama", 3072, 28, 24, 8, 8192, True),
    "llama-3-8b": ("llama", 4096, 32, 32, 8, 14336, False),
    "mistral-0.5b-window": ("mistral", 896, 24, 14, 2, 4864, True),
    "gemma2-2b": ("gemma2", 2304, 26, 8, 4, 9216, True),  # heads of 256; window layers of 4,096 between global ones
}
WINDOWS = {"mistral-0.5b-window": 512}  # shapes whose window layers read a sliding window of this many keys
GROUPS = {"small": ["llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo2", "llama-h96"],
          "0.5b": ["qwen2.5-0.5b"], "1b": ["llama-3.2-1b"], "3b": ["llama-3.2-3b"],
          "8b": ["llama-3-8b"]}
QUESTIONS = ["What did the author work on before college?", "What is the main argument of the essay?",
             "Which company is mentioned first?", "What advice does the author give to founders?"]


def config(shape: str, tok):
    fam, hidden, layers, heads, kv, inter, tied = SHAPES[shape]
    granite = dict(
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=heads / hidden, logits_scaling=8.0
    )
    return family_config(
        fam,
        granite,
        WINDOWS.get(shape),
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=8192,
        tie_word_embeddings=tied,
        initializer_range=0.02,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def build(shape: str, work: Path, tokenizer: Path | None = None) -> Path:
    """The random model of `shape` as a model folder (built once), with the embedded tokenizer (or the
    one in the folder `tokenizer`), its weights saved in bf16 as most checkpoints are (CAG_DTYPE=auto
    computes in bf16 on bf16 hardware)."""
    out = work / f"{shape}-bf16"
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    from cag.config import DEFAULT_MODEL
    from cag.model.loading import materialize_default

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer or materialize_default(work / "models"))
    torch.manual_seed(0)
    cfg = config(shape, tok)
    # never float32: 8B of it would not fit
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=work))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    print(
        f"built {shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {DEFAULT_MODEL}'s "
        "tokenizer)",
        flush=True,
    )
    return out


def child(phase: str, corpus: str, questions: int) -> dict:
    """One (model, format) in this process, as JSON on stdout: `ingest` prefills the corpus (its rate and
    peak memory); `serve`, a process of its own after it, answers from that snapshot (the figures above)."""
    from cag.config import get_settings
    from cag.engine import Engine
    from cag.runtime import describe
    from cag.runtime.generate import DecodeConfig

    engine = Engine(get_settings())
    lm = engine.lm
    if phase == "ingest":
        r = engine.ingest(corpus)
        return {
            "n_tokens": r.n_tokens,
            "ingest_tok_s": r.n_tokens / (r.prefill_ms / 1e3),
            "ingest_peak_rss": peak_rss(),
        }
    name = next(iter(engine.index.corpora()))["name"]
    cfg = DecodeConfig(max_tokens=32, min_tokens=32)  # every answer 32 tokens: rates over the same count
    # the first warms
    rows = [engine.answer(Query(name, q, max_tokens=32, decoding=cfg)) for q in (QUESTIONS * 4)[: questions + 1]][1:]
    n_tokens = engine.index.snapshot(engine.index.corpus(name)["current_snapshot"])["n_tokens"]
    params = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    bf16 = sum(p.numel() * 2 for p in lm.model.parameters())  # the model's weights as a bf16 checkpoint holds them
    step_bytes = lm.packed_bytes or params  # a packed format's decode rows read the packed copy alone
    kv_bytes = lm.kv_bytes(n_tokens, lm.attn_dtype)
    return {
        "ttft_ms": statistics.median(a.ttft_ms for a in rows),
        "decode_tok_s": statistics.median(a.decode_tok_s for a in rows if a.decode_tok_s),
        "weights_bytes": step_bytes,
        "model_bytes": params,
        "bf16_bytes": bf16,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "kv_bytes": kv_bytes,
        **describe.decode_path(lm),
        "peak_rss": peak_rss(),
        "rss": rss(),
    }


def rss() -> int:
    """This process's resident bytes now (VmRSS): what serving holds once loading is over."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def peak_rss() -> int:
    """This process's peak resident bytes (VmHWM). Not getrusage's ru_maxrss: Linux carries that over
    an exec from the forking process, so every child would report at least its parent's peak."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes", default="small,0.5b,1b", help="groups (small, 0.5b, 1b, 3b, 8b) or shape names, comma-separated"
    )
    ap.add_argument(
        "--formats",
        default="fp32,bf16,int4",
        help="CAG_WEIGHTS formats (bf16 skipped where the CPU has no bf16 products)",
    )
    ap.add_argument(
        "--kernels",
        default="auto",
        help="CAG_DECODE_KERNELS values, comma-separated: each format runs under each (side by side)",
    )
    ap.add_argument(
        "--dtype", default="auto", help="CAG_DTYPE for every run (auto: bf16 on bf16 hardware, these models being bf16)"
    )
    ap.add_argument("--tokens", type=int, default=1000, help="corpus size in tokens")
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "cag-bench-models", help="built models are kept here"
    )
    ap.add_argument("--name", default="models", help="results file name under bench/results")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child[0], a.child[1], int(a.child[2]))))
        return

    from bench.bench_decode import read_bandwidth
    from cag.model.layouts import bf16_packs

    shapes = [s for g in a.shapes.split(",") for s in GROUPS.get(g, [g])]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"unknown shapes {unknown}; use {', '.join([*GROUPS, *SHAPES])}")
    formats = [f for f in a.formats.split(",") if f != "bf16" or bf16_packs()]
    a.work.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    from cag.model.loading import materialize_default

    tok = AutoTokenizer.from_pretrained(materialize_default(a.work / "models"))
    corpus = essay_corpus(a.work / f"corpus-{a.tokens}", a.tokens, lambda t: len(tok(t).input_ids))
    bw = read_bandwidth()
    rows = []
    for shape in shapes:
        folder = build(shape, a.work)
        for fmt, kernels in [(f, k) for f in formats for k in a.kernels.split(",")]:
            env = {k: v for k, v in os.environ.items() if not k.startswith("CAG_")}
            env |= {
                "CAG_MODEL": str(folder),
                "CAG_WEIGHTS": fmt,
                "CAG_DTYPE": a.dtype,
                "CAG_MODELS_DIR": str(a.work / "models"),
                "CAG_DECODE_KERNELS": kernels,
                "CAG_HOME": tempfile.mkdtemp(prefix="home-", dir=a.work),
            }
            r, error = {"shape": shape, "weights": fmt}, None
            for phase in ("ingest", "serve"):
                p = subprocess.run(
                    [sys.executable, "-m", "bench.bench_models", "--child", phase, str(corpus), str(a.questions)],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    error = (p.stderr.strip().splitlines() or ["?"])[-1]
                    break
                r |= json.loads(line[7:])
            shutil.rmtree(env["CAG_HOME"], ignore_errors=True)  # its index and snapshot
            if error:
                print(f"{shape} {fmt}: failed: {error}", flush=True)
                rows.append(r | {"error": error})
                continue
            r["bound_tok_s"] = bw / (r["weights_bytes"] + r["kv_bytes"])
            rows.append(r)
            print(
                f"{shape} {fmt}: {r['decode_tok_s']:.1f} tok/s (bound {r['bound_tok_s']:.0f}), TTFT {r['ttft_ms']:.0f} "
                f"ms, serving peak {r['peak_rss'] / 2**30:.2f} GiB, ingest peak {r['ingest_peak_rss'] / 2**30:.2f} "
                f"GiB, {r['step']} step, {r['kernels']}",
                flush=True,
            )
    table = [
        "# Models: decode, TTFT and memory per family, size and weights format\n",
        f"Machine: {machine()}; read bandwidth {bw / 1e9:.1f} GB/s; corpus ~{a.tokens} tokens of essays; {a.questions} "
        f"questions of 32 tokens each. `python -m bench.bench_models --shapes {a.shapes} --formats {a.formats} "
        f"--kernels {a.kernels} --dtype {a.dtype}`\n",
        "| shape | weights | path | decode tok/s | read bound tok/s | bound / decode | TTFT ms | ingest tok/s | "
        "serving peak RSS GiB | ingest peak RSS GiB | bf16 weights GiB | serving peak / (bf16 weights + K/V) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            table.append(f"| {r['shape']} | {r['weights']} | failed: {r['error']} | | | | | | | | | |")
            continue
        native = f" ({r['native']})" if r.get("native") not in (None, "none") else ""
        path = f"{r['dtype']}, {r['step']} step, {r['kernels']}{native}"
        table.append(
            f"| {r['shape']} | {r['weights']} | {path} | {r['decode_tok_s']:.1f} | {r['bound_tok_s']:.0f} | "
            f"{r['bound_tok_s'] / r['decode_tok_s']:.1f}x | {r['ttft_ms']:.0f} | {r['ingest_tok_s']:.0f} | "
            f"{r['peak_rss'] / 2**30:.2f} | {r['ingest_peak_rss'] / 2**30:.2f} | {r['bf16_bytes'] / 2**30:.2f} | "
            f"{r['peak_rss'] / (r['bf16_bytes'] + r['kv_bytes']):.2f}x |"
        )
    write(
        a.name,
        {"machine": machine(), "read_bandwidth": bw, "args": {k: str(v) for k, v in vars(a).items()}, "rows": rows},
        "\n".join(table) + "\n",
    )


if __name__ == "__main__":
    main()
