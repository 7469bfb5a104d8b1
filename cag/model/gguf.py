"""A GGUF file a user brings (`--model path/to/model.gguf`), read once into a plain model folder.

transformers dequantizes GGUF to float32 on every load, slowly, so the first load writes the
dequantized weights as a safetensors folder under CAG_HOME/models/gguf/<content digest>, which
later loads read (as cag.model.loading does for the embedded model). The folder is named by the
file's bytes: a renamed file reuses it, a changed one gets a new one. The digest of a file is
remembered by (path, size, mtime, ctime), so a multi-GB file is hashed once, not on every load.

Before transformers reads a tensor, the file is checked (cag.model.gguf_checks: metadata of sane size,
every tensor's type, the architecture, the tensors the metadata describes), so a file cag cannot read
is refused in one line. What its metadata says that transformers' GGUF reader drops (Qwen3's head width,
Llama 3.1+'s rope scaling recovered from rope_freqs.weight: cag.model.gguf_rope) is written into the
folder's config.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import blake3
import torch

from cag.errors import ModelError
from cag.model.gguf_checks import Header, check, first_line
from cag.store import stamps

log = logging.getLogger(__name__)

DIGESTS = "digests.json"  # path -> {size, mtime_ns, ctime_ns, digest}: what was hashed already


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
        raise ModelError(f"cannot read GGUF file {path.name}: {first_line(e)}") from None
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
