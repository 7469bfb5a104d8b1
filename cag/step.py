"""A lean decode step: one token through a Llama-architecture model's own modules, without
transformers' per-layer Python.

Why: a one-token `model(...)` forward over a StaticCache spends about a third of a SmolLM2 step on
a CPU (15-21 ms of ~33-43 ms) outside the weight products: mask construction, cache bookkeeping,
output dataclasses, keyword plumbing through 30 layers. For one token none of it is needed: every
key at or before the new position is visible, so attention needs no mask, and the cache write is
one row per layer.

Same math as transformers, op for op where it matters for the bits:
  * products: the model's own Linear / FastLinear modules (so every CAG_WEIGHTS format is used);
  * RMSNorm: the formula of LlamaRMSNorm with the model's weights and eps (float32 inside);
  * rope: the model's own rotary embedding module, called with the position as transformers calls
    it; `rotate_half(x) * sin` is computed as `roll(x) * (sin with its first half negated)`, equal
    bit for bit (negation is exact);
  * attention: the query heads that share a K/V head folded into the query length (as
    cag/attention.py does), q (1, H_kv, rep, D) over keys (1, H_kv, pos+1, D), no K/V copy.
The cache is the caller's StaticCache: the new K and V are written in place at `pos` and each
layer's `cumulative_length` set to pos+1, so the next transformers forward (a question's prefill)
continues from a consistent cache.

`for_model(model)` returns None for anything else (other layer structures, hooks, training mode),
and `LeanStep.bind(cache)` None for a cache it does not write; the caller then runs the
transformers forward.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

ATTR = "_cag_lean_step"  # where the built step (or the verdict None) is kept on the model
# model_type -> class-name prefix: decoder layers identical to Llama's (norm -> attention ->
# residual -> norm -> gated MLP -> residual; rope on q and k; biases, if any, inside the Linears).
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def _classes(model_type: str):
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = FAMILIES[model_type]
    return tuple(getattr(mod, prefix + s) for s in ("ForCausalLM", "DecoderLayer", "Attention", "MLP", "RMSNorm"))


def _hooked(model: torch.nn.Module) -> bool:
    """Hooks (accelerate offload, user hooks) would be skipped by calling forward methods directly."""
    return any(m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in model.modules())


def _global_hooks() -> bool:
    from torch.nn.modules import module as nn_module

    return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _refs(model) -> tuple:
    """Every object the step calls or reads, in a fixed order: a swapped module (weights.apply on a
    copy of the model) makes the tuple differ, and the step is rebuilt."""
    inner = model.model
    out = [inner.embed_tokens, inner.embed_tokens.weight, inner.rotary_emb, inner.norm, inner.norm.weight, model.lm_head]
    for layer in inner.layers[: model.config.num_hidden_layers]:
        a, m = layer.self_attn, layer.mlp
        out += [layer, layer.input_layernorm, layer.input_layernorm.weight, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                layer.post_attention_layernorm, layer.post_attention_layernorm.weight,
                m.gate_proj, m.up_proj, m.down_proj, m.act_fn]
    return tuple(out)


def why_not(model) -> str | None:
    """None when the lean step computes what this model's forward computes, else the reason."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model type {model_type!r}"
    causal, layer_cls, attn_cls, mlp_cls, norm_cls = _classes(model_type)
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
    for layer in layers:
        a = layer.self_attn
        if (type(layer) is not layer_cls or type(a) is not attn_cls or type(layer.mlp) is not mlp_cls
                or type(layer.input_layernorm) is not norm_cls or type(layer.post_attention_layernorm) is not norm_cls):
            return "a layer of another structure"
        if getattr(a, "sliding_window", None) is not None:
            return "sliding-window attention"
        if a.num_key_value_groups * config.num_key_value_heads != config.num_attention_heads:
            return "query heads not a multiple of K/V heads"
    if _hooked(model):
        return "forward hooks"
    return None


