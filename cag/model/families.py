"""The model families cag.runtime.step computes, and the check that a model is one of them (`why_not`).

The lean step runs a model's own modules; what it computes is Llama's decoder layer (norm -> attention
with rope on q and k -> residual -> norm -> gated MLP -> residual; biases, if any, inside the Linears)
with the differences a Family names. Checked exactly against transformers' classes: a subclass, another
layer, other norms or another rope are refused, and the model decodes through transformers' forward.

Families (FAMILIES) and the transformers classes that take the step:
  * LlamaForCausalLM, MistralForCausalLM (full attention), Qwen2ForCausalLM (q/k/v biases): Llama's layer;
  * Qwen3ForCausalLM: RMSNorm of each head of q and k (q_norm, k_norm over D) before rope;
  * Phi3ForCausalLM: q/k/v in one qkv_proj and gate/up in one gate_up_proj (their columns in that order);
  * GraniteForCausalLM: the embedding x embedding_multiplier, each residual branch x residual_multiplier,
    attention scaled by attention_multiplier (the attention's own `scaling`), logits / logits_scaling;
  * Olmo2ForCausalLM: no norms on the layer's inputs; RMSNorm on the attention's and the MLP's outputs
    (post_attention_layernorm, post_feedforward_layernorm) before each residual add; q_norm and k_norm
    over the whole q and k projections; its RMSNorm applies the weight in float32 before the cast.
Partial rotary embeddings (rope on part of a head) and longrope (its frequencies switch with a call's
longest position) are refused. With cag's kernels every family decodes its attention, products, glue
(RMSNorm to bf16, rope with the K/V write, silu x up), q/k norms and post-norms natively; with int4 or bf16
weights on the AVX-512 kernels all layers run in one native call (cag.runtime.all_layers), which computes
every difference above (q/k norms, post-norms, the residual multiplier; Granite's embedding and logits
multipliers stay outside the layers).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import NamedTuple

import torch

from cag.kernels import backends


class Family(NamedTuple):
    """How a family's decoder layer differs from Llama's (norm -> attention with rope on q and k ->
    residual -> norm -> gated MLP -> residual; biases, if any, inside the Linears)."""

    prefix: str  # its classes in transformers.models.<model_type>.modeling_<model_type>: <prefix>ForCausalLM, ...
    # RMSNorm of q and k before rope: "head" over each head (Qwen3), "all" over the projection (OLMo-2)
    qk_norm: str | None = None
    post_norms: bool = False  # norms on the attention's and the MLP's outputs, none on their inputs (OLMo-2)
    multipliers: bool = False  # embedding, residual and logits multipliers (Granite)
    fused_proj: bool = False  # q/k/v in one qkv_proj, gate/up in one gate_up_proj (Phi-3)
    # RMSNorm multiplies by its weight in float32, then casts (OLMo-2; other bits in bf16)
    norm_weight_fp32: bool = False


# model_type -> how its layer differs from Llama's
FAMILIES = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3", qk_norm="head"),
    "phi3": Family("Phi3", fused_proj=True),
    "granite": Family("Granite", multipliers=True),
    "olmo2": Family("Olmo2", qk_norm="all", post_norms=True, norm_weight_fp32=True),
}


def classes(model_type: str):
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = FAMILIES[model_type].prefix
    return tuple(getattr(mod, prefix + s) for s in ("ForCausalLM", "DecoderLayer", "Attention", "MLP", "RMSNorm"))


def family(model) -> Family:
    return FAMILIES[model.config.model_type]


def norms(layer, fam: Family) -> tuple:
    """The layer's two norms in the order the step applies them (before or after attention, then the MLP)."""
    if fam.post_norms:
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm
    return layer.input_layernorm, layer.post_attention_layernorm


def projections(layer, fam: Family) -> tuple[tuple, tuple, torch.nn.Module]:
    """(q/k/v Linears, gate/up Linears, activation): one Linear each where the family fuses them."""
    a, m = layer.self_attn, layer.mlp
    if fam.fused_proj:
        return (a.qkv_proj,), (m.gate_up_proj,), m.activation_fn
    return (a.q_proj, a.k_proj, a.v_proj), (m.gate_proj, m.up_proj), m.act_fn



