"""Attention of new rows over a shared prefix and each request's own suffix.

Two ways, same math:
  * cascade (CPU): the prefix (in one part, rarely two: _runs) and the suffix each through torch's fused
    CPU attention kernel, which also returns each row's log-sum-exp; the partial outputs are merged
    by their log-sum-exps (o = sum_j o_j * e^(lse_j - lse), lse = log sum_j e^lse_j).
    The prefix (1, H_kv, n, D) is read once per layer for all rows of its requests, never copied;
  * cascade (CUDA, K/V in bf16 or fp16): the prefix through torch's CUDA flash kernel (which
    splits the keys across the GPU when the query rows are few), the suffix by one float32 softmax,
    merged the same way (a float32 product of a few rows against a long prefix gets little
    parallelism from cuBLAS: bench/gpu_check.py measures the step);
  * few kernels (CUDA's step: _few): the suffix in one masked kernel, the prefix in one flash call, a
    merge of five elementwise kernels; the same math, other last bits;
  * one softmax (elsewhere, or without those kernels): scores against the prefix and the suffix
    concatenated, one softmax, two products.
Decode parts (one token per request) over bf16 K/V go to the backend's attention instead (cag.kernels.backends:
AVX-512, AMX or AVX2): prefix and suffix in one call, nothing to merge here.
Query heads that share a K/V head are folded into the query rows (GQA without repeating K/V):
(B, H_kv, M, D), M = m * rep, row t*rep + r = token t, head r of the group.
"""

from __future__ import annotations

from typing import Any

import torch

# torch's fused kernels, where this build has them (op handles: typed Any, as torch.ops are)
_FLASH: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CUDA_FLASH: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
_CUDA_EFFICIENT: Any = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
# what the few-kernel CUDA attention reads the suffix with: "efficient" (torch's memory-efficient kernel,
# masked, with its log-sum-exps: one kernel), or why not ("softmax: ..." and the float32 softmax of
# _cuda_suffix). Decided once by probe_cuda (cag.runtime.step, at the step's build), before any capture
CUDA_SUFFIX: dict[str, str | None] = {"way": None}


def _runs(n: int) -> tuple[int, int]:
    """How a prefix of n keys is read: c keys, then a tail of t = n - c (0 or 4). torch's CPU flash
    kernel in float32 gives a row bits that depend on the other rows of its call when the last block
    of 512 keys holds 1-3 keys (measured: every length 1-3 mod 512 up to 1100, none other), so such a
    prefix is read as two parts, which the merge below joins like the suffix. Reading every prefix in
    4 runs as heads (more work items for 2 threads) was measured too: no faster in a decode step."""
    t = 4 if 0 < n % 512 < 4 and n > 4 else 0
    return n - t, t


