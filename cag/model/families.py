"""The model families cag.runtime.step computes, and the check that a model is one of them (`why_not`).

The lean step runs a model's own modules; what it computes is Llama's decoder layer (norm -> attention
with rope on q and k -> residual -> norm -> gated MLP -> residual; biases, if any, inside the Linears)
with the differences a Family names. Checked exactly against transformers' classes: a subclass, another
layer, other norms or another rope are refused, and the model decodes through transformers' forward.

Families (FAMILIES) and the transformers classes that take the step:
  * LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v biases): Llama's layer;
  * Qwen3ForCausalLM: RMSNorm of each head of q and k (q_norm, k_norm over D) before rope;
  * Phi3ForCausalLM: q/k/v in one qkv_proj and gate/up in one gate_up_proj (their columns in that order);
  * GraniteForCausalLM: the embedding x embedding_multiplier, each residual branch x residual_multiplier,
    attention scaled by attention_multiplier (the attention's own `scaling`), logits / logits_scaling;
  * Olmo2ForCausalLM: no norms on the layer's inputs; RMSNorm on the attention's and the MLP's outputs
    (post_attention_layernorm, post_feedforward_layernorm) before each residual add; q_norm and k_norm
    over the whole q and k projections; its RMSNorm applies the weight in float32 before the cast;
  * Gemma3ForCausalLM (model type gemma3_text): the embedding x sqrt(hidden) in the weights' dtype; norms on
    each branch's input and output (input_layernorm, post_attention_layernorm; pre_feedforward_layernorm,
    post_feedforward_layernorm); RMSNorm by (1 + weight) in float32; q_norm and k_norm per head; rope per layer
    type (a base for sliding-window layers, another for full ones); gelu(tanh) x up; attention scaled by
    query_pre_attn_scalar^-1/2 (its `scaling`); its float32 norms need a float32 step (LeanStep.fits).
    Bidirectional attention is refused; final logit soft-capping is applied (LeanStep.logits);
  * Gemma2ForCausalLM: Gemma 3's layer without q/k norms, one rope for every layer, and attention logit
    soft-capping (scores cap * tanh(score / cap), attn_logit_softcapping), which cag's native attention applies.
Window layers in any family (Mistral's `sliding_window`, Qwen2's `use_sliding_window` from `max_window_layers`
on, Gemma 3's) read their last W keys (cag.model.windows), which only cag's native attention does: the step
takes such a model where every row is a decode row (LeanStep.fits), transformers' forward serves it elsewhere.
Partial rotary embeddings (rope on part of a head) and longrope (its frequencies switch with a call's
longest position) are refused. With cag's kernels every family decodes its attention, products, glue
(RMSNorm to bf16, rope with the K/V write, silu x up), q/k norms and post-norms natively; with int4 or bf16
weights on the AVX-512 kernels (int4 on the AVX2 ones) all layers run in one native call
(cag.runtime.all_layers), which computes every difference above (q/k norms, post-norms, the residual
multiplier, windows; Granite's embedding and logits multipliers stay outside the layers).
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
    sandwich: bool = False  # norms on each branch's input and output (Gemma 3: four a layer)
    plus_one: bool = False  # RMSNorm multiplies by 1 + weight, in float32 (Gemma)
    embed_scale: bool = False  # the embedding x its embed_scale, in the weights' dtype (Gemma)
    rope_types: bool = False  # a rope per layer type in one rotary module (Gemma 3)
    module: str | None = None  # transformers.models.<module>.modeling_<module> where not the model type's


# model_type -> how its layer differs from Llama's
FAMILIES = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3", qk_norm="head"),
    "phi3": Family("Phi3", fused_proj=True),
    "granite": Family("Granite", multipliers=True),
    "olmo2": Family("Olmo2", qk_norm="all", post_norms=True, norm_weight_fp32=True),
    "gemma2": Family("Gemma2", norm_weight_fp32=True, sandwich=True, plus_one=True, embed_scale=True),
    "gemma3_text": Family("Gemma3", qk_norm="head", norm_weight_fp32=True, sandwich=True, plus_one=True,
                          embed_scale=True, module="gemma3", rope_types=True),
}


def _modeling(model_type: str):
    """transformers' modeling module of the family (Family.module where not the model type's)."""
    name = FAMILIES[model_type].module or model_type
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def classes(model_type: str):
    mod, prefix = _modeling(model_type), FAMILIES[model_type].prefix
    return tuple(getattr(mod, prefix + s) for s in ("ForCausalLM", "DecoderLayer", "Attention", "MLP", "RMSNorm"))


def embedding_class(model_type: str) -> type:
    """The embedding module the family's model holds: torch's, or Gemma's scaled one."""
    fam = FAMILIES[model_type]
    return getattr(_modeling(model_type), fam.prefix + "TextScaledWordEmbedding") if fam.embed_scale else (
        torch.nn.Embedding)


