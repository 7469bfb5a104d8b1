"""Grouped-query attention without repeating K/V.

transformers' sdpa path expands K and V from H_kv to H heads (`repeat_kv`) whenever a mask is
given and more than one query token is processed: a copy of the whole cache per layer per
forward, (1, H, T, D) x 2 x layers — at 4K tokens on SmolLM2 about 0.6 GB of memory traffic for a
14-token question. Here the query heads that share a K/V head are folded into the query length
instead: (B, H, q, D) -> (B, H_kv, rep*q, D), the mask repeated along q. Same math, no K/V copy.

A StaticCache also hands every layer its whole preallocated buffer (max_len positions), most of
it empty during prefill: keys past the last query's position are masked for every row (causal),
so they are sliced off before attention. Prefill then costs O(n^2/2), not O(n x max_len), and the
arithmetic no longer depends on how much room the buffer has after the prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "cag_sdpa"


def packed_gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    b, h, q, d = query.shape  # query (B, H, q, D); key/value (B, H_kv, k, D)
    h_kv, k = key.shape[1], key.shape[2]
    rep = h // h_kv
    if attention_mask is None and q > 1:  # transformers' convention: causal, aligned at key 0
        attention_mask = torch.ones(q, k, dtype=torch.bool, device=query.device).tril()[None, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool and b == 1:
        last_row = attention_mask[0, 0, -1]  # (k,): the latest query sees every valid key
        valid = int(last_row.nonzero()[-1]) + 1 if bool(last_row.any()) else k
        if valid < k:
            key, value, attention_mask = key[:, :, :valid], value[:, :, :valid], attention_mask[..., :valid]
    if rep > 1:
        query = query.reshape(b, h_kv, rep * q, d)  # head kv*rep + r, token i -> row r*q + i
        if attention_mask is not None and attention_mask.shape[2] > 1:
            attention_mask = attention_mask.repeat(1, 1, rep, 1)  # (B, 1, rep*q, k)
    if (cap := kwargs.get("softcap")) is not None:  # Gemma 2: scores capped by cap * tanh(s / cap) before the mask
        out = _capped(query, key, value, attention_mask, scaling if scaling is not None else d ** -0.5, cap)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous(), None  # (B, q, H, D)


def install(model) -> None:
    """Use packed GQA attention for a model whose sdpa attention would repeat K/V."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    text = model.config.get_text_config(decoder=True)
    n_kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if n_kv == text.num_attention_heads or model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(NAME, packed_gqa_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)


def _capped(query, key, value, mask, scale: float, cap: float) -> torch.Tensor:
    """Attention with soft-capped scores, as transformers' eager attention computes it (sdpa has no cap):
    query (B, H_kv, q', D) over key/value (B, H_kv, k, D); mask bool (True: seen) or additive, or None."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scale  # (B, H_kv, q', k)
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)  # (B, H_kv, q', D)
