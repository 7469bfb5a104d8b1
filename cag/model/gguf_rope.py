"""Llama 3.1+'s rope scaling, recovered from a GGUF file's rope_freqs.weight.

transformers' GGUF reader drops it: llama.cpp's converter writes it not as metadata but as a tensor,
rope_freqs.weight, of the factor dividing each rotary frequency. `llama3_rope` recovers its parameters
from that tensor and keeps them only if transformers' own llama3 rope, given them, reproduces it
(cag.model.gguf_checks.check refuses a file whose tensor nothing reproduces).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch


def llama3_rope(factors: np.ndarray, base: float, dim: int | None, context: int | None = None,
                original: int | None = None) -> dict | None | Literal[False]:
    """Llama 3's rope scaling (transformers' rope_parameters: rope_type "llama3", factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings) that makes llama.cpp's rope_freqs tensor
    `factors`, (dim / 2,): None where every factor is 1 (no scaling), False where none makes it.

    llama.cpp's converter writes, for rotary frequency i (wavelength w = 2 pi base^(2i / dim)), 1 where
    w < original / high_freq_factor, `factor` where w > original / low_freq_factor, and between them
    1 / ((1 - s) / factor + s) with s = (original / w - low_freq_factor) / (high_freq_factor - low_freq_factor),
    linear in 1 / w. So factor is the largest entry, and the blended entries fix the two boundary
    wavelengths (a line through their s against 1 / w); only those boundaries and factor shape the
    frequencies, so `original` (metadata rarely carries it) is taken as the low boundary, making
    low_freq_factor 1, as every Llama 3.1-3.3 has. The result is kept only if transformers' own llama3
    rope init, given it, divides each frequency by the tensor's factor."""
    r = np.asarray(factors, dtype=np.float64)
    if not dim or r.shape != (dim // 2,) or not np.isfinite(r).all():
        return False
    if np.allclose(r, 1.0, rtol=0, atol=1e-6):
        return None
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (dim / 2,) as transformers
    w = (2 * math.pi / inv.double()).numpy()  # wavelengths, rising with i
    factor = float(r.max())
    if factor <= 1:
        return False
    blended = (np.abs(r - 1) > 1e-6) & (np.abs(r - factor) > 1e-6 * factor)
    s = (1 / r - 1 / factor) / (1 - 1 / factor)  # the blend's s, 0 at `factor`, 1 at 1
    x = 1 / w
    if blended.sum() >= 2:
        slope, cut = np.polyfit(x[blended], s[blended], 1)  # s = slope x + cut
        if slope == 0:
            return False
        low_wave, high_wave = -slope / cut if cut else math.inf, slope / (1 - cut)
    else:
        # too few blended entries to fix both boundaries: take Llama 3's high_freq_factor / low_freq_factor = 4
        ones, tops = np.flatnonzero(np.abs(r - 1) <= 1e-6), np.flatnonzero(np.abs(r - factor) <= 1e-6 * factor)
        if blended.any():
            low_wave = (3 * s[blended][0] + 1) / x[blended][0]
        elif len(ones) and len(tops):
            low_wave = math.sqrt(4 * w[ones[-1]] * w[tops[0]])  # between the last 1 (times 4) and the first factor
        else:
            return False
        high_wave = low_wave / 4
    if not (0 < high_wave < low_wave < math.inf):
        return False
    orig = int(original) if original else max(1, round(low_wave))
    exact = {"factor": factor, "low_freq_factor": float(orig / low_wave), "high_freq_factor": float(orig / high_wave)}
    nice = {k: round(v, 3) for k, v in exact.items()}  # 8, 1, 4 rather than 8.0000001, 0.9999999, 4.0000003
    for guess in (nice, exact):
        rope = {"rope_type": "llama3", **guess, "original_max_position_embeddings": orig}
        if _reproduces(rope, r, base, dim, context):
            return rope
    return False


def _reproduces(rope: dict, factors: np.ndarray, base: float, dim: int, context: int | None) -> bool:
    """Whether transformers' llama3 rope init, given `rope`, divides each default frequency by `factors`."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=dim,
        num_attention_heads=1,
        head_dim=dim,
        rope_parameters=rope | {"rope_theta": base},
        max_position_embeddings=max(int(context or 0), rope["original_max_position_embeddings"] + 1),
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")  # (dim / 2,)
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    got = (inv.double() / scaled.double()).numpy()
    return bool(np.allclose(got, factors, rtol=1e-5, atol=0))
