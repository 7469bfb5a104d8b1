"""Checks on a GGUF file a user brings, before transformers reads a tensor of it.

Every tensor's type and the architecture are checked here, so a file cag cannot read is refused in one
line naming what it does not read. So are files transformers would read into something other than the
file's model: a tensor the architecture needs that is missing (transformers initializes it at random,
without error), a hyperparameter no tensor has (a block count or width past the tensors', which
transformers would allocate), and metadata of absurd length (its reader makes Python objects of every
string and array entry): see `check_metadata_sizes` and `_check_tensors`. What the metadata says that
transformers' reader does not carry across (`Header`: Qwen3's head width, Llama 3's rope scaling, see
cag.model.gguf_rope) is returned for cag.model.gguf to write into the model folder's config.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import NamedTuple

from cag.errors import ModelError
from cag.model.gguf_rope import llama3_rope

# The tensor types read (gguf.quants dequantizes each; tests/test_gguf.py answers through each one).
# Others, the i-quants among them, are refused by name.
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# general.architecture values whose transformers class cag serves: Llama's layer and its near kin, and Gemma 2/3.
# llama.cpp writes Mistral's models as llama (one whose general.name is exactly "mistral" transformers
# reads as Mistral, which gguf-py's tensor map lacks: refused in one line, by transformers' message).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")

# Caps on metadata, checked from its length fields before anything reads it into Python objects (GGUFReader
# makes several per array entry, transformers' reader ~50 bytes per string byte). Real files stay far below:
# a chat template is tens of KB, a 256K-token tokenizer (Gemma's 262144) ~10 MB in all.
MAX_STRING = 1 << 20  # bytes per string (key or value)
MAX_ARRAY = 1 << 16  # entries per array, but the tokenizer's
VOCAB_ARRAYS = {f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "scores", "merges")}
MAX_VOCAB = 1 << 20  # entries in each of those: 4 times the largest vocabularies and merge lists
MAX_METADATA = 32 << 20  # bytes of the whole header up to the tensor infos
MAX_ENTRIES = 1 << 16  # metadata keys, and tensors (a 405B Llama has ~1,100)


class Header(NamedTuple):
    """What a file's metadata says that transformers' GGUF reader does not carry across."""

    arch: str
    head_dim: int | None  # {arch}.attention.key_length (Qwen3's head width, not hidden / heads)
    rope: dict | None = None  # Llama 3's rope scaling, recovered from rope_freqs.weight (llama3_rope)



def check(path: Path) -> Header:
    """What the file's metadata says, once its metadata is of sane size, every tensor's type and the
    architecture are ones cag reads and its tensors are the model its metadata describes; else a
    one-line ModelError."""
    from gguf import GGUFReader

    check_metadata_sizes(path)
    try:
        reader = GGUFReader(path)
        field = reader.fields.get("general.architecture")
        arch = field.contents() if field is not None else None
    except FileNotFoundError:
        raise ModelError(f"model not found: {path} (no such file)") from None
    except Exception as e:  # not GGUF, truncated, or a header that lies about its sizes
        raise ModelError(f"cannot read GGUF file {path.name}: {first_line(e)}") from None
    if arch not in ARCHITECTURES:
        raise ModelError(
            f"GGUF file {path.name}: architecture {arch!r} is not one cag reads ({', '.join(ARCHITECTURES)})"
        )
    for t in reader.tensors:
        if t.tensor_type.name not in TYPES:
            raise ModelError(f"GGUF file {path.name}: tensor {t.name} is {t.tensor_type.name}, "
                             f"a type cag does not read (it reads {', '.join(TYPES)})")
    # Phi-3 128k / Phi-3.5 keep their long-context rope as these tensors, which transformers' reader
    # drops without a word: read on, such a model would rotate keys with the wrong frequencies
    long_rope = [t.name for t in reader.tensors if t.name.startswith(("rope_factors_long", "rope_factors_short"))]
    if long_rope:
        raise ModelError(
            f"GGUF file {path.name}: its long-context rope scaling ({', '.join(long_rope)}) is one cag does not read "
            "yet; use the model's Hugging Face folder"
        )
    _check_tensors(reader, arch, path.name)
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    head_dim = int(key_length.contents()) if key_length is not None else None
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    rope: dict | None = None
    if freqs is not None:
        from gguf import quants

        def meta(key: str, default=None):
            f = reader.fields.get(f"{arch}.{key}")
            return f.contents() if f is not None else default

        heads = meta("attention.head_count")
        dim = meta("rope.dimension_count") or head_dim or (meta("embedding_length") // heads if heads else None)
        factors = quants.dequantize(freqs.data, freqs.tensor_type).reshape(-1)  # (rotary dim / 2,)
        scaling = llama3_rope(factors, base=float(meta("rope.freq_base", 10000.0)), dim=dim,
                              context=meta("context_length"), original=meta("rope.scaling.original_context_length"))
        if scaling is False:
            raise ModelError(f"GGUF file {path.name}: its rope scaling (tensor rope_freqs.weight) is not Llama 3's: "
                             "no factor, low/high_freq_factor and original context reproduce it; "
                             "use the model's Hugging Face folder instead")
        rope = scaling
    return Header(arch, head_dim, rope)


def check_metadata_sizes(path: Path) -> None:
    """Refuse, in one line, metadata past the caps above, walking the header by its length fields alone
    (no string value is read). A file this walk cannot follow (not GGUF, cut short, an unknown value
    type) is left to GGUFReader, whose message says why."""
    import mmap
    import struct

    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # scalar value types' bytes
    string, array = 8, 9

    def refuse(what: str):
        raise ModelError(f"GGUF file {path.name}: {what}; not read (a broken or hostile file?)")

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[:4] != b"GGUF":
                return
            order = "<" if struct.unpack_from("<I", m, 4)[0] & 0xFFFF else ">"  # big-endian: version 3 reads 3 << 24
            # version 1's counts are 32-bit; GGUFReader refuses it
            if struct.unpack_from(order + "I", m, 4)[0] not in (2, 3):
                return
            n_tensors, n_keys = struct.unpack_from(order + "QQ", m, 8)
            if n_tensors > MAX_ENTRIES or n_keys > MAX_ENTRIES:
                refuse(
                    f"its header claims {n_tensors} tensors and {n_keys} metadata keys, over cag's cap of {MAX_ENTRIES}"
                )
            at, key = 24, "key"

            def skip_string(at: int) -> int:
                n = struct.unpack_from(order + "Q", m, at)[0]
                if n > MAX_STRING:
                    refuse(f"metadata {key} is a string of {n} bytes, over cag's cap of {MAX_STRING >> 20} MiB")
                return at + 8 + n

            for _ in range(n_keys):
                key = "key"
                end = skip_string(at)
                key = bytes(m[at + 8:min(end, at + 8 + 200)]).decode(errors="replace")
                kind = struct.unpack_from(order + "I", m, end)[0]
                at = end + 4
                if kind == array:
                    kind, count = struct.unpack_from(order + "IQ", m, at)
                    at += 12
                    cap = MAX_VOCAB if key in VOCAB_ARRAYS else MAX_ARRAY
                    if count > cap:
                        refuse(f"metadata {key} is an array of {count} entries, over cag's cap of {cap}")
                    if kind == string:
                        for _ in range(count):
                            at = skip_string(at)
                    elif kind in sizes:
                        at += count * sizes[kind]
                    else:  # arrays of arrays: no model's metadata holds them, and GGUFReader would flatten them
                        return
                elif kind == string:
                    at = skip_string(at)
                elif kind in sizes:
                    at += sizes[kind]
                else:
                    return
                if at > MAX_METADATA:
                    refuse(f"its metadata runs past cag's cap of {MAX_METADATA >> 20} MiB (at {key})")
                if at > len(m):
                    return  # cut short
    except (OSError, ValueError, struct.error):  # no such file, empty (mmap), cut short: GGUFReader says which
        return


def _check_tensors(reader, arch: str, name: str) -> None:
    """Refuse, in one line, a file whose tensors are not the model its metadata describes: one the
    architecture needs missing (an unfinished conversion, a split file's first part), a block past
    block_count, or a shape other than the hyperparameters give, which transformers would allocate.
    The output matrix may be absent: transformers then ties it to token_embd.weight, as llama.cpp does."""
    fields = reader.fields

    def whole(key: str, default: int | None = None) -> int:
        f = fields.get(key)
        if f is None and default is not None:
            return default
        value = f.contents() if f is not None else None
        if f is None or not isinstance(value, int) or isinstance(value, bool) or value < 1:
            got = "missing" if f is None else f"{str(value)[:40]}"
            raise ModelError(f"GGUF file {name}: its metadata {key} is {got}, not a whole number from 1")
        return value

    blocks = whole(f"{arch}.block_count")
    e, ff, h = (
        whole(f"{arch}.embedding_length"),
        whole(f"{arch}.feed_forward_length"),
        whole(f"{arch}.attention.head_count"),
    )
    kv = whole(f"{arch}.attention.head_count_kv", h)
    # the head width cag gives transformers (gguf._dequantized)
    d = whole(f"{arch}.attention.key_length", max(1, e // h))
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab = whole(f"{arch}.vocab_size", len(tokens.data) if tokens is not None else None)  # transformers' order
    # Shapes in ggml's order (the input width first), as the file lists them and llama.cpp checks them
    top: dict[str, tuple[int, ...]] = {"token_embd.weight": (e, vocab), "output_norm.weight": (e,)}
    block: dict[str, tuple[int, ...]] = {"attn_norm.weight": (e,)}
    if arch == "phi3":  # q, k, v in one matrix, gate and up in another
        block |= {"attn_qkv.weight": (e, (h + 2 * kv) * d), "attn_output.weight": (h * d, e), "ffn_norm.weight": (e,),
                  "ffn_up.weight": (e, 2 * ff), "ffn_down.weight": (ff, e)}
    else:
        block |= {"attn_q.weight": (e, h * d), "attn_k.weight": (e, kv * d), "attn_v.weight": (e, kv * d),
                  "attn_output.weight": (h * d, e), "ffn_norm.weight": (e,), "ffn_gate.weight": (e, ff),
                  "ffn_up.weight": (e, ff), "ffn_down.weight": (ff, e)}
    if arch == "qwen2":
        block |= {"attn_q.bias": (h * d,), "attn_k.bias": (kv * d,), "attn_v.bias": (kv * d,)}
    if arch in ("qwen3", "gemma3"):
        block |= {"attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,)}
    if arch in ("gemma2", "gemma3"):  # norms on the attention's and the MLP's outputs too
        block |= {"post_attention_norm.weight": (e,), "post_ffw_norm.weight": (e,)}

    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    held: dict[int, set[str]] = {}  # block -> its tensors' names
    for n in shapes:
        parts = n.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit():
            held.setdefault(int(parts[1]), set()).add(parts[2])
    if past := [i for i in held if i >= blocks]:
        raise ModelError(
            f"GGUF file {name}: it holds tensors of block {min(past)}, past its {arch}.block_count {blocks}"
        )
    # Counted, not listed: a block_count of 100000 over one tensor must not build 900000 names
    missing = (sum(n not in shapes for n in top) + (blocks - len(held)) * len(block)
               + sum(len(block.keys() - names) for names in held.values()))
    if missing:
        def each():
            yield from (n for n in top if n not in shapes)
            for i in range(blocks):
                yield from (f"blk.{i}.{n}" for n in block if f"blk.{i}.{n}" not in shapes)

        first = list(itertools.islice(each(), 5))
        more = f" and {missing - len(first)} more" if missing > len(first) else ""
        split = fields.get("split.count")
        hint = (f"; it is one part of a file split in {split.contents()}: merge them (llama-gguf-split --merge)"
                if split is not None and split.contents() != 1 else "")
        raise ModelError(f"GGUF file {name}: lacks {missing} of the tensors its architecture ({arch}) needs for its "
                         f"{blocks} blocks ({arch}.block_count): {', '.join(first)}{more}{hint}")
    want = top | {"output.weight": (e, vocab)} | {f"blk.{i}.{n}": s for i in range(blocks) for n, s in block.items()}
    for n, s in want.items():
        if n in shapes and shapes[n] != list(s):
            raise ModelError(f"GGUF file {name}: tensor {n} is {shapes[n]} where its metadata says {list(s)} "
                             f"({arch}: embedding_length {e}, feed_forward_length {ff}, head_count {h}, "
                             f"head_count_kv {kv}, head width {d}, vocabulary {vocab})")


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
