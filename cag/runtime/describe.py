"""What decodes a loaded model's answers, as answers, /health and `cag info` report it: the weights
format, the decode kernels (and why those), the fast step (cag.runtime.step) or transformers' forward
(and why not the step), and which of cag's native kernels the step runs (LeanStep.native)."""

from __future__ import annotations

import torch

from cag.model.loading import LoadedModel
from cag.runtime import step


def decode_path(lm: LoadedModel) -> dict:
    built = step.for_model(lm.model)
    return {"weights": lm.weights, "arithmetic": lm.backend.arithmetic(lm.weights), "kernels": lm.kernels,
            "kernels_reason": lm.kernels_why or None,
            "step": "fast" if built is not None else "forward",
            "step_reason": None if built is not None else step.why_not(lm.model),
            "native": built.native if built is not None else "none"}


def info(lm: LoadedModel, kv_dtype: torch.dtype) -> dict:
    """The model's shape and how cag runs it (`cag info`); `kv_dtype`: the snapshots' storage dtype."""
    text = lm.model.config.get_text_config(decoder=True)
    return {"model": lm.name, "model_type": getattr(text, "model_type", None), "class": type(lm.model).__name__,
            "parameters": sum(p.numel() for p in lm.model.parameters()), "layers": lm.n_layers,
            "heads": text.num_attention_heads, "kv_heads": lm.n_kv_heads, "head_dim": lm.head_dim,
            "context": lm.max_context, "dtype": str(lm.dtype).removeprefix("torch."), "device": lm.device.type,
            **decode_path(lm),
            "kv_dtype": str(kv_dtype).removeprefix("torch."), "kv_bytes_per_token": lm.kv_bytes(1, kv_dtype)}
