"""Where a comparison's QA dataset is, and which format it is in.

The words ``squad`` and ``hotpot`` name the shared copies under ``$CAG_DATASETS`` (default
``../shared/datasets`` next to the repository; see ``shared/datasets/*/SOURCE.md`` for origin and
counts); anything else is a file path, its format given or guessed (:func:`resolve_dataset`).
compare.datasets reads each format.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

FORMATS = ("squad", "hotpotqa", "jsonl")

SQUAD_DEV_FILE = Path("squad_v1.1_dev") / "dev-v1.1.json.gz"
HOTPOT_DEV_FILE = Path("hotpotqa_dev_distractor") / "hotpot_dev_distractor_v1.first53.json"


def datasets_root() -> Path:
    """The shared datasets folder: ``$CAG_DATASETS`` if set, else ``<repo>/../shared/datasets``."""
    override = os.environ.get("CAG_DATASETS")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


def default_source(fmt: str) -> Path:
    """Path of the shared file for a built-in format."""
    if fmt == "squad":
        return datasets_root() / SQUAD_DEV_FILE
    if fmt == "hotpotqa":
        return datasets_root() / HOTPOT_DEV_FILE
    raise ValueError(f"format {fmt!r} has no default source file; pass source_path")


SHARED_NAMES = {"squad": "squad", "hotpot": "hotpotqa", "hotpotqa": "hotpotqa"}


def resolve_dataset(dataset: str, fmt: str | None, docs: Path | None = None) -> tuple[str, Path | None, dict]:
    """What the user named -> (loader format, path or None for the shared copy, loader options).

    The words ``squad`` and ``hotpot`` (``hotpotqa``) name the shared copies under
    :func:`datasets_root` unless a file of that name exists; anything else is a path whose
    format is ``fmt`` or guessed from its name and first bytes. Raises BadInput.
    """
    from cag.errors import BadInput

    fmt = {"hotpot": "hotpotqa"}.get(fmt, fmt) if fmt else None
    if fmt is not None and fmt not in FORMATS:
        raise BadInput(f"unknown format {fmt!r}; use squad, hotpot or jsonl")
    name = SHARED_NAMES.get(dataset.lower())
    if name and not Path(dataset).exists():
        if fmt and fmt != name:
            raise BadInput(f"dataset {dataset!r} is the shared {name} copy; it cannot be read as {fmt}")
        path = default_source(name)
        if not path.is_file():
            raise BadInput(f"the shared {name} dataset is not at {path} (set CAG_DATASETS to its folder)")
        return name, None, {}
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise BadInput(f"no such dataset file: {dataset} (or use the words squad / hotpot)")
    if fmt is None:
        fmt = guess_format(path)
    opts = {"docs_dir": docs} if fmt == "jsonl" and docs is not None else {}
    return fmt, path, opts


def guess_format(path: Path) -> str:
    """squad (a JSON object with "data"), hotpotqa (a JSON list) or jsonl (by name); BadInput otherwise."""
    from cag.errors import BadInput

    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            head = f.read(1 << 16).lstrip()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read {path}: {e}") from None
    if head.startswith("{") and '"data"' in head:
        return "squad"
    if head.startswith("["):
        return "hotpotqa"
    raise BadInput(f"cannot tell the format of {path}; pass --format squad|hotpot|jsonl")