def _prefix_parts(
    q: torch.Tensor, Kp: torch.Tensor, Vp: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (1, H_kv, R, D) over a prefix (1, H_kv, n, D) -> outputs (P, H_kv, R, D) and log-sum-exps
    (P, H_kv, R), one per part the prefix is read in (_runs)."""
    c, t = _runs(Kp.shape[2])
    o, lse = _FLASH(q, Kp[:, :, :c], Vp[:, :, :c], 0.0, False, scale=scale)
    if t:
        ot, lt = _FLASH(q, Kp[:, :, c:], Vp[:, :, c:], 0.0, False, scale=scale)
        o, lse = torch.cat([o, ot]), torch.cat([lse, lt])
    return o, lse


def _flash_parts(r, q: torch.Tensor, Ks: torch.Tensor, Vs: torch.Tensor, i: int, scale: float,
                 suffix=None, prefix_parts=None) -> torch.Tensor:
    """Cascade attention of q (B, H_kv, M, D) -> (B, H_kv, M, D) float32: the suffix, then each
    group's prefix, each with its log-sum-exp, merged. `suffix` (r, q, Ks, Vs, scale) -> (o, lse) and
    `prefix_parts` (q, Kp, Vp, scale) -> (P, ...) outputs and lses: torch's CPU flash kernel by default."""
    n_kv, M, d = q.shape[1], q.shape[2], q.shape[3]
    if suffix is None:
        o_s, lse_s = _FLASH(q, Ks, Vs, 0.0, False, attn_mask=r.bias, scale=scale)  # (B, H_kv, M, D), (B, H_kv, M)
    else:
        o_s, lse_s = suffix(r, q, Ks, Vs, scale)
    prefix_parts = prefix_parts or _prefix_parts
    o = torch.empty_like(q, dtype=torch.float32) if len(r.groups) > 1 else None
    for prefix, idx in r.groups:
        Kp, Vp = prefix.kv[i]  # (1, H_kv, n, D), shared
        if Kp.dtype != q.dtype:  # a prefix built for another dtype (not the engine's own)
            Kp, Vp = Kp.to(q.dtype), Vp.to(q.dtype)
        os_, ls = (o_s, lse_s) if idx is None else (o_s[idx], lse_s[idx])
        b = os_.shape[0]
        if Kp.shape[2] == 0:  # an empty prefix: the suffix is all there is
            og = os_.float()
        else:
            qg = q if idx is None else q[idx]
            op, lp = prefix_parts(qg.transpose(0, 1).reshape(1, n_kv, b * M, d), Kp, Vp, scale)  # (P, H_kv, b*M, ...)
            P = op.shape[0]
            op = op.reshape(P, n_kv, b, M, d).transpose(1, 2)  # (P, b, H_kv, M, D)
            parts = torch.cat([op, os_[None]]).float()  # (P+1, b, H_kv, M, D): the prefix runs, then the suffix
            w = _weights(torch.cat([lp.reshape(P, n_kv, b, M).transpose(1, 2), ls[None]]))  # (P+1, b, H_kv, M, 1)
            og = parts[0] * w[0]
            for j in range(1, P + 1):  # in a fixed order
                og = og + parts[j] * w[j]
        if o is None:
            o = og
        else:
            o[idx] = og.to(o.dtype)
    assert o is not None  # a part has one group at least
    return o


def _cuda_suffix(
    r, q: torch.Tensor, Ks: torch.Tensor, Vs: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The suffix on CUDA: q (B, H_kv, M, D) over its L keys in float32, one softmax -> outputs
    (B, H_kv, M, D) and log-sum-exps (B, H_kv, M). Every row sees at least its own key."""
    # (B, H_kv, M, L)
    ss = torch.matmul(q.float(), Ks.float().transpose(-1, -2)).mul_(scale).masked_fill_(r.hidden, float("-inf"))
    lse = torch.logsumexp(ss, -1)
    return torch.matmul(torch.exp(ss - lse[..., None]), Vs.float()), lse


def _cuda_prefix(
    q: torch.Tensor, Kp: torch.Tensor, Vp: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix on CUDA through torch's flash kernel (bf16/fp16 in, float32 sums; it splits the
    keys across the GPU when the query rows are few): (1, H_kv, R, D), (1, H_kv, R)."""
    o, lse = _CUDA_FLASH(q, Kp, Vp, 0.0, False, False, scale=scale)[:2]
    return o, lse


def _efficient_suffix(
    r, q: torch.Tensor, Ks: torch.Tensor, Vs: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The suffix on CUDA in one kernel: q (B, H_kv, M, D) over its L keys (bf16/fp16), the keys past
    each row's own masked by an additive bias in q's dtype -> outputs (B, H_kv, M, D) in q's dtype and
    log-sum-exps (B, H_kv, M) float32 (the kernel pads its lse rows to 32: sliced off)."""
    bias = r.__dict__.get("bias_low")
    if bias is None or bias.dtype != q.dtype:  # once a pass, shared by the layers
        bias = r.bias_low = torch.zeros(r.hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(
            r.hidden, float("-inf")
        )
    B, n_kv, M, _ = q.shape
    o, lse = _CUDA_EFFICIENT(q, Ks, Vs, bias.expand(B, n_kv, M, Ks.shape[2]), True, 0.0, False, scale=scale)[:2]
    return o, lse[..., :M]


def probe_cuda(device) -> str:
    """Decide CUDA_SUFFIX["way"] on `device` (once): the efficient kernel where it runs and agrees with the
    float32 softmax on a masked case (1e-2 on outputs, 1e-3 on log-sum-exps), else the softmax, with why."""
    if CUDA_SUFFIX["way"] is not None:
        return CUDA_SUFFIX["way"]
    way = "softmax: torch has no memory-efficient attention op"
    if _CUDA_EFFICIENT is not None:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            B, n_kv, M, L, d = 3, 2, 3, 64, 64
            q, k, v = (torch.randn(B, n_kv, n, d, generator=g, device=device).to(torch.bfloat16) for n in (M, L, L))

            class R:  # the one field of Rows the suffix reads: keys past each request's own are hidden
                hidden = (torch.arange(L, device=device) > torch.tensor([5, 17, 40], device=device)[:, None, None])[
                    :, None
                ].expand(B, 1, M, L)

            o1, l1 = _efficient_suffix(R(), q, k, v, d ** -0.5)
            o2, l2 = _cuda_suffix(R(), q, k, v, d ** -0.5)
            diff = max(float((o1.float() - o2).abs().max()), float((l1 - l2).abs().max()) * 10)
            way = "efficient" if diff < 1e-2 else f"softmax: the efficient kernel differs by {diff:.3g}"
        except Exception as e:  # noqa: BLE001 - the op's signature or limits on this build: the softmax serves
            way = f"softmax: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    CUDA_SUFFIX["way"] = way
    return way


def _few(r, q: torch.Tensor, Ks: torch.Tensor, Vs: torch.Tensor, i: int, scale: float) -> torch.Tensor:
    """Cascade attention in few kernels (a step on CUDA launches hundreds; each costs more than its
    work): q (B, H_kv, M, D) over one prefix and the rows' suffixes -> (B, H_kv, M, D) float32.

    The suffix in one kernel with its log-sum-exps (CUDA: _efficient_suffix where probe_cuda chose it;
    the CPU: torch's flash kernel, masked), the prefix in one flash call for all rows, and the merge
    o = o_s + (o_p - o_s) * sigmoid(lse_p - lse_s) (the prefix's share e^lse_p / (e^lse_p + e^lse_s))
    in float32: sub, sigmoid, two casts and a lerp."""
    B, n_kv, M, d = q.shape
    if q.is_cuda:
        suffix = _efficient_suffix if CUDA_SUFFIX["way"] == "efficient" else _cuda_suffix
        o_s, l_s = suffix(r, q, Ks, Vs, scale)
    else:
        o_s, l_s = _FLASH(q, Ks, Vs, 0.0, False, attn_mask=r.bias, scale=scale)
    Kp, Vp = r.groups[0][0].kv[i]  # (1, H_kv, n, D), shared
    if Kp.shape[2] == 0:
        return o_s.float()
    if Kp.dtype != q.dtype:
        Kp, Vp = Kp.to(q.dtype), Vp.to(q.dtype)
    qp = q.transpose(0, 1).reshape(1, n_kv, B * M, d)
    o_p, l_p = _cuda_prefix(qp, Kp, Vp, scale) if q.is_cuda else _FLASH(qp, Kp, Vp, 0.0, False, scale=scale)
    o_p, l_p = o_p.view(n_kv, B, M, d).transpose(0, 1), l_p.view(n_kv, B, M).transpose(0, 1)  # (B, H_kv, M, ...)
    return torch.lerp(o_s.float(), o_p.float(), torch.sigmoid(l_p - l_s)[..., None])


def _weights(lse: torch.Tensor) -> torch.Tensor:
    """Each part's share e^(lse_j - lse), lse = log sum_j e^(lse_j), from the parts' log-sum-exps
    (P, b, H_kv, M), as (P, b, H_kv, M, 1).

    exp is vectorized over all but the tail of a call, and the tail is computed another way (last
    bits differ): each request's H_kv*M values get a row of their own, padded to a multiple of 32
    floats (the vector loop's stride), so every value takes the vector path whatever the number of
    requests in the call; max, subtraction, the sums (in part order) and division are exact or
    elementwise. A request's bits do not depend on its batch."""
    P, b, n_kv, M = lse.shape
    hm = n_kv * M
    pad = torch.zeros(P, b, -(-hm // 32) * 32, dtype=lse.dtype, device=lse.device)
    pad[:, :, :hm] = lse.reshape(P, b, hm)
    e = torch.exp(pad - pad.amax(0))  # (P, b, padded)
    total = e[0]
    for j in range(1, P):
        total = total + e[j]
    return (e / total)[:, :, :hm].reshape(P, b, n_kv, M, 1)


def _merge_out(o: torch.Tensor, B: int, m: int, n_kv: int, rep: int, d: int, dtype) -> torch.Tensor:
    return o.reshape(B, n_kv, m, rep, d).transpose(1, 2).reshape(B * m, n_kv * rep * d).to(dtype)


def attend(r, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, i: int, scale: float, up: bool,
           kernel=None, few: bool = False, paired: bool = False, window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """One part's attention in layer i: q (B*m, H, D) roped -> (B*m, H*D), head-major as o_proj expects.
    `kernel`: the backend's decode attention (cag.kernels.backends: AVX-512, AMX or AVX2), used for decode parts (one
    token per request) over bf16 K/V, `paired` where it takes a prefix pre-paired; a part's role, not its batch,
    picks the kernel. `few`: the
    few-kernel cascade (_few; the step's on CUDA) where its kernels take the part. `window`: a window layer's W
    (each row reads its last W keys), which only the backend's kernel reads (the step takes such models only
    where every row is a decode row); `softcap`: a soft cap on its scores (Gemma 2), likewise the kernel's alone."""
    B, m, M = r.B, r.m, r.M
    n_kv, d = K.shape[1], K.shape[3]
    rep = M // m
    if kernel is not None and m == 1 and not r.question and K.dtype == torch.bfloat16:
        return (_native(kernel, r, q.view(B, n_kv, rep, d), K, V, i, scale, paired, window, softcap)
                .reshape(B, n_kv * rep * d).to(q.dtype))
    if window is not None or softcap is not None:
        raise ValueError("window layers and soft-capped scores go through the backend's attention, as decode rows "
                         "over bf16 K/V")
    q = q.view(B, m, n_kv, rep, d).transpose(1, 2).reshape(B, n_kv, M, d)
    # (B, H_kv, L, D): only the suffix is per request
    Ks = K[r.slots, :, : r.L] if r.one is None else K[r.one, None, :, : r.L]
    Vs = V[r.slots, :, : r.L] if r.one is None else V[r.one, None, :, : r.L]
    out_dtype = q.dtype  # the compute dtype; K/V may be held in a narrower one (LoadedModel.attn_dtype)
    if few and len(r.groups) == 1 and K.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 256 and (
            _FLASH is not None if q.device.type == "cpu" else _CUDA_FLASH is not None and q.is_cuda):
        return _merge_out(_few(r, q.to(K.dtype), Ks, Vs, i, scale), B, m, n_kv, rep, d, out_dtype)
    if _FLASH is not None and q.device.type == "cpu":  # the fused kernel scores and sums in float32 inside
        return _merge_out(_flash_parts(r, q.to(K.dtype), Ks, Vs, i, scale), B, m, n_kv, rep, d, out_dtype)
    if _CUDA_FLASH is not None and q.is_cuda and K.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 256:
        o = _flash_parts(r, q.to(K.dtype), Ks, Vs, i, scale, _cuda_suffix, _cuda_prefix)
        return _merge_out(o, B, m, n_kv, rep, d, out_dtype)
    if up:  # scores of bf16/fp16 products rounded to 8 bits would move the softmax: attend in float32
        q, Ks, Vs = q.float(), Ks.float(), Vs.float()
    ss = torch.matmul(q, Ks.transpose(-1, -2)).mul_(scale).masked_fill_(r.hidden, float("-inf"))  # (B, H_kv, M, L)
    acc = torch.empty_like(q) if len(r.groups) > 1 else None
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
        if acc is None:
            acc = og
        else:
            acc[idx] = og
    assert acc is not None  # a part has one group at least
    return _merge_out(acc, B, m, n_kv, rep, d, K.dtype)


def _native(
    kernel, r, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, i: int, scale: float, paired: bool,
    window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Decode rows through the native kernel: q (B, H_kv, rep, D) -> (B, H_kv, rep, D) float32, each
    request over its prefix (read once per group of requests sharing it) and its own suffix keys
    [0, r.lens[b]) in its slot, in one call per prefix; no K/V gathered or copied. A window layer's rows read
    their last `window` keys (common/attention_plan.h); `softcap`: the scores soft-capped (Gemma 2)."""
    q = q.float().contiguous()
    win = ({} if window is None else {"window": int(window)}) | ({} if softcap is None else {"softcap": float(softcap)})
    if len(r.groups) == 1:
        prefix = r.groups[0][0]
        Kp, Vp = bf16_kv(prefix.kv[i])
        return kernel(q, Kp[0], Vp[0], K, V, r.slots_cpu, r.lens, scale,
                      *(_pairs(prefix, i, Kp, Vp) if paired else ()), **win)
    o = torch.empty_like(q)
    for prefix, idx in r.groups:
        Kp, Vp = bf16_kv(prefix.kv[i])
        j = idx.cpu()
        o[idx] = kernel(
            q[idx].contiguous(),
            Kp[0],
            Vp[0],
            K,
            V,
            r.slots_cpu[j].contiguous(),
            r.lens[j].contiguous(),
            scale,
            *(_pairs(prefix, i, Kp, Vp) if paired else ()),
            **win,
        )
    return o


def paired(prefix, i: int) -> list[torch.Tensor]:
    """Layer i of a prefix as cag.kernels.native's decode_layers takes it: K, V (H_kv, n, D) bf16 and their pairs."""
    Kp, Vp = bf16_kv(prefix.kv[i])
    return [Kp[0], Vp[0], *_pairs(prefix, i, Kp, Vp)]


def _pairs(prefix, i: int, Kp: torch.Tensor, Vp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i of a prefix as the AVX-512 kernel reads it (cag.kernels.native's pair_kv: K's dim pairs per
    16 keys, V's key pairs per dim), made at its first decode step and kept on it (PrefixKV.made): the
    kernel no longer rearranges the prefix at every step. Same values: same bits. A prefix with int8
    codes (CAG_KV_DTYPE=int8) is paired from them (pair_kv8): decode rows then read 8-bit K/V."""
    pairs = prefix.made.setdefault("pairs", {})
    if i not in pairs:
        if prefix.codes and prefix.codes[i] is not None:  # an int8 snapshot: its codes (pair_kv8), read in place of K/V
            pairs[i] = torch.ops.cag.pair_kv8(*(t[0].contiguous() for t in prefix.codes[i]))
            prefix.codes[i] = None
        else:
            pairs[i] = torch.ops.cag.pair_kv(Kp[0], Vp[0])
    return pairs[i]


def bf16_kv(kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = kv  # (1, H_kv, n, D); a prefix built for another dtype than the engine's own is converted
    return (k, v) if k.dtype == torch.bfloat16 else (k.to(torch.bfloat16), v.to(torch.bfloat16))
