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

import contextlib
from collections.abc import Callable, Sequence
from typing import cast

import torch
from transformers import StaticCache, StaticLayer

from cag.errors import ModelError
from cag.model import file_pages
from cag.model.windows import layer_windows


class Cancelled(Exception):
    """The caller asked to stop (client gone, timeout)."""


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values, each (1, H_kv, T, D)


def new_cache(model, max_len: int) -> StaticCache:
    """A request buffer of max_len positions in every layer. Window layers get a whole buffer too (not
    transformers' ring of W slots): position p lives at slot p in every layer, and the sliding mask
    transformers builds for them (from the buffer's length, causal and p - W < key) hides what they must
    not see. The same layout serves ingest, `full` and `cag`, so their attention is the same arithmetic."""
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    if any(w is not None for w in layer_windows(model.config)[0]):
        cache.layers = [StaticLayer(max_cache_len=max_len) for _ in cache.layers]
    return cache


def _layers(cache: StaticCache) -> list[StaticLayer]:
    """The cache's layers: a StaticCache makes StaticLayers (transformers types them as any kind of layer)."""
    return cast("list[StaticLayer]", cache.layers)


def _buffers(layer: StaticLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values (1, H_kv, max_len, D), allocated by its first write (lazy_initialization)."""
    assert layer.keys is not None and layer.values is not None, "the cache's layers are not allocated yet"
    return layer.keys, layer.values


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
    if logits is None:
        raise ValueError("nothing to prefill: no ids")
    return logits


# Rows of one knowledge-prefill forward, per device type. A forward's products and attention may sum
# a row differently with the number of rows beside it (BLAS kernels and flash attention pick their
# blocking and tails from the shape: measured on AMD Zen 3 and Zen 4, bench/JOURNAL.md 2026-12-06).
# So the knowledge is prefilled in blocks of exactly BLOCK rows at positions that are multiples of
# BLOCK (the last block padded): every forward has the same shape, row p sits at slot p % BLOCK of
# its block, and its keys and values depend on its token, its position and the K/V before it alone,
# however the prefill was split (ingest, refresh, `full`). The block is part of a snapshot's key.
BLOCK = {"cpu": 256, "cuda": 2048}  # CUDA: one launch of every kernel per block, larger blocks fill the chip
PAD_ID = 0  # the token of a last block's padding rows (their K/V land past the prefix and are never read)


def block_for(device: torch.device | str) -> int:
    """The knowledge-prefill block (rows a forward) on this device type."""
    return BLOCK.get(torch.device(device).type, BLOCK["cpu"])


def padded(n: int, block: int) -> int:
    """n rounded up to whole blocks: the cache room a knowledge prefill of n tokens writes."""
    return -(-n // block) * block


def stored_round(dtype: torch.dtype | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What storing a key or value in a snapshot of `dtype` and reading it back does to it, as a function
    of the tensor (the same dtype back), or None where storing keeps every bit (float32, or None).
    int8 is the per-token q8_0 of cag.store.kv_int8, read back in float32 as a refresh reads it."""
    if dtype is None or dtype == torch.float32:
        return None
    if dtype.is_floating_point:
        return lambda t: t if t.dtype == dtype else t.to(dtype).to(t.dtype)
    from cag.store import kv_int8

    def q8(t: torch.Tensor) -> torch.Tensor:
        block = kv_int8.block_for(t.shape[-1])
        return kv_int8.dequantize(*kv_int8.quantize(t, block), torch.float32).to(t.dtype)

    return q8


@contextlib.contextmanager
def _writes_rounded(cache: StaticCache, store: torch.dtype | None):
    """Within it, every key and value the model writes into `cache` is first rounded as a snapshot stored in
    `store` holds it (stored_round): later rows attend to what a snapshot stores, so rows prefilled after a
    refresh's reused ones (read back from the old snapshot) see the very values a rebuild's rows see. A
    value past what `store` holds (float16: 65504) is refused with ModelError before anything is stored."""
    fn = stored_round(store)
    if fn is None:
        yield
        return
    bound = FINITE_MAX.get(store)

    def stored(t: torch.Tensor, i: int, name: str) -> torch.Tensor:
        if bound is not None and (top := float(t.abs().amax())) > bound:  # would be stored as inf: refused here
            raise ModelError(
                f"the model's keys and values cannot be stored: layer {i} {name} reach {top:.4g}, past what "
                f"{str(store).removeprefix('torch.')} stores ({bound:.6g}); prefill in float32 (CAG_DTYPE=float32) or "
                "store them in bfloat16 (CAG_KV_DTYPE=bfloat16)"
            )
        return fn(t)

    for i, layer in enumerate(_layers(cache)):
        layer.update = lambda k, v, *a, _update=layer.update, _i=i, **kw: _update(  # type: ignore[method-assign]  # undone below
            stored(k, _i, "keys"), stored(v, _i, "values"), *a, **kw)
    try:
        yield
    finally:
        for layer in _layers(cache):
            del layer.update  # the class's method again


@torch.inference_mode()
def prefill_knowledge(
    model,
    cache: StaticCache,
    ids: Sequence[int],
    start: int,
    block: int,
    store: torch.dtype | None = None,
    on_progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> None:
    """Prefill the knowledge `ids` at positions start.. (a multiple of `block`) in forwards of exactly `block`
    rows, the last one padded (BLOCK says why); the keys and values written are rounded as a snapshot
    stored in `store` holds them (stored_round). The cache needs room for start + padded(len(ids), block)."""
    if start % block:
        raise ValueError(f"a knowledge prefill starts at a multiple of {block}, not at {start}")
    end = start + padded(len(ids), block)
    if end > max_len(cache):
        raise ValueError(f"prefill past the cache: {start}+{padded(len(ids), block)} > {max_len(cache)}")
    file_pages.check(model)  # its own weights may be views of their file: refuse them changed
    set_length(cache, start)
    device = next(model.parameters()).device
    with _writes_rounded(cache, store):
        for s in range(0, len(ids), block):
            if should_stop and should_stop():
                raise Cancelled("stopped during prefill")
            real = list(ids[s : s + block])
            piece = torch.tensor([real + [PAD_ID] * (block - len(real))], dtype=torch.long, device=device)  # (1, block)
            pos = torch.arange(start + s, start + s + block, device=device)  # (block,)
            model(input_ids=piece, past_key_values=cache, cache_position=pos, position_ids=pos.unsqueeze(0),
                  use_cache=True, logits_to_keep=1)  # the logits are not used: one row's head, not block's
            if on_progress:
                on_progress(len(real))
    set_length(cache, start + len(ids))  # the padding's K/V lie past the prefix: the next write overwrites them


def max_len(cache: StaticCache) -> int:
    return _layers(cache)[0].max_cache_len


def set_length(cache: StaticCache, n: int) -> None:
    """trim_to: the next write lands at position n. Slots >= n hold stale values that the
    causal mask built from cache_position never lets a query see."""
    for layer in _layers(cache):
        layer.cumulative_length.fill_(n)


def views(cache: StaticCache, n: int) -> KV:
    """Views of the first n positions of every layer, where they are: (1, H_kv, n, D)."""
    return [(k[:, :, :n], v[:, :, :n]) for k, v in map(_buffers, _layers(cache))]


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
FINITE_MAX: dict[torch.dtype | None, float] = {torch.float16: 65504.0, torch.int8: 65504.0 * 127}


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
                return (
                    f"layer {i} {name} reach {top:.4g}, past what {str(dtype).removeprefix('torch.')} stores "
                    f"({bound:.6g})"
                )
    return None


def export(cache: StaticCache, n: int) -> KV:
    """The first n positions of every layer on the CPU (to save): (1, H_kv, n, D)."""
    return [(k.cpu(), v.cpu()) for k, v in views(cache, n)]  # .cpu(): no copy on the CPU


def load_into(cache: StaticCache, kv: KV, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
    """Copy a snapshot's tensors (any storage dtype, any device) into a fresh cache of the model's
    dtype on the model's device."""
    for layer, (k, v) in zip(_layers(cache), kv, strict=True):
        if not layer.is_initialized:
            layer.lazy_initialization(k[:, :, :0].to(device, dtype), v[:, :, :0].to(device, dtype))
        keys, values = _buffers(layer)
        keys[:, :, : k.shape[2]].copy_(k)  # casts fp16 -> model dtype in the copy
        values[:, :, : v.shape[2]].copy_(v)
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
