"""int8 snapshots (CAG_KV_DTYPE=int8): keys and values quantized in blocks along head_dim, one fp16
scale per block, as llama.cpp's q8_0 does (blocks of 32; one block per head when head_dim is not
a multiple of 32). 1 byte per element + 2 bytes per 32: 53% of fp16.

Why per token (blocks inside one position's head vector) and not KIVI's per-channel keys: KIVI scales keys per channel
because channel outliers dominate at 2 bits; at 8 bits a block of 32 with its own scale holds keys within ~0.4% of their
block maximum. And a per-token scale keeps what is stored for position i a function of position i alone, as the KV
itself is: an incremental refresh that keeps an old snapshot's first documents stores exactly what a rebuild would
(re-quantizing a dequantized block gives back its bytes when dequantized in fp32, see tests/test_kv_int8.py), while a
per-channel scale over the whole sequence would change every stored key whenever a document is added.

Storage: `layers.{i}.keys` / `.values` int8 (1, H_kv, T, D) and `layers.{i}.keys.scale` /
`.values.scale` fp16 (1, H_kv, T, D / block), in the same safetensors file (the checksum covers
them). On load they are dequantized to fp16 to serve (the request buffer copy casts to the model's
dtype), to fp32 where a refresh quantizes them again.
"""

from __future__ import annotations

import torch

BLOCK = 32
CODEC = "int8-q8_0-b32-per-token"  # part of every int8 snapshot's key: another scheme is another key


def block_for(head_dim: int) -> int:
    return BLOCK if head_dim % BLOCK == 0 else head_dim


def quantize(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, H, T, D) float -> int8 (1, H, T, D) and fp16 scales (1, H, T, D / block)."""
    *lead, d = t.shape
    x = t.float().reshape(*lead, d // block, block)  # (1, H, T, nb, B)
    scale = (x.abs().amax(-1) / 127).to(torch.float16)  # (1, H, T, nb); the stored scale is what divides
    s = scale.float().unsqueeze(-1)
    q = torch.where(s > 0, (x / s.clamp_min(torch.finfo(torch.float32).tiny)).round(), torch.zeros_like(x))
    return q.clamp_(-127, 127).to(torch.int8).reshape(*lead, d), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """int8 (1, H, T, D) and scales (1, H, T, nb) -> (1, H, T, D) in `dtype`."""
    *lead, d = q.shape
    nb = scale.shape[-1]
    x = q.float().reshape(*lead, nb, d // nb) * scale.float().unsqueeze(-1)
    return x.reshape(*lead, d).to(dtype)


def quantize_layers(kv: list) -> tuple[int, list[tuple[torch.Tensor, ...]]]:
    """Per layer (k, v) (1, H, T, D) float -> the block and per layer (k codes, k scales, v codes, v scales),
    as a snapshot stores them."""
    block = block_for(kv[0][0].shape[3]) if kv else BLOCK
    return block, [(*quantize(k, block), *quantize(v, block)) for k, v in kv]


def dequantize_layers(codes: list, dtype: torch.dtype = torch.float16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """quantize_layers' codes -> per layer (k, v) (1, H, T, D) in `dtype`."""
    return [(dequantize(k, ks, dtype), dequantize(v, vs, dtype)) for k, ks, v, vs in codes]
