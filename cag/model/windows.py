"""Which layers attend to a sliding window of keys, and how many rows a snapshot keeps for each.

Gemma 2/3, Mistral v0.1, Qwen2 with `use_sliding_window` and most new small models interleave
sliding-window layers with full-attention ones. A window layer's query at position p sees keys
p-W+1..p (transformers' sliding_window_causal_mask_function), so a question after n knowledge tokens
reads only the knowledge's last W rows there: a snapshot keeps those (store.snapshots), and the rest of
the layer's rows are never read.
"""

from __future__ import annotations

Windows = tuple[int | None, ...]  # per layer: its window W, or None for full attention


def layer_windows(config) -> tuple[Windows, list[str]]:
    """Per layer, the sliding window of its attention (None: full attention), and the layer kinds cag
    cannot snapshot (chunked, linear, shared...). A window layer's query at position p sees keys p-W+1..p
    (transformers' sliding_window_causal_mask_function), so after the knowledge only its last W rows are
    ever read: a snapshot keeps those (store.snapshots)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    windows = tuple(int(kw["sliding_window"]) if t == "sliding_attention" else None for t, kw in zip(types, kwargs))
    return windows, sorted({t for t in types if t not in ("full_attention", "sliding_attention")})


def kept_rows(n_tokens: int, window: int | None) -> int:
    """Rows of n_tokens a snapshot keeps for a layer: the last W of a window layer, all of a full one."""
    return n_tokens if window is None else min(n_tokens, window)


def reusable(cut: int, n_old: int, windows: Windows) -> int:
    """`cut` where a refresh may reuse the first `cut` rows of a snapshot of n_old tokens, else 0. Prefilling
    row p >= cut reads a window layer's rows p-W+1..p, so each window layer must hold rows cut-W+1..cut-1,
    and the snapshot holds its last kept_rows(n_old, W) rows only: in practice a refresh reuses rows only
    where the knowledge fits in the window, and otherwise prefills the whole corpus again (a rebuild)."""
    for w in windows:
        if w is not None and max(0, cut - w + 1) < n_old - kept_rows(n_old, w):
            return 0
    return cut
