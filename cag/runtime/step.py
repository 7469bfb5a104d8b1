"""A lean decode step: one token through a Llama-shaped model's own modules, without transformers'
per-layer Python.

Why: a one-token `model(...)` forward over a StaticCache spends about a third of a SmolLM2 step on
a CPU outside the weight products (bench/bench_decode.py measures both): mask construction, cache bookkeeping,
output dataclasses, keyword plumbing through 30 layers. For one token none of it is needed: every
key at or before the new position is visible, so attention needs no mask, and the cache write is
one row per layer.

Same math as transformers, op for op where it matters for the bits:
  * products: the model's own Linear / FastLinear modules (so every CAG_WEIGHTS format is used), a
    layer's q/k/v and gate/up in one call each over their stacked weights (cag.model.stacked_products, same bits);
    with cag's kernels on the CPU every row a decode row (rows.flat: a question's tokens and an answer's
    get the same K/V); elsewhere a question's rows (rows.Part.asks) in bf16 under int8/int4 (rows.roles, packed.Packed);
  * RMSNorm: the formula of LlamaRMSNorm with the model's weights and eps (float32 inside);
  * rope: the model's own rotary embedding module (its values tabled per position: cos_sin);
    `rotate_half(x) * sin` is computed as `roll(x) * (sin with its first half negated)`, equal
    bit for bit (negation is exact);
  * attention: the query heads that share a K/V head folded into the query length (as
    cag/model/prefill_attention.py does), q (1, H_kv, rep, D) over keys (1, H_kv, pos+1, D), no K/V copy; decode
    rows over bf16 K/V through cag.kernels.native's kernel where CAG_DECODE_KERNELS resolved to amx, avx512 or avx2.
The cache is the caller's StaticCache: the new K and V are written in place at `pos` (and each layer's
`cumulative_length` set to pos+1): a transformers forward continues from a consistent cache.

Families: cag.model.families (FAMILIES): Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, OLMo-2, Gemma 3; window
layers in any of them over cag's native decode rows only. With cag's kernels attention, products, glue, q/k norms
and post-norms run natively (Granite's multipliers, Gemma's gelu in torch between them); with int4 or bf16
weights on the AVX-512 (int4 on the AVX2) kernels all layers up to OLMo-2's run in one native call (all_layers).

`for_model(model)` returns None for anything else (other families or layer structures, hooks, training
mode), and `why_not(model)` says why; the caller then runs the transformers forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from cag.kernels import backends
from cag.model import families
from cag.model.families import FAMILIES, family, norms, projections, qk_norms, refs  # noqa: F401 (FAMILIES: the step's API)
from cag.model.stacked_products import group_one as _one
from cag.model.stacked_products import group_products as _together
from cag.model.stacked_products import group_shared as _shared
from cag.model.stacked_products import product
from cag.model.windows import layer_windows
from cag.runtime import all_layers, attention
from cag.runtime import norms as norms_
from cag.runtime.rows import Part, Rows, offsets
from cag.runtime.rows import flat as flat_rows
from cag.runtime.rows import roles as role_runs

ATTR = "_cag_lean_step"  # where the built step (or the verdict None) is kept on the model


class Layer(NamedTuple):
    """What the step calls and reads in one decoder layer."""

    norm1: torch.Tensor  # input_layernorm weight (hidden,)
    eps1: float
    qkv: Callable  # (x, roles) -> q, k, v
    o: Callable  # (x, roles) -> o_proj(x)
    scale: float  # attention's 1/sqrt(D)
    norm2: torch.Tensor  # post_attention_layernorm weight (hidden,)
    eps2: float
    gate_up: Callable  # (x, roles) -> gate, up
    down: Callable  # (x, roles) -> down_proj(x)
    act: Callable
    qkv_packed: Callable | None  # (x, roles) -> the stacked q/k/v product (R, (H + 2 H_kv) D) where packed, else None
    gu_packed: Callable | None  # (x, roles) -> the stacked gate/up product (R, 2 I) where packed, else None
    qk: Callable | None  # (q, k) -> q, k normed before rope (Family.qk_norm), else None
    qkv_one: Callable | None  # x -> the stacked q/k/v product (R, (H + 2 H_kv) D) of plain Linears, else None
    after: tuple | None = None  # ((weight, eps) x 2): the norms on the attention's and the MLP's outputs (Gemma 3)
    window: int | None = None  # its sliding window W (cag.model.windows), None: full attention
    kind: str | None = None  # the layer type whose rope it takes (Gemma 3), None: the model's one rope
    softcap: float | None = None  # its scores' soft cap (Gemma 2's attn_logit_softcapping), None: none


class LeanStep:
    """Per-model references gathered once; `run` steps the parts of a pass over them."""

    def __init__(self, model, few: bool | None = None):
        config, inner, fam = model.config, model.model, family(model)
        self.refs = refs(model)
        self.model_dtype = inner.embed_tokens.weight.dtype
        self.device = inner.embed_tokens.weight.device
        # The residual stream's dtype. Where every product is packed (CAG_WEIGHTS other than fp32, on the CPU)
        # the products take bf16 input and give float32 whatever the compute dtype, so the step runs in
        # float32 under bf16 compute too: the knowledge prefill (the transformers forward) keeps bf16's memory
        # and speed, decode rows take cag's float32 glue and one-call layers, and the step's logits come
        # closer to the model's float32 ones, not farther (norm weights and embedding rows widen exactly)
        every = (all(not isinstance(m, torch.nn.Linear) for m in inner.layers.modules())
                 and hasattr(model.lm_head, "decode"))
        self.dtype = torch.float32 if self.device.type == "cpu" and every else self.model_dtype
        self.n_kv = config.num_key_value_heads
        # few kernels a step (CUDA, where each kernel's launch costs more than its work; attention.attend_few):
        # fused norms, q and k roped in one pass, an attention merge of three kernels. Other bits than the
        # op-for-op formulas below, the same in every request's rows and in `cag` and `full`
        self.few = self.device.type == "cuda" if few is None else few  # few=True on the CPU: tests/test_fixed_rows.py
        if self.few and self.device.type == "cuda":
            attention.probe_cuda(self.device)  # which kernel reads the suffix, decided before any capture
        self.rms = (norms_.rms_fused if self.few else norms_.rms_fp32 if self.dtype == torch.float32
                    else norms_.rms_w32 if fam.norm_weight_fp32 else norms_.rms)
        self.post = fam.post_norms  # OLMo-2: norms on the attention's and the MLP's outputs
        # Granite: the embedding x embedding_multiplier, each branch x residual_multiplier, logits / logits_scaling
        self.embed_mult: float | None; self.residual: float | None; self.logits_div: float | None  # noqa: E702
        self.embed_mult, self.residual, self.logits_div = (  # Granite's, read only where the family has them
            (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) if fam.multipliers
            else (None,) * 3)
        self.embed = inner.embed_tokens.weight  # (V, hidden)
        # Gemma: the embedding row x embed_scale, multiplied in the weights' dtype as its module does
        self.embed_scale = inner.embed_tokens.embed_scale.to(self.embed.dtype) if fam.embed_scale else None
        self.softcap = getattr(config, "final_logit_softcapping", None)  # logits = c tanh(logits / c) where set
        self.rope = inner.rotary_emb
        self.tables: dict[str | None, tuple] = {}  # per rope kind: cos, sin (positions, D) for static types (cos_sin)
        self.final = (families.norm_weight(inner.norm, fam, self.dtype), families.eps(inner.norm))
        self.head = getattr(model.lm_head, "decode", model.lm_head.forward)  # one row per request: the packed copy
        first = inner.layers[0].self_attn
        self.head_dim, self.rep = first.head_dim, first.num_key_value_groups
        d = self.head_dim
        # q, k, v columns of the q/k/v product
        self.widths = (config.num_attention_heads * d, self.n_kv * d, self.n_kv * d)
        # per layer; products through the packed weights where there are any (FastLinear.decode)
        self.fns: list[Layer] = []
        f = product  # bound methods skip Module.__call__: a few µs x 7 x layers
        packed = True  # every layer's q/k/v and gate/up share packed copies (they take bf16 input)
        self.silu = True  # and every layer's MLP is silu(gate) x up (native glue and one-call layers); Gemma: gelu
        kinds: list[str | None] = list(families.rope_kinds(model) or ()) or [None] * config.num_hidden_layers
        self.kinds = set(kinds)  # the rope kinds a pass tables (cos_sin)
        windows = layer_windows(config)[0]
        for layer, kind, window in zip(inner.layers[: config.num_hidden_layers], kinds, windows):
            a, m = layer.self_attn, layer.mlp
            (n1, n2), (qkv, gu, act) = norms(layer, fam), projections(layer, fam)
            inter = m.down_proj.in_features
            nw = [(families.norm_weight(n, fam, self.dtype), families.eps(n))  # (weight, eps) of each norm
                  for n in (n1, n2, *(families.after_norms(layer, fam) or ()))]
            self.fns.append(Layer(
                *nw[0], _together(qkv, self.widths), f(a.o_proj), a.scaling,
                *nw[1], _together(gu, (inter, inter)), f(m.down_proj), act.forward,
                _shared(qkv), _shared(gu), qk_norms(a, fam, self.rms, d, self.dtype), _one(qkv),
                tuple(nw[2:]) or None, window, kind, getattr(a, "attn_logit_softcapping", None),
            ))
            packed = packed and self.fns[-1].qkv_packed is not None and self.fns[-1].gu_packed is not None
            self.silu = self.silu and all_layers.is_silu(act)
        # decode rows over bf16 K/V through the attention of the backend the model loaded with (cag.kernels.backends)
        self.backend = backends.of(model).for_heads(self.head_dim)
        self.kernel = self.backend.attention(self.head_dim)
        # and with it, for a float32 step over packed products, the glue around them in one call each: RMSNorm
        # straight to the products' bf16 input, rope of q and k with the K/V write (same bits as the formulas
        # below), silu(gate) x up rounded to bf16 (its own bits); all layers in one call (cag.runtime.all_layers)
        glue = self.kernel and packed and self.dtype == torch.float32
        # the AVX2 library's glue on CPUs below the AVX-512 floor (kernels/arch/avx2/step.cpp), same signatures
        ops = self.backend.ops()
        self.glue: tuple[Callable, Callable, Callable | None] | None = (
            (ops.rms_bf16, ops.rope_write, ops.silu_mul_bf16 if self.silu else None) if glue else None)
        # a family's q/k norms and post-norms then run natively too (rms_f32: what the one-call layers compute)
        self.branch_rms = ops.rms_f32 if glue else self.rms
        if glue and fam.qk_norm:
            self.fns = [L._replace(qk=qk_norms(layer.self_attn, fam, self.branch_rms, d, self.dtype))
                        for L, layer in zip(self.fns, inner.layers)]
        # one-call layers compute Llama's layer with its families' pieces up to OLMo-2's (and windows): not Gemma's
        plain = self.silu and not fam.sandwich
        self.fused = all_layers.weights(self, model) if glue and plain and self.backend.all_layers else None
        # with cag's kernels on the CPU over packed products (whose kernels give a row its bits at any row
        # count: cag.model.weights) every row of a pass is a decode row (rows.flat): one arithmetic for a
        # question's tokens and an answer's, so an answer's K/V are what a prefill of it writes. fp32
        # weights multiply through torch's GEMM, whose sums may move with the row count: not flat
        self.flat = self.kernel is not None and self.device.type == "cpu" and packed
        # window layers read their last W keys: only cag's native attention over decode rows does (and Gemma's
        # float32 norms by 1 + weight need a float32 step): elsewhere for_model leaves them to transformers' forward
        self.fits = (self.flat or all(w is None for w in windows)) and not (
            fam.sandwich and not (self.flat and self.dtype == torch.float32))
        half = self.head_dim // 2
        # rotate_half(x) = cat(-x2, x1) = roll(x, D/2) * sign, sign = (-1)*D/2 ++ (+1)*D/2
        self.sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.device, self.dtype)  # (D,)

    @property
    def native(self) -> str:
        """Which of cag's native kernels decode rows run on: "layers" (all layers in one call, cag.runtime.all_layers),
        "glue" (attention, products, norm / rope / silu glue and a family's q/k norms and post-norms, each its
        own call; multipliers in torch between them), "attention" (the attention alone) or "none"."""
        return "layers" if self.fused else "glue" if self.glue else "attention" if self.kernel else "none"

    def cos_sin(self, pos: torch.Tensor, h: torch.Tensor, top: int, kind: str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (R, D) at positions `pos` (R,), all below `top` (known on the host:
        nothing is read back from the device), from the model's rope module.

        Static rope types are read from a table the module fills in blocks of 64 positions: cos and
        sin are vectorized over all but a tail of each call, and the tail is computed another way
        (last bits differ), so a position's values must not depend on which rows share the call.
        Dynamic types rescale with the longest position of the call: they are called directly. `kind`: the
        layer type (Gemma 3's rotary module holds a rope per type: families.rope_kinds), None: the one rope."""
        rope = self.rope if kind is None else (lambda x, p: self.rope(x, p, kind))
        if kind is None and "dynamic" in str(getattr(self.rope, "rope_type", "")):
            cos, sin = rope(h, pos.view(1, -1))
            return cos[0], sin[0] * self.sign
        table = self.tables.get(kind)
        if table is None or top > table[0].shape[0]:
            n = -(-top // 1024) * 1024
            blocks = [rope(h, torch.arange(a, a + 64, device=self.device).view(1, -1)) for a in range(0, n, 64)]
            table = self.tables[kind] = (torch.cat([c[0] for c, _ in blocks]),
                                         torch.cat([si[0] for _, si in blocks]) * self.sign)
        return table[0][pos], table[1][pos]

    def current(self, model) -> bool:
        """Still the model's modules (identity: modules define no __eq__), dtype and device."""
        return self.embed.dtype == self.model_dtype and self.embed.device == self.device and refs(model) == self.refs

    @torch.inference_mode()
    def run(self, parts: list[Part], buffers, all_logits: bool = False) -> list[torch.Tensor]:
        """Several parts (e.g. the decode batch and a newly admitted question) in one pass over the
        weights: their rows share every product's weight reads (decode rows in CAG_WEIGHTS, a
        question's rows in its copy for questions: parts.roles), alone or not; attention is per part.

        A part (cag.runtime.rows.Part) holds m new tokens for each of B requests, toks (B, m): request b's
        tokens, written to suffix positions starts[b] .. starts[b]+m-1 of its slot slots[b] in `buffers`
        (cag.runtime.slots.Slots) and seen at absolute positions n_b + those, n_b = prefixes[b].n. Each
        token attends to all of its request's prefix (shared, read-only, never copied: requests on one
        PrefixKV read it once per layer together) and causally to its own suffix. Returns per part the
        logits (B, V) of each request's last token, or (B, m, V) with all_logits."""
        s = self
        picks = None
        if s.flat:  # one part of single-token rows (rows.flat); each part's logits picked back at the end
            given, (one, picks) = parts, flat_rows(parts)
            parts = [one]
        rms, n_kv, rep, d, half = s.rms, s.n_kv, s.rep, s.head_dim, s.head_dim // 2
        kernel = s.kernel if s.device.type == "cpu" else None
        rows = [Rows(p, s, r0, buffers.room) for p, r0 in zip(parts, offsets(parts))]
        fns: Sequence[Layer] = s.fns
        R = rows[-1].r1
        toks = torch.cat([p.toks.reshape(-1) for p in parts]).to(s.device)  # (R,)
        h = s.embed.index_select(0, toks)  # (R, hidden)
        h = (h if s.embed_scale is None else h * s.embed_scale).to(s.dtype)
        if s.embed_mult is not None:
            h = h * s.embed_mult
        post, mult, widths, branch_rms = s.post, s.residual, s.widths, s.branch_rms
        pos, top = torch.cat([r.pos for r in rows]), max(r.top for r in rows)
        ropes = {}  # per rope kind: cos, sin (R, 1, D)
        for kind in s.kinds:
            c, si = s.cos_sin(pos, h, top, kind)
            ropes[kind] = (c.view(R, 1, d), si.view(R, 1, d))
        rows_slot = torch.cat([r.rows_slot for r in rows])  # (R,) where each token's K/V is written
        rows_pos = torch.cat([r.rows_pos for r in rows])
        roles = role_runs(parts)
        up = s.dtype != torch.float32
        glue, norm = s.glue, rms  # a layer's norms: with the glue, (R, hidden) float32 -> bf16, the products' input
        if glue:
            norm, rope_write, silu_mul = glue
        if glue and all_layers.applies(s, rows, roles, kernel):  # all layers in one native call
            cos, sin = ropes[None]
            h = all_layers.layers(s, rows[0], h, cos.view(R, d), sin.view(R, d), buffers, rows_slot, rows_pos)
            fns = ()
        for i, (L, K, V) in enumerate(zip(fns, buffers.k, buffers.v)):  # L: the layer's Layer
            cos, sin = ropes[L.kind]
            x = h if post else norm(h, L.norm1, L.eps1)
            if glue:  # roped q (R, H, D); roped k and v written to each row's slot and position
                assert L.qkv_packed is not None  # the glue is built only where q/k/v and gate/up are packed
                qkv = L.qkv_packed(x, roles)
                if L.qk is not None:  # q and k normed in torch, then the native rope over them
                    q, k, v = qkv.split(widths, -1)
                    q, k = L.qk(q, k)
                    qkv = torch.cat([q.reshape(R, -1), k.reshape(R, -1), v], -1)
                q = rope_write(qkv, cos.view(R, d), sin.view(R, d), K, V, rows_slot, rows_pos, n_kv * rep)
            elif s.few and L.qk is None and L.qkv_one is not None:  # q and k roped in one pass over their columns
                t = L.qkv_one(x)  # (R, (H + 2 H_kv) D)
                qk = t[:, : (n_kv * rep + n_kv) * d].view(R, n_kv * rep + n_kv, d)
                qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin)  # (R, H + H_kv, D), the same rope as below
                q, k = qk[:, : n_kv * rep], qk[:, n_kv * rep :]
                K[rows_slot, :, rows_pos] = k.to(K.dtype)
                V[rows_slot, :, rows_pos] = t[:, (n_kv * rep + n_kv) * d :].view(R, n_kv, d).to(V.dtype)
            else:
                # (R, H*D), (R, H_kv*D) x 2: views of one product where the weights are stacked
                q, k, v = L.qkv(x, roles)
                if L.qk is not None:
                    q, k = L.qk(q, k)
                q, k = q.view(R, n_kv * rep, d), k.view(R, n_kv, d)
                # roped K into the request's slot
                K[rows_slot, :, rows_pos] = (k * cos + k.roll(half, -1) * sin).to(K.dtype)
                V[rows_slot, :, rows_pos] = v.view(R, n_kv, d).to(V.dtype)
                q = (q * cos + q.roll(half, -1) * sin).to(q.dtype)  # OLMo-2 ropes in float32 (its cos, sin), then casts
            outs = [attention.attend(r, q[r.r0 : r.r1], K, V, i, L.scale, up, kernel, s.few, s.backend.paired, L.window,
                                     L.softcap) for r in rows]
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
            # with the glue: the products' bf16 input, as they round it
            y = L.o(o.to(torch.bfloat16) if glue else o, roles)
            if post:
                y = branch_rms(y, L.norm1, L.eps1)
            elif L.after is not None:
                y = branch_rms(y, *L.after[0])
            h = h + y if mult is None else h + y * mult
            x = h if post else norm(h, L.norm2, L.eps2)
            if glue and silu_mul is not None:  # silu(gate) x up straight to the down product's bf16 input
                assert L.gu_packed is not None  # as above: the glue is built only where it is
                y = L.down(silu_mul(L.gu_packed(x, roles)), roles)
            elif glue:  # another activation (Gemma's gelu) in torch, rounded to the down product's bf16 input
                assert L.gu_packed is not None
                g, u = L.gu_packed(x, roles).chunk(2, -1)
                y = L.down((L.act(g) * u).to(torch.bfloat16), roles)
            else:
                g, u = L.gate_up(x, roles)
                y = L.down(L.act(g) * u, roles)
            if post:
                y = branch_rms(y, L.norm2, L.eps2)
            elif L.after is not None:
                y = branch_rms(y, *L.after[1])
            h = h + y if mult is None else h + y * mult
        w, e = s.final
        if picks is not None:
            if all_logits:  # (B, m, V) per part: its requests' rows, in order
                return [s.logits(rms(h[(pk - (p.toks.shape[1] - 1))[:, None] + torch.arange(p.toks.shape[1])], w, e))
                        for pk, p in zip(picks, given)]
            logits = s.logits(rms(h[torch.cat(picks)], w, e))  # one product over each request's last row
            return list(logits.split([len(p) for p in picks]))
        if all_logits:
            return [s.logits(rms(h[r.r0 : r.r1].view(r.B, r.m, -1), w, e)) for r in rows]
        logits = s.logits(rms(torch.cat([h[r.r0 : r.r1].view(r.B, r.m, -1)[:, -1] for r in rows]), w, e))  # one product
        return list(logits.split([r.B for r in rows]))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed rows (Granite: divided by its logits_scaling, as its forward does; final
        logit soft-capping where the config sets it, as Gemma's forward applies it)."""
        y = self.head(x) if self.logits_div is None else self.head(x) / self.logits_div
        return y if self.softcap is None else torch.tanh(y / self.softcap) * self.softcap


def for_model(model) -> LeanStep | None:
    """The lean step for `model`, built once and kept on it; None when it does not apply."""
    entry = model.__dict__.get(ATTR)
    if entry is not None:
        step = entry[0]
        if step is None or step.current(model):
            return step
    step = None if why_not(model) else LeanStep(model)
    step = step if step is None or step.fits else None  # Gemma off cag's native decode rows: transformers' forward
    model.__dict__[ATTR] = (step,)  # a tuple: "checked, unsupported" is kept as (None,)
    return step


def why_not(model) -> str | None:
    """Why the lean step does not take `model` (families.why_not, or Gemma off cag's decode rows), else None."""
    if (reason := families.why_not(model)) is not None:
        return reason
    entry = model.__dict__.get(ATTR)
    if entry is not None and entry[0] is None:
        return ("sliding-window layers need cag's native attention over decode rows (int4 or bf16 weights on "
                "cag's CPU kernels)")
    return None