def eps(norm) -> float:
    """An RMSNorm's epsilon (Gemma's modules call it `eps`)."""
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def norm_weight(norm, fam: Family, dtype: torch.dtype) -> torch.Tensor:
    """What an RMSNorm multiplies the normed row by: its weight in the step's dtype, or 1 + weight in float32
    (Gemma: the module adds them in float32 at every call, the same bits)."""
    return 1.0 + norm.weight.float() if fam.plus_one else norm.weight.to(dtype)


def after_norms(layer, fam: Family) -> tuple | None:
    """The norms on a sandwich layer's two branch outputs (Gemma 3), else None (OLMo-2's post-norms are its
    `norms`)."""
    return (layer.post_attention_layernorm, layer.post_feedforward_layernorm) if fam.sandwich else None


def family(model) -> Family:
    return FAMILIES[model.config.model_type]


def norms(layer, fam: Family) -> tuple:
    """The layer's two norms in the order the step applies them (before or after attention, then the MLP)."""
    if fam.post_norms:
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm
    if fam.sandwich:
        return layer.input_layernorm, layer.pre_feedforward_layernorm
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
        for n in after_norms(layer, fam) or ():
            out += [n, n.weight]
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
    if type(inner.embed_tokens) is not embedding_class(model_type) or type(inner.norm) is not norm_cls:
        return "embedding or final norm of another kind"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    kinds = rope_kinds(model)
    rope_types = [str(getattr(inner.rotary_emb, "rope_type", ""))] if kinds is None else [
        str(inner.rotary_emb.rope_type.get(k, "")) for k in kinds]
    if any("longrope" in t for t in rope_types):
        return "longrope rotary embeddings (their frequencies switch with a call's longest position)"
    if kinds is not None and any("dynamic" in t for t in rope_types):
        return "dynamic rotary embeddings per layer type"
    for layer in layers:
        a = layer.self_attn
        if (type(layer) is not layer_cls or type(a) is not attn_cls or type(layer.mlp) is not mlp_cls
                or any(type(n) is not norm_cls for n in (*norms(layer, fam), *(after_norms(layer, fam) or ())))):
            return "a layer of another structure"
        if a.num_key_value_groups * config.num_key_value_heads != config.num_attention_heads:
            return "query heads not a multiple of K/V heads"
        freqs = [getattr(inner.rotary_emb, "inv_freq", None)] if kinds is None else [
            getattr(inner.rotary_emb, f"{k}_inv_freq", None) for k in kinds]
        if any(f is None or 2 * f.numel() != a.head_dim for f in freqs):
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
    wq, eq, wk, ek = attn.q_norm.weight, eps(attn.q_norm), attn.k_norm.weight, eps(attn.k_norm)
    if fam.plus_one:
        wq, wk = norm_weight(attn.q_norm, fam, torch.float32), norm_weight(attn.k_norm, fam, torch.float32)
    elif dtype is not None:
        wq, wk = wq.to(dtype), wk.to(dtype)
    if fam.qk_norm == "all":
        return lambda q, k: (rms(q, wq, eq), rms(k, wk, ek))
    return lambda q, k: (rms(q.view(q.shape[0], -1, d), wq, eq), rms(k.view(k.shape[0], -1, d), wk, ek))


def rope_kinds(model) -> list[str] | None:
    """Per layer, the layer type whose rope it takes (Gemma 3: its rotary module holds one per type), or None
    where one rope serves every layer."""
    if not family(model).rope_types:
        return None
    return list(model.config.layer_types[: model.config.num_hidden_layers])
