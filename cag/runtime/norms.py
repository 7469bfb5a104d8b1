"""RMSNorm as the families' modules compute it, op for op (cag.runtime.step picks one per model).

Llama's weights multiply in the compute dtype after the cast; OLMo-2's and Gemma's in float32 before it
(Gemma's weight is 1 + weight: cag.model.families.norm_weight). Rows are (R, ..., hidden) or per head (R, H, D).
"""

from __future__ import annotations

import torch


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's formula, op for op (float32 inside, weight applied in the compute dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rms_fp32(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms for float32 compute, without its two no-op casts (two calls x 61 norms a token)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rms_fused(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in one call (torch's fused kernel where the device has one): float32 inside, the weight
    applied before the cast back, as Olmo2RMSNorm does."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)


def rms_w32(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Olmo2RMSNorm's formula: the weight applied in float32, then cast (the same as rms in float32)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w * h).to(x.dtype)
