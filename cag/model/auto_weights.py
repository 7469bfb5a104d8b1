"""Which CAG_WEIGHTS format `auto` means on this machine for this model (cag.model.weights holds the formats).

A CPU with bf16 dot products in hardware (AMX, AVX512-BF16) gets int4 for a model whose matrices
already lie on int4's grid (a GGUF Q4_1 model such as the embedded one: int4 keeps its weights as
they are and decodes faster than fp32 with fp32's quality: bench/bench_decode.py and
bench/bench_weights_quality.py measure both), else bf16; a CPU below it that runs cag's AVX2 library
gets int4 for such a model too; other CPUs get fp32 or bf16 by a timing probe, its verdict cached.
docs/performance.md has the current figures.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import torch

from cag.kernels import native
from cag.model.layouts import on_grid4
from cag.model.packed import pack
from cag.model.weights import FORMATS, packable, supported


@functools.lru_cache(maxsize=8)
def probe(
    fmts: tuple[str, ...] = FORMATS, in_f: int = 576, out_f: int = 1536, reps: int = 20, rows: int = 1
) -> dict[str, float]:
    """Milliseconds of one product of `rows` rows per format on this CPU (a (out, in) matrix, best of
    `reps`): what `auto` chooses by. A few ms, once per process."""
    w, x = torch.randn(out_f, in_f) * 0.02, torch.randn(rows, in_f)
    lin = torch.nn.Linear(in_f, out_f, bias=False)
    lin.weight.data = w
    out = {}
    with torch.inference_mode():
        for fmt in fmts:
            f = lin if fmt == "fp32" else pack(lin.weight, None, fmt)
            f(x)  # warm up (first call allocates)
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                for _ in range(8):
                    f(x)
                best = min(best, (time.perf_counter() - t) / 8)
            out[fmt] = best * 1e3
    return out


def cpuinfo(field: str) -> str | None:
    """The first value of a /proc/cpuinfo field ("model name", "flags"); None where there is none."""
    path = Path("/proc/cpuinfo")
    lines = path.read_text().splitlines() if path.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == field), None)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (empty off Linux)."""
    return set((cpuinfo("flags") or "").split())


BF16_HARDWARE = ("amx_bf16", "avx512_bf16")  # bf16 dot products in hardware: oneDNN's bf16 kernels run natively


def compute_dtype(requested: str, device: str, config) -> str:
    """What CAG_DTYPE `auto` means: bfloat16 on CUDA; on a CPU, bfloat16 where the CPU has bf16 dot
    products in hardware (BF16_HARDWARE) and the model's own weights are bf16 (its config's dtype:
    nothing of the model is lost, and its weights take half the memory float32 would), else float32."""
    if requested != "auto":
        return requested
    if device == "cuda":
        return "bfloat16"
    own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    own = str(own).removeprefix("torch.") if own is not None else None
    return "bfloat16" if own == "bfloat16" and cpu_flags() & set(BF16_HARDWARE) else "float32"


def on_4bit_grid(model: torch.nn.Module) -> bool:
    """Every product int4 would pack (all but the LM head) already lies on a 4-bit affine grid per group of 32
    (layouts.grid4: min and max on its ends, as a GGUF's Q4_1 writes it, or Q4_0's d * (q - 8)): int4 then holds these
    weights as they are (cag's kernels exactly; torch's up to bf16 rounding of each group's scale and zero), and loses
    nothing the model had not lost already. Any other model fails at its first matrix; SmolLM2 takes well under
    0.1 s."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    # a matrix is stored in one quantization type: its first rows tell (all of them: seconds)
    return bool(lins) and all(packable(m, "int4") and on_grid4(m.weight) for m in lins)


def choose(model: torch.nn.Module, requested: str, cache_dir: Path | None = None) -> str:
    """The format to use: `requested`, or for `auto` int4, bf16 or fp32, the formats that keep fp32's
    quality (the README's table; int8, and int4 off its grid, are opt-in).

    A CPU with bf16 dot products in hardware (AMX, AVX512-BF16) gets, by its flags, int4 when the model's matrices lie
    on int4's grid (`on_4bit_grid`: the same answers as often as bf16, fp32's F1, faster decode than fp32:
    bench/bench_decode.py), else bf16. A CPU below that floor where cag's AVX2 library runs gets int4 for such a model
    too (its int4 products, attention and glue decode several times faster than fp32: bench/bench_decode.py --kernels
    avx2). A timing probe decided this before and flipped between fp32 and bf16 on one machine under load, so identical
    machines sharing a store disagreed on the snapshot dtype (CAG_KV_DTYPE=auto follows this choice). Other CPUs are
    probed: the faster of fp32 and bf16 for one row and for a batch of 8 together (one user, and a server's busy hours),
    the verdict kept in `cache_dir` per CPU, torch version and thread count, so answers do not change from one start to
    the next."""
    if requested != "auto":
        return requested
    if next(model.parameters()).device.type != "cpu":
        return "fp32"
    bf16 = supported("bf16", model) is None
    if bf16 and cpu_flags() & set(BF16_HARDWARE):
        return "int4" if on_4bit_grid(model) else "bf16"
    if native.cpu_why_not() is not None and on_4bit_grid(model) and native.load_avx2():
        # below the AVX-512 floor, on cag's AVX2 library: the weights as they are, decoded faster than fp32
        return "int4"
    if not bf16:
        return "fp32"
    key = f"{cpuinfo('model name') or '?'}|torch {torch.__version__}|{torch.get_num_threads()} threads|1+8 rows"
    path = cache_dir / "weights-auto.json" if cache_dir else None
    known = json.loads(path.read_text()) if path and path.exists() else {}
    if key not in known:
        # A packed format's rows get the same bits alone and batched (tests/test_batch.py), so a
        # batch probe is fair
        one, eight = probe(("fp32", "bf16")), probe(("fp32", "bf16"), rows=8)
        known[key] = "bf16" if one["bf16"] + eight["bf16"] < 0.8 * (one["fp32"] + eight["fp32"]) else "fp32"
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1))
            os.replace(tmp, path)
    return known[key]
