"""A GGUF file a user brings (`--model path/to/model.gguf`), read once into a plain model folder.

transformers dequantizes GGUF to float32 on every load, slowly, so the first load writes the
dequantized weights as a safetensors folder under CAG_HOME/models/gguf/<content digest>, which
later loads read (as cag.model.loading does for the embedded model). The folder is named by the
file's bytes: a renamed file reuses it, a changed one gets a new one. The digest of a file is
remembered by (path, size, mtime, ctime), so a multi-GB file is hashed once, not on every load.

Before transformers reads a tensor, every tensor's type and the architecture are checked here, so
a file cag cannot read is refused in one line naming what it does not read. So are files transformers
would read into something other than the file's model: a tensor the architecture needs that is missing
(transformers initializes it at random, without error), a hyperparameter no tensor has (a block count or
width past the tensors', which transformers would allocate), and metadata of absurd length (its reader
makes Python objects of every string and array entry): see `check_metadata_sizes` and `_check_tensors`.

Llama 3.1+'s rope scaling is one thing transformers' GGUF reader drops: llama.cpp's converter writes it
not as metadata but as a tensor, rope_freqs.weight, of the factor dividing each rotary frequency (see
`llama3_rope`). Its parameters are recovered from that tensor, checked by recomputing it with
transformers' own llama3 rope, and written into the folder's config; a tensor they do not reproduce is
refused in one line.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Literal, NamedTuple

import blake3
import numpy as np
import torch

from cag.errors import ModelError
from cag.store import stamps

log = logging.getLogger(__name__)

# The tensor types read (gguf.quants dequantizes each; tests/test_gguf.py answers through each one).
# Others, the i-quants among them, are refused by name.
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# general.architecture values whose transformers class cag serves: Llama's layer and its near kin.
# llama.cpp writes Mistral's models as llama (one whose general.name is exactly "mistral" transformers
# reads as Mistral, which gguf-py's tensor map lacks: refused in one line, by transformers' message).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")
DIGESTS = "digests.json"  # path -> {size, mtime_ns, ctime_ns, digest}: what was hashed already

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


def is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def materialize(path: Path, models_dir: Path) -> Path:
    """The model folder of GGUF file `path`, written once (atomically: complete or absent)."""
    path = path.expanduser().resolve()
    root = models_dir / "gguf"
    target = root / digest(path, root)[len("blake3:"):][:32]
    if _complete(target):
        return target
    header = check(path)
    log.info("reading %s into %s (once)", path.name, target)
    model, tok = _dequantized(path, header)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".materialize-", dir=root))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, target)  # a folder appears complete or not at all
        except OSError:
            if not _complete(target):  # another process wrote it meanwhile: theirs is the same bytes
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(folder: Path) -> bool:
    weights = ("model.safetensors", "model.safetensors.index.json")  # one file, or shards past 50 GB
    return (folder / "config.json").exists() and any((folder / w).exists() for w in weights)


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
        raise ModelError(f"cannot read GGUF file {path.name}: {_line(e)}") from None
    if arch not in ARCHITECTURES:
        raise ModelError(f"GGUF file {path.name}: architecture {arch!r} is not one cag reads ({', '.join(ARCHITECTURES)})")
    for t in reader.tensors:
        if t.tensor_type.name not in TYPES:
            raise ModelError(f"GGUF file {path.name}: tensor {t.name} is {t.tensor_type.name}, "
                             f"a type cag does not read (it reads {', '.join(TYPES)})")
    # Phi-3 128k / Phi-3.5 keep their long-context rope as these tensors, which transformers' reader
    # drops without a word: read on, such a model would rotate keys with the wrong frequencies
    long_rope = [t.name for t in reader.tensors if t.name.startswith(("rope_factors_long", "rope_factors_short"))]
    if long_rope:
        raise ModelError(f"GGUF file {path.name}: its long-context rope scaling ({', '.join(long_rope)}) is one cag does not "
                         "read yet; use the model's Hugging Face folder")
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
            if struct.unpack_from(order + "I", m, 4)[0] not in (2, 3):  # version 1's counts are 32-bit; GGUFReader refuses it
                return
            n_tensors, n_keys = struct.unpack_from(order + "QQ", m, 8)
            if n_tensors > MAX_ENTRIES or n_keys > MAX_ENTRIES:
                refuse(f"its header claims {n_tensors} tensors and {n_keys} metadata keys, over cag's cap of {MAX_ENTRIES}")
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
    e, ff, h = whole(f"{arch}.embedding_length"), whole(f"{arch}.feed_forward_length"), whole(f"{arch}.attention.head_count")
    kv = whole(f"{arch}.attention.head_count_kv", h)
    d = whole(f"{arch}.attention.key_length", max(1, e // h))  # the head width cag gives transformers (_dequantized)
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
    if arch == "qwen3":
        block |= {"attn_q_norm.weight": (d,), "attn_k_norm.weight": (d,)}

    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    held: dict[int, set[str]] = {}  # block -> its tensors' names
    for n in shapes:
        parts = n.split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit():
            held.setdefault(int(parts[1]), set()).add(parts[2])
    if past := [i for i in held if i >= blocks]:
        raise ModelError(f"GGUF file {name}: it holds tensors of block {min(past)}, past its {arch}.block_count {blocks}")
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


def llama3_rope(factors: np.ndarray, base: float, dim: int | None, context: int | None = None,
                original: int | None = None) -> dict | None | Literal[False]:
    """Llama 3's rope scaling (transformers' rope_parameters: rope_type "llama3", factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings) that makes llama.cpp's rope_freqs tensor
    `factors`, (dim / 2,): None where every factor is 1 (no scaling), False where none makes it.

    llama.cpp's converter writes, for rotary frequency i (wavelength w = 2 pi base^(2i / dim)), 1 where
    w < original / high_freq_factor, `factor` where w > original / low_freq_factor, and between them
    1 / ((1 - s) / factor + s) with s = (original / w - low_freq_factor) / (high_freq_factor - low_freq_factor),
    linear in 1 / w. So factor is the largest entry, and the blended entries fix the two boundary
    wavelengths (a line through their s against 1 / w); only those boundaries and factor shape the
    frequencies, so `original` (metadata rarely carries it) is taken as the low boundary, making
    low_freq_factor 1, as every Llama 3.1-3.3 has. The result is kept only if transformers' own llama3
    rope init, given it, divides each frequency by the tensor's factor."""
    r = np.asarray(factors, dtype=np.float64)
    if not dim or r.shape != (dim // 2,) or not np.isfinite(r).all():
        return False
    if np.allclose(r, 1.0, rtol=0, atol=1e-6):
        return None
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (dim / 2,) as transformers
    w = (2 * math.pi / inv.double()).numpy()  # wavelengths, rising with i
    factor = float(r.max())
    if factor <= 1:
        return False
    blended = (np.abs(r - 1) > 1e-6) & (np.abs(r - factor) > 1e-6 * factor)
    s = (1 / r - 1 / factor) / (1 - 1 / factor)  # the blend's s, 0 at `factor`, 1 at 1
    x = 1 / w
    if blended.sum() >= 2:
        slope, cut = np.polyfit(x[blended], s[blended], 1)  # s = slope x + cut
        if slope == 0:
            return False
        low_wave, high_wave = -slope / cut if cut else math.inf, slope / (1 - cut)
    else:
        # too few blended entries to fix both boundaries: take Llama 3's high_freq_factor / low_freq_factor = 4
        ones, tops = np.flatnonzero(np.abs(r - 1) <= 1e-6), np.flatnonzero(np.abs(r - factor) <= 1e-6 * factor)
        if blended.any():
            low_wave = (3 * s[blended][0] + 1) / x[blended][0]
        elif len(ones) and len(tops):
            low_wave = math.sqrt(4 * w[ones[-1]] * w[tops[0]])  # between the last 1 (times 4) and the first factor
        else:
            return False
        high_wave = low_wave / 4
    if not (0 < high_wave < low_wave < math.inf):
        return False
    orig = int(original) if original else max(1, round(low_wave))
    exact = {"factor": factor, "low_freq_factor": float(orig / low_wave), "high_freq_factor": float(orig / high_wave)}
    nice = {k: round(v, 3) for k, v in exact.items()}  # 8, 1, 4 rather than 8.0000001, 0.9999999, 4.0000003
    for guess in (nice, exact):
        rope = {"rope_type": "llama3", **guess, "original_max_position_embeddings": orig}
        if _reproduces(rope, r, base, dim, context):
            return rope
    return False


def _reproduces(rope: dict, factors: np.ndarray, base: float, dim: int, context: int | None) -> bool:
    """Whether transformers' llama3 rope init, given `rope`, divides each default frequency by `factors`."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=dim, num_attention_heads=1, head_dim=dim, rope_parameters=rope | {"rope_theta": base},
                         max_position_embeddings=max(int(context or 0), rope["original_max_position_embeddings"] + 1))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")  # (dim / 2,)
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    got = (inv.double() / scaled.double()).numpy()
    return bool(np.allclose(got, factors, rtol=1e-5, atol=0))


def _line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _dequantized(path: Path, header: Header):
    """The file's model as a plain float32 transformers model and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if header.head_dim and hasattr(config, "head_dim"):
            config.head_dim = header.head_dim  # transformers leaves Qwen3's at its config class's default
        if header.rope:  # the rope scaling its reader drops; rope_freqs.weight itself maps to no weight
            config.rope_parameters = dict(config.rope_parameters or {}) | header.rope
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                          dtype=torch.float32)
    except Exception as e:
        raise ModelError(f"cannot read GGUF file {path.name}: {_line(e)}") from None
    # Its weights are plain float32 tensors already; only the GGUF marks stop save_pretrained. Dropping
    # them, rather than copying into a fresh model, keeps one copy of the weights in memory, not two
    gguf_model.hf_quantizer = None  # type: ignore[assignment]  # torch types any attribute of a Module as a submodule
    if hasattr(gguf_model.config, "quantization_config"):
        del gguf_model.config.quantization_config
    return gguf_model, tok


def digest(path: Path, root: Path) -> str:
    """blake3 of the file's bytes, remembered in root/digests.json by (path, size, mtime, ctime)."""
    try:
        st = path.stat()
    except OSError:
        raise ModelError(f"model not found: {path} (no such file)") from None
    if not path.is_file():
        raise ModelError(f"model not found: {path} (not a file)")
    t0 = time.time_ns()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
    book = root / DIGESTS
    try:
        known = json.loads(book.read_text())
    except (OSError, ValueError):
        known = {}  # none yet, or unreadable: hash again
    entry = known.get(str(path))
    if isinstance(entry, dict) and {k: entry.get(k) for k in stamp} == stamp and "digest" in entry:
        return entry["digest"]
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(path)
    value = "blake3:" + h.hexdigest()
    if stamps.settled((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns), t0):  # a file changed
        # in the same clock tick as this read could keep its stamp: hashed, not remembered (store.stamps)
        known[str(path)] = stamp | {"digest": value}
        root.mkdir(parents=True, exist_ok=True)
        tmp = book.with_name(f".{book.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, book)
    return value