def _hooked(model: torch.nn.Module) -> bool:
    """Hooks (accelerate offload, user hooks) would be skipped by calling forward methods directly."""
    return any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in model.modules())



def refs(model) -> tuple:
    """Every object the step calls or reads, in a fixed order: a swapped module (weights.apply on a
    copy of the model) makes the tuple differ, and the step is rebuilt."""
    inner, fam = model.model, family(model)
    out = [backends.of(model), inner.embed_tokens, inner.embed_tokens.weight, inner.rotary_emb,
           inner.norm, inner.norm.weight, model.lm_head]
    for layer in inner.layers[: model.config.num_hidden_layers]:
        a, m = layer.self_attn, layer.mlp
        (n1, n2), (qkv, gu, act) = norms(layer, fam), projections(layer, fam)
        out += [layer, n1, n1.weight, *qkv, a.o_proj, n2, n2.weight, *gu, m.down_proj, act]
        if fam.qk_norm:
            out += [a.q_norm, a.q_norm.weight, a.k_norm, a.k_norm.weight]
    return tuple(out)


def why_not(model) -> str | None:
    """None when the lean step computes what this model's forward computes, else the reason."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model type {model_type!r} (the fast step covers {', '.join(FAMILIES)})"
    fam = FAMILIES[model_type]
    causal, layer_cls, attn_cls, mlp_cls, norm_cls = classes(model_type)
    if type(model) is not causal:
        return f"class {type(model).__name__}"
    if model.training:
        return "training mode (dropout)"
    inner = model.model
    layers = inner.layers[: config.num_hidden_layers]
    if type(inner.embed_tokens) is not torch.nn.Embedding or type(inner.norm) is not norm_cls:
        return "embedding or final norm of another kind"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    rope_type = str(getattr(inner.rotary_emb, "rope_type", ""))
    if "longrope" in rope_type:
        return "longrope rotary embeddings (their frequencies switch with a call's longest position)"
    for layer in layers:
        a = layer.self_attn
        if (type(layer) is not layer_cls or type(a) is not attn_cls or type(layer.mlp) is not mlp_cls
                or any(type(n) is not norm_cls for n in norms(layer, fam))):
            return "a layer of another structure"
        if getattr(a, "sliding_window", None) is not None:
            return "sliding-window attention"
        if a.num_key_value_groups * config.num_key_value_heads != config.num_attention_heads:
            return "query heads not a multiple of K/V heads"
        inv_freq = getattr(inner.rotary_emb, "inv_freq", None)
        if inv_freq is None or 2 * inv_freq.numel() != a.head_dim:
            return "partial rotary embeddings (rope on part of each head)"
        if fam.qk_norm:
            per = (a.head_dim,) * 2 if fam.qk_norm == "head" else (config.num_attention_heads * a.head_dim,
                                                                   config.num_key_value_heads * a.head_dim)
            if any(type(n) is not norm_cls or n.weight.shape != (w,) for n, w in zip((a.q_norm, a.k_norm), per)):
                return "q/k norms of another kind"
    if _hooked(model):
        return "forward hooks"
    return None



def qk_norms(attn, fam: Family, rms: Callable, d: int, dtype: torch.dtype | None = None) -> Callable | None:
    """(q (R, H*D), k (R, H_kv*D)) -> q, k normed as the family's attention norms them before rope:
    over each head's D (Qwen3: (R, H, D) out) or over the whole projection (OLMo-2); None: not at all.
    `dtype`: the step's, which the norm weights are widened to (None: as they are)."""
    if fam.qk_norm is None:
        return None
    wq, eq, wk, ek = attn.q_norm.weight, attn.q_norm.variance_epsilon, attn.k_norm.weight, attn.k_norm.variance_epsilon
    if dtype is not None:
        wq, wk = wq.to(dtype), wk.to(dtype)
    if fam.qk_norm == "all":
        return lambda q, k: (rms(q, wq, eq), rms(k, wk, ek))
    return lambda q, k: (rms(q.view(q.shape[0], -1, d), wq, eq), rms(k.view(k.shape[0], -1, d), wk, ek))
