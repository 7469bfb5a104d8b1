"""What loading a model found out that commands with no model need: its fingerprints, the dtype its
decode attends in (which sets the snapshots' storage dtype) and `cag info`'s description.

Every load records them in the index, keyed by the model's files (path, size and modification time
of each) and by everything else that shapes a load (the settings, this CPU's flags, CUDA's presence,
the torch, transformers and cag versions). `cag list`, `cag status` and `cag info` look them up by
that key and answer without loading the model or importing torch; a model whose files cannot be
stated without loading it (a hub id, the embedded model before its first load) has no key, and
those commands load it once. Torch-free on purpose: imported by the commands that must be instant.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from cag.config import DEFAULT_MODEL
from cag.hashing import hash_obj

# bumped when what is recorded, or how the key is formed, changes: older records are ignored
VERSION = 4


@dataclass(frozen=True)
class ModelFacts:
    fingerprint: str  # weights + config (cag.model.loading.weights_fingerprint)
    tokenizer_fingerprint: str
    attn_dtype: str  # what decode attends in, "bfloat16" or "float32" ...
    info: dict  # cag.runtime.describe.info: shape, kernels, decode path, snapshot bytes per token; the prefill method

    @property
    def prefill(self) -> str:
        """How knowledge is prefilled under these settings (cag.runtime.knowledge_kv.method), as `cag info` shows it:
        knowledge up to `rows_max` tokens where longer knowledge is prefilled another way (prefill_for)."""
        return self.info.get("prefill", "")

    @property
    def rows_max(self) -> int | None:
        """The most knowledge tokens prefilled as `prefill` says, where longer knowledge is prefilled otherwise."""
        return self.info.get("prefill_rows_max")

    def prefill_for(self, n: int) -> str:
        """How `n` knowledge tokens are prefilled under these settings (knowledge_kv.method, without loading)."""
        most = self.rows_max
        return self.info.get("prefill_beyond", "") if most is not None and n > most else self.prefill

    def kv_name(self, setting: str) -> str:
        """The snapshots' storage dtype under CAG_KV_DTYPE=`setting` (Engine.kv_name says why)."""
        return kv_name(setting, self.attn_dtype)


def kv_name(setting: str, attn_dtype: str) -> str:
    """CAG_KV_DTYPE, `auto` = bfloat16 where decode attends in bf16 (no conversion at load), else float16."""
    return setting if setting != "auto" else "bfloat16" if attn_dtype == "bfloat16" else "float16"


def _files(path: Path) -> list[tuple[str, int, int]] | None:
    """(name, size, mtime_ns) of a model file, or of each file at a model folder's top level."""
    try:
        if path.is_file():
            st = path.stat()
            return [(path.name, st.st_size, st.st_mtime_ns)]
        if path.is_dir():
            out = []
            for e in sorted(os.scandir(path), key=lambda e: e.name):
                if e.is_file() and not e.name.startswith("."):
                    st = e.stat()
                    out.append((e.name, st.st_size, st.st_mtime_ns))
            return out or None
    except OSError:
        return None
    return None


def model_files(name: str, models_dir: Path) -> tuple[str, list] | None:
    """Where model `name` lives and its files' stats, found as loading.resolve_model_path finds it but
    without reading or converting anything; None where that needs a load (a hub id, the embedded
    model or a GGUF file's folder before the first load made it: a GGUF is keyed by its own file)."""
    if name == DEFAULT_MODEL:
        path = models_dir / DEFAULT_MODEL
        if not (path / "config.json").exists():
            return None
    else:
        path = Path(os.path.expanduser(name))
        if not (path.is_dir() or (name.lower().endswith(".gguf") and path.is_file())):
            return None
    path = path.resolve()
    files = _files(path)
    return (str(path), files) if files else None


def _cpu() -> str:
    """This CPU's instruction sets (what `auto` kernels and formats follow), as one digest."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return hash_obj(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine() + "/" + platform.processor()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def key(settings) -> str | None:
    """The key of a load under `settings` on this machine, or None where the model's files cannot be
    stated without loading it."""
    files = model_files(settings.model, Path(settings.models_dir))
    if files is None:
        return None
    return hash_obj({
        "version": VERSION, "model": files, "dtype": settings.dtype, "weights": settings.weights,
        "device": settings.device, "kernels": settings.decode_kernels, "kv_dtype": settings.kv_dtype,
        "prefill_block": settings.prefill_block,
        "cpu": _cpu(), "cuda": [os.environ.get("CUDA_VISIBLE_DEVICES"), os.path.exists("/dev/nvidiactl")],
        "versions": [_version(p) for p in ("torch", "transformers", "cag")],
    })


def lookup(index, settings) -> ModelFacts | None:
    """The facts a load under these settings recorded, or None (never recorded, or the files changed)."""
    k = key(settings)
    row = index.model_facts(k) if k else None
    if row is None:
        return None
    try:
        return ModelFacts(**json.loads(row["facts"]))
    except (TypeError, ValueError):
        return None  # a record this version cannot read: the next load writes it again


def record(index, settings, facts: ModelFacts) -> None:
    """Keep the facts of a load; best effort (a read-only index only makes later commands load)."""
    k = key(settings)
    if k:
        try:
            index.record_model_facts(k, json.dumps(asdict(facts)))
        except Exception:  # noqa: BLE001 - never let the record of a load fail the load
            pass
