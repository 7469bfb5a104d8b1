"""KV cache plumbing: chunked prefill, cache <-> tensors, trim. All transformers cache API use lives here.

One preallocated `StaticCache` per request buffer, sized n_prefix + question_room + answer_room:
each layer holds keys/values of shape (1, H_kv, max_len, D), written in place, so decoding never
concatenates or copies the prefix. Every forward passes `cache_position` AND `position_ids`
explicitly: with `cache_position` alone a restored static cache decodes differently.

Ingest, the no-cache baseline and the cached path all use a cache of the same max_len, so their
prefix forwards are the same operations: with float32 snapshots the cached answer equals the
uncached one bit for bit; with float16 snapshots they differ only by storage rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import StaticCache

from cag.model import file_pages


class Cancelled(Exception):
    """The caller asked to stop (client gone, timeout)."""


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values, each (1, H_kv, T, D)


def new_cache(model, max_len: int) -> StaticCache:
    return StaticCache(config=model.config, max_cache_len=max_len)


@torch.inference_mode()
def prefill(
    model,
    cache: StaticCache,
    ids: Sequence[int],
    start: int,
    chunk: int = 512,
    on_progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> torch.Tensor:
    """Run ids through the model at positions start.. in chunks; return last-position logits (V,).
    `should_stop` is checked between chunks (a client that went away stops a long prefill)."""
    if start + len(ids) > max_len(cache):
        raise ValueError(f"prefill past the cache: {start}+{len(ids)} > {max_len(cache)}")
    file_pages.check(model)  # its own weights may be views of their file: refuse them changed
    set_length(cache, start)
    device = next(model.parameters()).device
    logits = None
    for s in range(0, len(ids), chunk):
        if should_stop and should_stop():
            raise Cancelled("stopped during prefill")
        piece = torch.tensor([list(ids[s : s + chunk])], dtype=torch.long, device=device)  # (1, T)
        pos = torch.arange(start + s, start + s + piece.shape[1], device=device)  # (T,)
        out = model(
            input_ids=piece,
            past_key_values=cache,
            cache_position=pos,
            position_ids=pos.unsqueeze(0),
            use_cache=True,
            logits_to_keep=1,  # (1, 1, V): skips a (T, V) projection per chunk
        )
        logits = out.logits[0, -1]
        if on_progress:
            on_progress(piece.shape[1])
    return logits


def max_len(cache: StaticCache) -> int:
    return cache.layers[0].max_cache_len


def set_length(cache: StaticCache, n: int) -> None:
    """trim_to: the next write lands at position n. Slots >= n hold stale values that the
    causal mask built from cache_position never lets a query see."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(n)


def views(cache: StaticCache, n: int) -> KV:
    """Views of the first n positions of every layer, where they are: (1, H_kv, n, D)."""
    return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in cache.layers]


def stored(kv: KV, dtype: torch.dtype) -> tuple[KV, list | None]:
    """K/V as `cag` reads them from a snapshot in `dtype` (`full` then reads what `cag` reads): cast to a
    float dtype; for int8, quantized as the snapshot stores them and dequantized to fp16 as a load gives
    them, with the codes (store.snapshots.Snapshot.codes), which cag.kernels.native's AVX-512 attention reads."""
    if dtype.is_floating_point:
        return [(k.to(dtype), v.to(dtype)) for k, v in kv], None
    from cag.store import kv_int8

    _, codes = kv_int8.quantize_layers(kv)
    return kv_int8.dequantize_layers(codes), codes


# the largest magnitude each storage dtype holds: past it a value is stored as inf (fp16) or its
# block's fp16 scale is (int8: |x| / 127 per block)
FINITE_MAX = {torch.float16: 65504.0, torch.int8: 65504.0 * 127}


def nonfinite(kv: KV, dtype: torch.dtype | None = None) -> str | None:
    """Why `kv` cannot be stored in `dtype` (or served) finitely, or None: the first layer holding NaN or
    inf, or a value past what the storage dtype holds. One read of every value (a reduction per tensor)."""
    bound = FINITE_MAX.get(dtype)
    for i, pair in enumerate(kv):
        for name, t in zip(("keys", "values"), pair):
            if not t.is_floating_point():
                continue
            lo, hi = torch.aminmax(t) if t.numel() else (t.new_zeros(()), t.new_zeros(()))  # NaN propagates
            top = max(-float(lo), float(hi))
            if top != top or top == float("inf"):
                return f"layer {i} {name} hold NaN or inf"
            if bound is not None and top > bound:
                return f"layer {i} {name} reach {top:.4g}, past what {str(dtype).removeprefix('torch.')} stores ({bound:.6g})"
    return None


def export(cache: StaticCache, n: int) -> KV:
    """The first n positions of every layer on the CPU (to save): (1, H_kv, n, D)."""
    return [(k.cpu(), v.cpu()) for k, v in views(cache, n)]  # .cpu(): no copy on the CPU


def load_into(cache: StaticCache, kv: KV, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
    """Copy a snapshot's tensors (any storage dtype, any device) into a fresh cache of the model's
    dtype on the model's device."""
    for layer, (k, v) in zip(cache.layers, kv, strict=True):
        if not layer.is_initialized:
            layer.lazy_initialization(k[:, :, :0].to(device, dtype), v[:, :, :0].to(device, dtype))
        layer.keys[:, :, : k.shape[2]].copy_(k)  # casts fp16 -> model dtype in the copy
        layer.values[:, :, : v.shape[2]].copy_(v)
    set_length(cache, kv[0][0].shape[2] if kv else 0)


def kv_shape_ok(kv: KV, n_layers: int, n_kv_heads: int, head_dim: int, n_tokens: int) -> bool:
    return len(kv) == n_layers and all(
        t.shape == (1, n_kv_heads, n_tokens, head_dim) for pair in kv for t in pair
    )


@torch.inference_mode()
def answer_logprobs(model, cache: StaticCache, suffix: Sequence[int], answer: Sequence[int], start: int) -> list[float]:
    """Log-probabilities of `answer` after `suffix` at positions start.. over the cache's prefix
    (one forward over suffix + answer[:-1]; rewrites those request-buffer positions, never the prefix)."""
    if not answer:
        return []
    ids = list(suffix) + list(answer[:-1])
    device = next(model.parameters()).device
    file_pages.check(model)
    set_length(cache, start)
    pos = torch.arange(start, start + len(ids), device=device)  # (T,)
    logits = model(input_ids=torch.tensor([ids], device=device), past_key_values=cache, cache_position=pos,
                   position_ids=pos.unsqueeze(0), use_cache=True).logits[0, len(suffix) - 1 :]  # (len(answer), V)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp[torch.arange(len(answer)), torch.tensor(list(answer), device=device)].tolist()
