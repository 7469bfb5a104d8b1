"""The knowledge's keys and values (a snapshot's, `full`'s and RAG's prompt's): prefilled as decode rows where the
step makes every row one, else in fixed blocks through the transformers forward.

As decode rows, every knowledge token goes through the lean step as a question's tokens do
(cag.runtime.rows.flat), in the decoder's slot of one request over an empty prefix.

Why: where the step makes every row a decode row (cag's kernels over packed products: LeanStep.flat) a row's
K/V are a function of its token, its position and the K/V before it, whatever rows shared its pass. So the
snapshot's rows are the very rows a question, an answer or a `full` prompt of the same tokens gets; a refresh
that keeps rows 0..c-1 and prefills the rest equals a rebuild at any cut, not only at a block boundary (the
block is 1: part of the key); and the prefill multiplies through the packed weights (int4: about a sixth of
float32's bytes read per pass, with cag's native products and attention) instead of the model's float32
copy through transformers' forward. It runs in the decoder's thread, in pieces between other requests'
decode steps (Decoder._pieces), like any long question.

Where the step does not apply (torch's kernels, CUDA, window layers), the snapshot is stored in a dtype other
than the one decode attends in (its rows must be what a load gives back), or the knowledge is longer than a slot
holds (MAX_SUFFIX: a model of a longer context), kv_cache.prefill_knowledge prefills in fixed blocks through the
transformers forward instead (kv_cache.BLOCK says why fixed; CAG_PREFILL_BLOCK sets their size). The method is
a function of the knowledge's length, so a snapshot's key and `full`'s prefill agree on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cag.runtime import kv_cache
from cag.runtime import step as lean
from cag.runtime.generate import DecodeConfig
from cag.runtime.requests import Request
from cag.runtime.slots import MAX_SUFFIX, PrefixKV

KV = list[tuple[torch.Tensor, torch.Tensor]]


def rows_max(lm, store: torch.dtype) -> int:
    """The most knowledge tokens stored in `store` that are prefilled as decode rows for loaded model `lm` (0: none):
    where its step is flat and the store is the dtype decode attends in, as many as a decoder's slot holds (the
    model's context, at most MAX_SUFFIX); longer knowledge (a model of a longer context) is prefilled in blocks."""
    step = lean.for_model(lm.model)
    return min(lm.max_context, MAX_SUFFIX) if step is not None and step.flat and store == lm.attn_dtype else 0


def as_rows(lm, store: torch.dtype, n: int) -> bool:
    """Whether `n` knowledge tokens stored in `store` are prefilled as decode rows for loaded model `lm`."""
    return 0 < n <= rows_max(lm, store)


def method(lm, setting: int, store: torch.dtype, n: int) -> str:
    """How `n` knowledge tokens stored in `store` are prefilled here (part of a snapshot's key, recorded with it):
    "rows ARITHMETIC/KERNELS" (each row decoded: its bits follow the weights format, the activations its products
    multiply (Backend.arithmetic: "int4-q8" on the AVX-512 kernels) and the kernels) or "blocks N"
    (CAG_PREFILL_BLOCK `setting`, 0: the device's, kv_cache.BLOCK)."""
    if as_rows(lm, store, n):
        return f"rows {lm.backend.arithmetic(lm.weights)}/{lm.backend.name}"
    return _blocks(lm, setting)


def described(lm, setting: int, store: torch.dtype) -> dict:
    """The methods of knowledge of every length the context holds, for the model facts and `cag info`: "prefill"
    (that of knowledge up to "prefill_rows_max" tokens, where longer knowledge has another: "prefill_beyond")."""
    most = rows_max(lm, store)
    out: dict[str, str | int] = {"prefill": method(lm, setting, store, most)}  # most = 0: no rows, blocks
    if 0 < most < lm.max_context:
        out |= {"prefill_rows_max": most, "prefill_beyond": _blocks(lm, setting)}
    return out


def _blocks(lm, setting: int) -> str:
    """The method of fixed blocks of CAG_PREFILL_BLOCK `setting` rows (0: the device's, kv_cache.BLOCK)."""
    return f"blocks {setting or kv_cache.block_for(lm.device)}"


def matching(lm, setting: int, store: torch.dtype, n: int, held: dict | None) -> str:
    """How `full` prefills the `n` knowledge tokens of snapshot row `held` (None: none): as that snapshot was, where
    that can be computed here (blocks of any size; this decoder's rows), so `cag` == `full` holds while a snapshot
    prefilled another way is served (stale); else as here (another format's or kernels' rows: its stale reason
    says so)."""
    how = method(lm, setting, store, n)
    was = (held.get("prefill") or _blocks(lm, setting)) if held else how  # a row from before methods: blocks
    return was if was.startswith("blocks") or was == how else how


def block(how: str) -> int:
    """Rows of each prefill pass of a method: 1 as decode rows (a row is its own), else its block."""
    return 1 if how.startswith("rows") else int(how.split()[1])


def of_meta(meta: dict) -> str:
    """The method a snapshot's header records (one written before methods were recorded: its block's)."""
    return meta.get("prefill") or f"blocks {meta.get('prefill_block')}"


def compute(decoder, how: str, store: torch.dtype, ids: Sequence[int], seed: KV | None = None,
            tick: Callable[[int], None] | None = None, should_stop: Callable[[], bool] | None = None) -> KV:
    """Per layer K/V (1, H_kv, n, D) of the knowledge `ids` at positions 0..n-1 prefilled as `how` says (`method`:
    as decode rows only where they are this decoder's), as a snapshot in `store` holds them, after `seed`'s first
    rows (1, H_kv, c, D) kept as they are (a refresh's reused knowledge; c a multiple of the block). `tick(rows)`
    as rows are done; `should_stop` between pieces."""
    if how.startswith("rows"):
        if how != (here := method(decoder.lm, 0, store, len(ids))):
            raise ValueError(f"knowledge prefilled as {how!r} cannot be computed here ({here!r})")
        return prefill(decoder, ids, seed, tick, should_stop)
    lm, size, c = decoder.lm, block(how), seed[0][0].shape[2] if seed else 0
    cache = kv_cache.new_cache(lm.model, kv_cache.padded(len(ids), size))
    if seed:
        kv_cache.load_into(cache, seed, lm.dtype, lm.device)
    kv_cache.prefill_knowledge(lm.model, cache, ids[c:], c, size, store, tick, should_stop)
    return kv_cache.views(cache, len(ids))


def prefill(decoder, ids: Sequence[int], seed: KV | None = None, tick: Callable[[int], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> KV:
    """Per layer keys, values (1, H_kv, n, D) in the attention dtype on the CPU of `ids` at positions 0..n-1;
    `seed`: the K/V of the first rows (1, H_kv, c, D), kept as they are (a refresh's reused knowledge), the
    rest prefilled after them. `tick(rows)` after each piece; `should_stop` between pieces."""
    lm = decoder.lm
    empty = torch.zeros(1, lm.n_kv_heads, 0, lm.head_dim, dtype=lm.attn_dtype, device=lm.device)
    out: KV = []

    def export(kv: KV) -> None:  # views of the slot (H_kv, n, D), about to be zeroed: copied
        out.extend((k.unsqueeze(0).clone(), v.unsqueeze(0).clone()) for k, v in kv)

    req = Request(PrefixKV([(empty, empty)] * lm.n_layers, 0), list(ids), DecodeConfig(max_tokens=1),
                  should_stop=should_stop, seed=[(k[0], v[0]) for k, v in seed] if seed else None, export=export,
                  on_piece=tick)
    decoder.run(req)
    return out