class LeanStep:
    """Per-model references gathered once; `bind(cache)` gives the per-request step function."""

    def __init__(self, model):
        config, inner = model.config, model.model
        self.refs = _refs(model)
        self.dtype = inner.embed_tokens.weight.dtype
        self.device = inner.embed_tokens.weight.device
        self.n_kv = config.num_key_value_heads
        self.rms = _rms_fp32 if self.dtype == torch.float32 else _rms
        self.embed = inner.embed_tokens.weight  # (V, hidden)
        self.rope = inner.rotary_emb
        self.final = (inner.norm.weight, inner.norm.variance_epsilon)
        self.head = model.lm_head.forward
        self.layers = []
        first = inner.layers[0].self_attn
        self.head_dim, self.rep = first.head_dim, first.num_key_value_groups
        for layer in inner.layers[: config.num_hidden_layers]:
            a, m = layer.self_attn, layer.mlp
            # Bound forwards skip Module.__call__ (no hooks here: checked) — a few µs x 7 x layers.
            self.layers.append((
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                a.q_proj.forward, a.k_proj.forward, a.v_proj.forward, a.o_proj.forward, a.scaling,
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                m.gate_proj.forward, m.up_proj.forward, m.down_proj.forward, m.act_fn.forward,
            ))
        half = self.head_dim // 2
        # rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * sign, sign = (-1)*D/2 ++ (+1)*D/2
        self.sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.device, self.dtype)  # (D,)

    def current(self, model) -> bool:
        """Still the model's modules (identity: modules define no __eq__), dtype and device."""
        return self.embed.dtype == self.dtype and self.embed.device == self.device and _refs(model) == self.refs

    def bind(self, cache):
        """The step function over `cache` (a StaticCache laid out for this model), or None."""
        from transformers.cache_utils import StaticLayer

        layers = getattr(cache, "layers", None)
        if not layers or len(layers) != len(self.layers) or _global_hooks():
            return None
        kvs = []
        for layer in layers:
            if type(layer) is not StaticLayer or not layer.is_initialized:
                return None
            k, v = layer.keys, layer.values
            if (k.dtype != self.dtype or v.dtype != self.dtype or k.device != self.device
                    or k.shape[:2] != (1, self.n_kv) or k.shape[3] != self.head_dim or v.shape != k.shape):
                return None
            kvs.append((k, v, layer.cumulative_length))
        return _Bound(self, kvs)


class _Bound:
    """One request's decode over one cache. Its position tensor is its own (requests run in threads)."""

    def __init__(self, step: LeanStep, kvs: list):
        self.step, self.kvs = step, kvs
        self.pos = torch.zeros(1, 1, dtype=torch.long, device=step.device)  # (1, 1) position_ids

    @torch.inference_mode()
    def __call__(self, tok: int, pos: int) -> torch.Tensor:
        """Run token `tok` at position `pos`: write its K/V at `pos`, return its logits (V,)."""
        s = self.step
        rms, n_kv, rep, d, half = s.rms, s.n_kv, s.rep, s.head_dim, s.head_dim // 2
        n = pos + 1
        self.pos.fill_(pos)
        h = s.embed.narrow(0, tok, 1)  # (1, hidden), a view: never written in place
        cos, sin = s.rope(h, self.pos)  # (1, 1, D) each: the model's own rope, as transformers calls it
        cos, sin = cos.view(d), sin.view(d) * s.sign  # sin with its first half negated, (D,)
        for (w1, e1, q_f, k_f, v_f, o_f, scale, w2, e2, g_f, u_f, d_f, act), (keys, values, length) in zip(s.layers, self.kvs):
            x = rms(h, w1, e1)
            q = q_f(x).view(1, n_kv, rep, d)  # head kv*rep + r -> (kv, r), as repeat_kv pairs them
            k = k_f(x).view(1, n_kv, d)
            torch.add(k * cos, k.roll(half, -1) * sin, out=keys.select(2, pos))  # roped K, in place
            values.select(2, pos).copy_(v_f(x).view(1, n_kv, d))
            length.fill_(n)  # the cache's own count: the next transformers forward writes at n
            q = q * cos + q.roll(half, -1) * sin
            a = F.scaled_dot_product_attention(q, keys.narrow(2, 0, n), values.narrow(2, 0, n), scale=scale)
            h = h + o_f(a.reshape(1, n_kv * rep * d))  # (1, H_kv, rep, D) -> (1, H*D), head-major
            x = rms(h, w2, e2)
            h = h + d_f(act(g_f(x)) * u_f(x))
        w, e = s.final
        return s.head(rms(h, w, e))[0]  # (V,)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's formula, op for op (float32 inside, weight applied in the compute dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rms_fp32(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """_rms for float32 compute, without its two no-op casts (two calls x 61 norms a token)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def for_model(model) -> LeanStep | None:
    """The lean step for `model`, built once and kept on it; None when it does not apply."""
    entry = model.__dict__.get(ATTR)
    if entry is not None:
        step = entry[0]
        if step is None or step.current(model):
            return step
    step = None if why_not(model) else LeanStep(model)
    model.__dict__[ATTR] = (step,)  # a tuple: "checked, unsupported" is kept as (None,)
    return step
