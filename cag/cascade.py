"""Attention of new rows over a shared prefix and each request's own suffix.

Two ways, same math:
  * cascade (CPU, float32): the prefix part and the suffix part each through torch's fused CPU
    attention kernel, which also returns each row's log-sum-exp; the two partial outputs are merged
    by their log-sum-exps (o = o_p * e^(lse_p - lse) + o_s * e^(lse_s - lse), lse = logaddexp).
    The prefix (1, H_kv, n, D) is read once per layer for all rows of its requests, never copied;
  * one softmax (elsewhere, or without that kernel): scores against the prefix and the suffix
    concatenated, one softmax, two products.
Query heads that share a K/V head are folded into the query rows (GQA without repeating K/V):
(B, H_kv, M, D), M = m * rep, row t*rep + r = token t, head r of the group.
"""

from __future__ import annotations

import torch

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _flash_parts(r, q: torch.Tensor, Ks: torch.Tensor, Vs: torch.Tensor, i: int, scale: float) -> torch.Tensor:
    """Cascade attention of q (B, H_kv, M, D) -> (B, H_kv, M, D)."""
    n_kv, M, d = q.shape[1], q.shape[2], q.shape[3]
    o_s, lse_s = _FLASH(q, Ks, Vs, 0.0, False, attn_mask=r.bias, scale=scale)  # (B, H_kv, M, D), (B, H_kv, M)
    o = torch.empty_like(q, dtype=torch.float32) if len(r.groups) > 1 else None
    for prefix, idx in r.groups:
        Kp, Vp = prefix.kv[i]  # (1, H_kv, n, D), shared
        if Kp.dtype != q.dtype:  # a prefix built for another dtype (not the engine's own)
            Kp, Vp = Kp.to(q.dtype), Vp.to(q.dtype)
        os_, ls = (o_s, lse_s) if idx is None else (o_s[idx], lse_s[idx])
        b = os_.shape[0]
        if Kp.shape[2] == 0:  # an empty prefix: the suffix is all there is
            og = os_
        else:
            qg = q if idx is None else q[idx]
            op, lp = _FLASH(qg.transpose(0, 1).reshape(1, n_kv, b * M, d), Kp, Vp, 0.0, False, scale=scale)
            op = op.view(n_kv, b, M, d).transpose(0, 1)  # (b, H_kv, M, D)
            wp, ws = _weights(lp.view(n_kv, b, M).transpose(0, 1), ls)  # (b, H_kv, M, 1) each
            og = op.float() * wp + os_.float() * ws  # (b, H_kv, M, D) float32
        if o is None:
            o = og
        else:
            o[idx] = og.to(o.dtype)
    return o


def _weights(lp: torch.Tensor, ls: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two parts' shares e^(lse_p - lse), e^(lse_s - lse), lse = logaddexp(lse_p, lse_s), from
    log-sum-exps (b, H_kv, M), as (b, H_kv, M, 1).

    exp and logaddexp are vectorized over all but the tail of a call, and the tail is computed
    another way (last bits differ): each request's H_kv*M values get a row of their own, padded to
    a multiple of 32 floats (the vector loop's stride), so every value takes the vector path
    whatever the number of requests in the call; a request's bits do not depend on its batch."""
    b, n_kv, M = lp.shape
    hm = n_kv * M
    pad = torch.zeros(2, b, -(-hm // 32) * 32, dtype=lp.dtype, device=lp.device)
    pad[0, :, :hm], pad[1, :, :hm] = lp.reshape(b, hm), ls.reshape(b, hm)
    lse = torch.logaddexp(pad[0], pad[1])
    w = torch.exp(pad - lse)[:, :, :hm]  # (2, b, hm)
    return w[0].view(b, n_kv, M, 1), w[1].view(b, n_kv, M, 1)


def _merge_out(o: torch.Tensor, B: int, m: int, n_kv: int, rep: int, d: int, dtype) -> torch.Tensor:
    return o.reshape(B, n_kv, m, rep, d).transpose(1, 2).reshape(B * m, n_kv * rep * d).to(dtype)


def attend(r, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, i: int, scale: float, up: bool) -> torch.Tensor:
    """One part's attention in layer i: q (B*m, H, D) roped -> (B*m, H*D), head-major as o_proj expects."""
    B, m, M = r.B, r.m, r.M
    n_kv, d = K.shape[1], K.shape[3]
    rep = M // m
    q = q.view(B, m, n_kv, rep, d).transpose(1, 2).reshape(B, n_kv, M, d)
    Ks = K[r.slots, :, : r.L] if r.one is None else K[r.one, None, :, : r.L]  # (B, H_kv, L, D): only the suffix is per request
    Vs = V[r.slots, :, : r.L] if r.one is None else V[r.one, None, :, : r.L]
    out_dtype = q.dtype  # the compute dtype; K/V may be held in a narrower one (LoadedModel.attn_dtype)
    if _FLASH is not None and q.device.type == "cpu":  # the fused kernel scores and sums in float32 inside
        return _merge_out(_flash_parts(r, q.to(K.dtype), Ks, Vs, i, scale), B, m, n_kv, rep, d, out_dtype)
    if up:  # scores of bf16/fp16 products rounded to 8 bits would move the softmax: attend in float32
        q, Ks, Vs = q.float(), Ks.float(), Vs.float()
    ss = torch.matmul(q, Ks.transpose(-1, -2)).mul_(scale).masked_fill_(r.hidden, float("-inf"))  # (B, H_kv, M, L)
    o = torch.empty_like(q) if len(r.groups) > 1 else None
    for prefix, idx in r.groups:
        Kp, Vp = prefix.kv[i]  # (1, H_kv, n, D), shared
        if up:
            Kp, Vp = Kp.float(), Vp.float()
        qg, sg, vg = (q, ss, Vs) if idx is None else (q[idx], ss[idx], Vs[idx])
        b, n = qg.shape[0], Kp.shape[2]
        sp = torch.matmul(qg.transpose(0, 1).reshape(n_kv, b * M, d), Kp[0].transpose(-1, -2)).mul_(scale)
        p = torch.cat([sp.view(n_kv, b, M, n).transpose(0, 1), sg], -1)  # (b, H_kv, M, n + L)
        p = torch.softmax(p, -1)  # one softmax over prefix and suffix keys
        og = torch.matmul(p[..., :n].transpose(0, 1).reshape(n_kv, b * M, n), Vp[0])  # (H_kv, b*M, D)
        og = og.view(n_kv, b, M, d).transpose(0, 1) + torch.matmul(p[..., n:], vg)  # (b, H_kv, M, D)
        if o is None:
            o = og
        else:
            o[idx] = og
    return _merge_out(o, B, m, n_kv, rep, d, K.dtype)
