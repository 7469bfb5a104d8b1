"""A GGUF file a user brings (`--model path/to/model.gguf`), read once into a plain model folder.

transformers dequantizes GGUF to float32 on every load, slowly, so the first load writes the
dequantized weights as a safetensors folder under CAG_HOME/models/gguf/<content digest>, which
later loads read (as cag.model.loading does for the embedded model). The folder is named by the
file's bytes: a renamed file reuses it, a changed one gets a new one. The digest of a file is
remembered by (path, size, mtime, ctime), so a multi-GB file is hashed once, not on every load.

Before transformers reads a tensor, every tensor's type and the architecture are checked here, so
a file cag cannot read is refused in one line naming what it does not read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import blake3
import torch

from cag.errors import ModelError

log = logging.getLogger(__name__)

# The tensor types read (gguf.quants dequantizes each; tests/test_gguf.py answers through each one).
# Others, the i-quants among them, are refused by name.
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# general.architecture values whose transformers class cag serves: Llama's layer and its near kin.
# llama.cpp writes Mistral's models as llama (one whose general.name is exactly "mistral" transformers
# reads as Mistral, which gguf-py's tensor map lacks: refused in one line, by transformers' message).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")
DIGESTS = "digests.json"  # path -> {size, mtime_ns, ctime_ns, digest}: what was hashed already
SETTLE_S = 0.1  # a file changed this recently is hashed but not remembered: a write in the same
# clock tick could keep its (size, mtime) (git's "racily clean" entries, same cure)


class Header(NamedTuple):
    """What a file's metadata says that transformers' GGUF reader does not carry across."""

    arch: str
    head_dim: int | None  # {arch}.attention.key_length (Qwen3's head width, not hidden / heads)


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
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # Llama 3.1+'s rope scaling, which llama.cpp's converter stores as per-dimension factors (a
        # tensor of head_dim / 2) and transformers' GGUF reader leaves out: answers would drift
        raise ModelError(f"GGUF file {path.name}: its rope scaling (tensor rope_freqs.weight) is not read by "
                         "transformers' GGUF loader; use the model's Hugging Face folder instead")
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    return Header(arch, int(key_length.contents()) if key_length is not None else None)


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
    if time.time() - st.st_ctime > SETTLE_S:  # ctime: the last change of any kind
        known[str(path)] = stamp | {"digest": value}
        root.mkdir(parents=True, exist_ok=True)
        tmp = book.with_name(f".{book.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, book)
    return value
