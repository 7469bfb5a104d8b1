"""A GGUF file a user brings (`--model path/to/model.gguf`), read once into a plain model folder.

transformers dequantizes GGUF to float32 on every load, slowly, so the first load writes the
dequantized weights as a safetensors folder under CAG_HOME/models/gguf/<content digest>, which
later loads read (as cag.model.loading does for the embedded model). The folder is named by the
file's bytes: a renamed file reuses it, a changed one gets a new one. The digest of a file is
remembered by (path, size, mtime, ctime), so a multi-GB file is hashed once, not on every load.

Before transformers reads a tensor, every tensor's type and the architecture are checked here, so
a file cag cannot read is refused in one line naming what it does not read.

Llama 3.1+'s rope scaling is one thing transformers' GGUF reader drops: llama.cpp's converter writes it
not as metadata but as a tensor, rope_freqs.weight, of the factor dividing each rotary frequency (see
`llama3_rope`). Its parameters are recovered from that tensor, checked by recomputing it with
transformers' own llama3 rope, and written into the folder's config; a tensor they do not reproduce is
refused in one line.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

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
    """What the file's metadata says, once every tensor's type and the architecture are ones cag reads;
    else a one-line ModelError."""
    from gguf import GGUFReader

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
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    head_dim = int(key_length.contents()) if key_length is not None else None
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    rope = None
    if freqs is not None:
        from gguf import quants

        def meta(key: str, default=None):
            f = reader.fields.get(f"{arch}.{key}")
            return f.contents() if f is not None else default

        heads = meta("attention.head_count")
        dim = meta("rope.dimension_count") or head_dim or (meta("embedding_length") // heads if heads else None)
        factors = quants.dequantize(freqs.data, freqs.tensor_type).reshape(-1)  # (rotary dim / 2,)
        rope = llama3_rope(factors, base=float(meta("rope.freq_base", 10000.0)), dim=dim,
                           context=meta("context_length"), original=meta("rope.scaling.original_context_length"))
        if rope is False:
            raise ModelError(f"GGUF file {path.name}: its rope scaling (tensor rope_freqs.weight) is not Llama 3's: "
                             "no factor, low/high_freq_factor and original context reproduce it; "
                             "use the model's Hugging Face folder instead")
    return Header(arch, head_dim, rope)


def llama3_rope(factors: np.ndarray, base: float, dim: int | None, context: int | None = None,
                original: int | None = None) -> dict | None | bool:
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
    gguf_model.hf_quantizer = None
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
