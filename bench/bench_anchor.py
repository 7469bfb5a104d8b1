"""cag next to llama.cpp on the same GGUF, the same prefix tokens and the same question, in one run.

What a user would pick instead of cag for "prefill once, answer many": llama.cpp with a saved state.
For essay corpora of about 1K, 2K, 4K and 7K tokens (the embedded SmolLM2-135M; llama.cpp reads the
very GGUF file cag's weights come from, and is fed cag's own prompt token ids):

  * prefill tokens/s of the knowledge;
  * time to first token from a saved state: llama.cpp restores its state (from memory, as
    llama-cpp-python's save_state/load_state keep it; and from a state file), evaluates the
    question and takes the first token; cag reads its snapshot file (cold) or finds it resident,
    and prefills the question too (its kept conversations cleared before each: no reuse of the
    question's K/V from the run before);
  * decode tokens/s over that prefix, 32 tokens, greedy, stop tokens ignored;
  * how many of the 32 greedy tokens the two engines share (their arithmetic differs: llama.cpp
    multiplies the 4-bit weights with 8-bit activations; cag the dequantized weights).

`--model SHAPE` (a bench/bench_models.py shape, e.g. llama-3.2-1b, llama-3.2-3b) runs the same on that
random-weight model instead: its bf16 folder (built once under --work) written as a GGUF file with the
`gguf` package (bench/gguf_file.py: llama.cpp's converter's layout, matrices in --qtype, Q4_0 or Q8_0),
which both engines read (cag: `--model file.gguf`, CAG_WEIGHTS=auto, so Q4_0 on int4's grid as it is).

llama.cpp comes from the optional `anchor` extra (`pip install -e '.[anchor]'`: llama-cpp-python
builds llama.cpp from source, ~15 minutes on 2 cores); without it this prints why and exits 2.
The results name the instruction sets the llama.cpp build uses: an AVX2-only build (CMAKE_ARGS="-DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF", installed with `pip install --target DIR` and put
on PYTHONPATH) beside CAG_DECODE_KERNELS=avx2 compares the two AVX2 paths on one CPU.
Writes bench/results/anchor.json and anchor.md (anchor-SHAPE.* with --model; --name: another name).
Run: `python -m bench.bench_anchor`,
`python -m bench.bench_anchor --model llama-3.2-1b --sizes 1000,4000`.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

from cag.answering.query import Query

from .bench_models import SHAPES
from .common import essay_corpus, machine, timed, write


def shape_gguf(shape: str, qtype: str, work: Path) -> Path:
    """The random model of `shape` as a GGUF file (written once under `work`)."""
    import gguf as gg
    import torch
    import transformers

    from .bench_models import build
    from .gguf_file import tokenizer_fields, write_gguf

    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{shape}.{qtype}.gguf"
    if not path.exists():
        model = transformers.AutoModelForCausalLM.from_pretrained(build(shape, work), dtype=torch.bfloat16)
        tmp = path.with_suffix(".part")
        write_gguf(model, tmp, gg.GGMLQuantizationType[qtype], tokenizer_fields())
        tmp.replace(path)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)", flush=True)
    return path

QUESTION = "What does the author say about how to start a startup?"


class Anchor:
    """llama.cpp (through llama-cpp-python) driven with token ids: no tokenizer of its own in play."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int):
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, verbose=False)

    def prefill(self, ids: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(ids)

    def greedy(self) -> int:
        """The argmax of the last evaluated token's logits (llama-cpp-python keeps no scores unless
        every position's logits are computed)."""
        import numpy as np

        logits = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).argmax())

    def first_token(self, question: list[int]) -> int:
        self.llm.eval(question)
        return self.greedy()

    def decode(self, first: int, n: int) -> tuple[list[int], float]:
        """n-1 greedy steps after `first`: (tokens, tokens/s of the steps)."""
        out, t = [first], time.perf_counter()
        for _ in range(n - 1):
            self.llm.eval([out[-1]])
            out.append(self.greedy())
        return out, (n - 1) / (time.perf_counter() - t)

    def save_file(self, path: Path) -> None:
        ids = (self.lib.llama_token * self.llm.n_tokens)(*self.llm.input_ids[: self.llm.n_tokens])
        if not self.lib.llama_state_save_file(self.llm.ctx, str(path).encode(), ids, self.llm.n_tokens):
            raise RuntimeError("llama_state_save_file failed")

    def load_file(self, path: Path, n: int) -> None:
        ids = (self.lib.llama_token * n)()
        count = ctypes.c_size_t(0)
        self.llm.reset()
        if not self.lib.llama_state_load_file(self.llm.ctx, str(path).encode(), ids, n, ctypes.byref(count)):
            raise RuntimeError("llama_state_load_file failed")
        self.llm.input_ids[: count.value] = ids[: count.value]
        self.llm.n_tokens = count.value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,2000,4000,7000")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="TTFT: median of this many runs")
    ap.add_argument("--rounds", type=int, default=3, help="decode: best of this many alternating runs per engine")
    ap.add_argument(
        "--model",
        help="a bench_models shape (e.g. llama-3.2-1b) written to a GGUF file both engines read; default: the embedded "
        "model's own GGUF",
    )
    ap.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "Q8_0"], help="the GGUF's matrix type with --model")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "cag-bench-models",
                    help="built models and their GGUF files are kept here")
    ap.add_argument("--name", help="results file name under bench/results (default: anchor, or anchor-SHAPE)")
    args = ap.parse_args()
    if args.model and args.model not in SHAPES:
        print(f"unknown shape {args.model!r}: one of {', '.join(SHAPES)}", file=sys.stderr)
        sys.exit(2)
    try:
        import llama_cpp
    except ImportError:
        print(
            "llama-cpp-python is not installed: `pip install -e '.[anchor]'` builds it (~15 minutes)", file=sys.stderr
        )
        sys.exit(2)
    import torch

    from cag.config import get_settings
    from cag.engine import Engine
    from cag.model.loading import GGUF_FILE, _gguf_dir
    from cag.model.prompt import build_prefix, build_suffix
    from cag.runtime.generate import DecodeConfig

    load_before = os.getloadavg()
    threads = torch.get_num_threads()
    n = args.decode_tokens
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        gguf = shape_gguf(args.model, args.qtype, args.work) if args.model else _gguf_dir() / GGUF_FILE
        if args.model:
            os.environ["CAG_MODEL"] = str(gguf)
        engine = Engine(get_settings(home=home / "home", models_dir_override=get_settings().models_dir))
        lm = engine.lm
        sizes = [int(s) for s in args.sizes.split(",")]
        n_ctx = min(lm.model.config.max_position_embeddings, max(sizes) + 512)  # the prefix, the question, the answer
        anchor = Anchor(gguf, n_ctx, threads)
        count = lambda t: len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
        for size in sizes:
            folder = essay_corpus(home / f"essays-{size}", size, count)
            ing = engine.ingest(str(folder), name=f"essays{size}")
            docs, _ = engine.read_corpus(folder, f"essays{size}")
            prefix = build_prefix(lm.tokenizer, engine.layout(), [(d.name, d.text) for d in docs]).ids
            question = build_suffix(lm.tokenizer, engine.layout(), QUESTION)
            assert len(prefix) == ing.n_tokens, (len(prefix), ing.n_tokens)  # the very tokens cag prefilled

            # llama.cpp: prefill, state saved in memory and to a file, restored before each question
            t = time.perf_counter()
            anchor.prefill(prefix)
            l_prefill = len(prefix) / (time.perf_counter() - t)
            t = time.perf_counter()
            state = anchor.llm.save_state()
            l_save_ms = (time.perf_counter() - t) * 1e3
            state_file = home / f"state-{size}.bin"
            anchor.save_file(state_file)

            def restored_first(state=state):
                anchor.llm.load_state(state)
                return anchor.first_token(question)

            def file_first(path=state_file, k=len(prefix)):
                anchor.load_file(path, k)
                return anchor.first_token(question)

            l_ttft_mem = timed(restored_first, args.repeat)[0] * 1e3
            l_ttft_file = timed(file_first, args.repeat)[0] * 1e3

            # cag on the same corpus: snapshot read from its file (cold), resident (warm), decode. The question
            # is prefilled every time, as llama.cpp evaluates it: no kept conversation (a repeated question's
            # K/V) is reused.
            def cold(corpus=f"essays{size}"):
                engine.evict()
                engine.kept.clear()
                return engine.answer(Query(corpus, QUESTION, max_tokens=1))

            def warm(corpus=f"essays{size}"):
                engine.kept.clear()
                return engine.answer(Query(corpus, QUESTION, max_tokens=1))

            engine.answer(Query(f"essays{size}", QUESTION, max_tokens=1))  # untimed: the first answer's one-time setup
            c_ttft_cold = timed(cold, args.repeat)[0] * 1e3
            c_ttft_warm = timed(warm, args.repeat)[0] * 1e3
            # decode: the two engines alternate, best of `rounds` each (a load spike hits both alike)
            c_decode = l_decode = 0.0
            for _ in range(args.rounds):
                ans = engine.answer(
                    Query(f"essays{size}", QUESTION, max_tokens=n, decoding=DecodeConfig(max_tokens=n, min_tokens=n))
                )
                c_decode = max(c_decode, ans.decode_tok_s)
                anchor.load_file(state_file, len(prefix))
                l_tokens, rate = anchor.decode(anchor.first_token(question), n)
                l_decode = max(l_decode, rate)
            same = next(
                (i for i, (a, b) in enumerate(zip(ans.token_ids, l_tokens)) if a != b), min(len(ans.token_ids), n)
            )
            rows.append({
                "n_tokens": len(prefix), "question_tokens": len(question),
                "cag_prefill_tok_s": ing.n_tokens / (ing.prefill_ms / 1e3), "llama_prefill_tok_s": l_prefill,
                "cag_ttft_cold_ms": c_ttft_cold, "cag_ttft_warm_ms": c_ttft_warm,
                "llama_ttft_state_memory_ms": l_ttft_mem, "llama_ttft_state_file_ms": l_ttft_file,
                "llama_state_save_ms": l_save_ms, "llama_state_bytes": len(state.llama_state),
                "cag_snapshot_bytes": ing.bytes,
                "cag_decode_tok_s": c_decode, "llama_decode_tok_s": l_decode,
                "same_leading_tokens": same,
            })
            print(rows[-1], flush=True)

    model, qtype = (f"{args.model}, random weights", args.qtype) if args.model else (lm.name, "Q4_1")
    features = llama_features(llama_cpp)
    head = (
        f"Machine: {machine()}; llama.cpp via llama-cpp-python {llama_cpp.__version__}, {threads} threads, built "
        f"from source here (its CPU features: {features}). Model: {model} (llama.cpp: the GGUF file itself, "
        f"{qtype}; cag: weights {lm.weights}, decode kernels {lm.kernels}, {engine.kv_name} snapshots). Same "
        f"prompt token ids on both sides; TTFT median of {args.repeat}; decode: {n} greedy tokens, stop tokens "
        f"ignored, best of {args.rounds} runs alternating the two engines. Load average before / after: "
        f"{load_before} / {os.getloadavg()}.\n\n"
        "| prefix tokens | prefill tok/s cag / llama.cpp | TTFT cag: snapshot file / resident | TTFT llama.cpp: state "
        "in memory / state file | decode tok/s cag / llama.cpp | state bytes cag / llama.cpp | same leading tokens "
        "|\n|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['n_tokens']:,} | {r['cag_prefill_tok_s']:.0f} / {r['llama_prefill_tok_s']:.0f} | "
        f"{r['cag_ttft_cold_ms']:.0f} / {r['cag_ttft_warm_ms']:.0f} ms | {r['llama_ttft_state_memory_ms']:.0f} / "
        f"{r['llama_ttft_state_file_ms']:.0f} ms | {r['cag_decode_tok_s']:.1f} / {r['llama_decode_tok_s']:.1f} | "
        f"{r['cag_snapshot_bytes'] / 1e6:.0f} / {r['llama_state_bytes'] / 1e6:.0f} MB | {r['same_leading_tokens']} of "
        f"{n} |\n"
        for r in rows
    )
    payload = {
        "machine": machine(),
        "llama_cpp": llama_cpp.__version__,
        "llama_cpp_features": features,
        "threads": threads,
        "model": model,
        "qtype": qtype,
        "cag_weights": lm.weights,
        "cag_kernels": lm.kernels,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "rows": rows,
    }
    write(args.name or (f"anchor-{args.model}" if args.model else "anchor"), payload, head + body)


def llama_features(llama_cpp) -> str:
    """The instruction sets the llama.cpp build uses (its system info's features set to 1), e.g. an AVX2-only build
    beside cag's AVX2 kernels on one CPU."""
    info = llama_cpp.llama_print_system_info()
    text = info.decode() if isinstance(info, bytes) else str(info)
    on = [part.split("=")[0].split(":")[-1].strip() for part in text.split("|") if part.strip().endswith("= 1")]
    return ", ".join(on) or text.strip()


if __name__ == "__main__":
    main()
