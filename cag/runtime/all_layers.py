"""The lean step's decoder layers in one native call (`decode_layers` of the backend's library: AVX-512's with int4
or bf16 weights, AVX2's with int4) for a pass of decode rows only (one new token per request, on any number of
prefixes).

Why: as separate ops a layer is ~13 torch calls and 5 OpenMP regions, whose fixed costs were a
large share of a step on a short prefix on 2 cores, one call per layer still a measurable one
(bench/bench_decode.py). The
native call runs the same pieces (RMSNorm to bf16, the products, a family's q/k norms (Qwen3, OLMo-2),
rope with the K/V write, the attention over the prefix (pre-paired on AVX-512) and the slots, post-norms (OLMo-2),
silu x up, the residual multiplier (Granite) and adds) for every layer in
one parallel region, in the same order: the same bits as the separate ops (tests/test_native.py), so
`cag` == `full` and batched == alone hold as before.

`weights(step, model)` gives what the call takes, once: a torch.classes.<library>.DecodeWeights holding each
layer's named tensors, checked when added; None where any layer lacks them (int8 or fp32, a bias
other than q/k/v's, another activation, soft-capped scores): the step then runs the separate ops.
"""

from __future__ import annotations

import torch

from cag.model.families import family
from cag.model.packed import Avx2Packed, NativePacked
from cag.model.stacked_products import own
from cag.runtime import attention

_NONE = torch.empty(0)  # the second tensor of a bf16 product (int4 has two: weights and scales)


def _packed(packs, bias: bool = False) -> tuple | None:
    """A packed copy as decode_layers takes it, where decode rows go straight to cag.kernels.native's product with
    float32 out and no bias (`bias`: or one, which the call adds): int4 (qw, dm) or bf16 (w, nothing)."""
    if (not isinstance(packs, (NativePacked, Avx2Packed)) or packs.out_dtype != torch.float32
            or (packs.bias is not None and not bias)):
        return None
    if packs.fmt == "int4":
        return packs.packed
    return (packs.packed, _NONE) if packs.fmt == "bf16" else None


def is_silu(act) -> bool:
    return type(act).__name__ in ("SiLU", "SiLUActivation")


def weights(step, model):
    """All layers' weights as decode_layers takes them (a torch.classes.cag.DecodeWeights, each layer's tensors
    named and checked once here), or None where some layer lacks them. `step`: the lean step with its glue (so
    its layers have stacked q/k/v and gate/up, and silu)."""
    first, fam = step.fns[0], family(model)
    residual = float(model.config.residual_multiplier) if fam.multipliers else 1.0  # Granite's; 1: none (the same bits)
    out = getattr(torch.classes, step.backend.library).DecodeWeights(
        heads=step.n_kv * step.rep, kv_heads=step.n_kv, head_dim=step.head_dim, hidden=model.config.hidden_size,
        scale=first.scale)
    for f, layer in zip(step.fns, model.model.layers):
        qkv = _packed(f.qkv_packed, bias=True)
        o, gu, dn = (_packed(p) for p in (own(layer.self_attn.o_proj), f.gu_packed, own(layer.mlp.down_proj)))
        if (None in (qkv, o, gu, dn) or any(n.dtype != torch.float32 for n in (f.norm1, f.norm2))
                or f.softcap is not None):  # soft-capped scores: the separate calls' attention takes the cap
            return None
        b = f.qkv_packed.bias  # Qwen2's q/k/v bias, widened as the separate ops' float32 add widens it
        bias = _NONE if b is None else b.detach().float().contiguous()
        a = layer.self_attn  # q/k norms (Qwen3 per head, OLMo-2 over the projection) widened as the step widens them
        qn, kn = ((a.q_norm.weight.detach().float().contiguous(), a.k_norm.weight.detach().float().contiguous())
                  if fam.qk_norm else (_NONE, _NONE))
        qe, ke = (a.q_norm.variance_epsilon, a.k_norm.variance_epsilon) if fam.qk_norm else (0.0, 0.0)
        out.add_layer(
            input_norm=f.norm1.contiguous(),
            input_eps=f.eps1,
            qkv=qkv[0],
            qkv_scales=qkv[1],
            o=o[0],
            o_scales=o[1],
            post_norm=f.norm2.contiguous(),
            post_eps=f.eps2,
            gate_up=gu[0],
            gate_up_scales=gu[1],
            down=dn[0],
            down_scales=dn[1],
            qkv_bias=bias,
            q_norm=qn,
            q_eps=qe,
            k_norm=kn,
            k_eps=ke,
            post_norms=fam.post_norms,
            residual_multiplier=residual,
            window=f.window or 0,
        )
    return out


def applies(step, rows: list, roles, kernel) -> bool:
    """A pass decode_layers computes: decode rows only, one part, the backend's attention (all_layers': pre-paired)."""
    return step.fused is not None and roles is None and len(rows) == 1 and kernel is not None


def _per_layer(paired: bool) -> int:
    """How many tensors one prefix layer gives the call: 4 pre-paired (attention.paired), else its K and V."""
    return 4 if paired else 2


def _flat(prefix, n_layers: int, paired: bool) -> list[torch.Tensor]:
    """A prefix's layers as decode_layers takes them ([K, V] (H_kv, n, D) bf16 a layer, and their pairs where the
    backend's attention reads them: attention.paired), kept on it where they are views of its K/V and its pairs
    (no bytes of their own)."""
    key = "layers" if paired else "layers-unpaired"
    flat = prefix.made.get(key)
    if flat is None or len(flat) != _per_layer(paired) * n_layers:
        flat = [t for i in range(n_layers) for t in (
            attention.paired(prefix, i) if paired else (kv[0] for kv in attention.bf16_kv(prefix.kv[i])))]
        if prefix.kv[0][0].dtype == torch.bfloat16:
            prefix.made[key] = flat
    return flat


def layers(step, r, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, buffers,
           rows_slot: torch.Tensor, rows_pos: torch.Tensor) -> torch.Tensor:
    """All layers over h (R, hidden) float32 (in place; returned): cos, sin (R, D); r: the part's Rows,
    its requests in groups by prefix (each prefix read once for its requests)."""
    L, paired = len(buffers.k), step.backend.paired
    n = _per_layer(paired)
    flats, rows, slots, lens = [], [], [], []
    for prefix, idx in r.groups:
        j = torch.arange(r.B) if idx is None else idx.cpu()
        flats.append(_flat(prefix, L, paired))
        rows.append(j)
        slots.append(r.slots_cpu if idx is None else r.slots_cpu[j])
        lens.append(r.lens if idx is None else r.lens[j])
    flat = flats[0] if len(flats) == 1 else [t for i in range(L) for f in flats for t in f[n * i : n * i + n]]
    step.backend.ops().decode_layers(
        h, step.fused, cos, sin, buffers.k, buffers.v, rows_slot, rows_pos, flat, rows, slots, lens
    )
    return h
