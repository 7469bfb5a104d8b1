"""The files of a compare run: the results log (one `Row` per line of results.jsonl), run.json, sets.json.

run.json holds the settings, machine and times of the run; sets.json one record per knowledge
set (`ingested_sets.SetInfo`): its size, seed, documents, real prefix, questions, and the snapshot(s)
its corpus was ingested into.

results.jsonl is append-only and flushed row by row, so a run killed at any moment keeps every
finished row; a line cut by the kill is ignored on reading (that row is simply asked again),
and the next append starts on a fresh line so it cannot be glued to the cut one. The runner
appends, and the runner (--resume), the report and the CLI read through `read_rows`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TextIO

from cag.errors import BadInput

from .metrics import f1_first_sentence

RESULTS = "results.jsonl"
RUN = "run.json"
SETS = "sets.json"

_REQUIRED = ("set", "size", "qid", "mode")
_RAG_ONLY = ("retrieved", "retrieval_hit", "retrieval_recall")
_SHARDED_ONLY = ("shards", "routing_ms", "routed", "routing_recall", "routing_recall2")
# `cag@N`: the set ingested into shards of at most N tokens (the shard-size sweep); plain `cag` is
# what fits, i.e. one snapshot when the set fits the context, shards that fit it when it does not.
VARIANT = "@"


@dataclass
class Row:
    """One question asked in one mode (and k) on one knowledge set."""

    set: str
    size: int  # the nominal knowledge size the set was pooled for
    qid: str
    mode: str  # cag | cag@N (shard-size sweep) | full | rag-bm25 | rag-dense
    prefix_tokens: int = 0  # the set's real knowledge prefix
    q_index: int = 0  # the question's place among its size's questions (asking order)
    question: str = ""
    golds: list[str] = field(default_factory=list)
    gold_docs: list[str] = field(default_factory=list)
    retriever: str | None = None
    k: int | None = None
    answer: str | None = None  # None when the question could not be asked (see error)
    em: float | None = None
    f1: float | None = None
    f1_first: float | None = None  # F1 of the answer's first sentence (metrics.f1_first_sentence)
    answer_in_output: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    load_ms: float | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    retrieval_ms: float | None = None
    retrieved: list[dict] | None = None  # rag: [{doc, index, score}]
    retrieval_hit: bool | None = None  # rag: every gold document retrieved
    retrieval_recall: float | None = None
    # cag on a sharded corpus (None otherwise): shard count, the answer's shard(s) with routing scores,
    # routing time, the 2 best shards by routing, and the share of the question's gold documents in
    # the shard that answered (recall@1 shard) and in the 2 best shards (recall@2 shards)
    n_shards: int | None = None
    shards: list[dict] | None = None
    routing_ms: float | None = None
    routed: list[int] | None = None
    routing_recall: float | None = None
    routing_recall2: float | None = None
    error: str | None = None

    @property
    def key(self) -> tuple:
        """What --resume matches on: one row per (set, question, mode, k)."""
        return (self.set, self.qid, self.mode, self.k)

    @property
    def ok(self) -> bool:
        return not self.error

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.retriever is None:
            for name in _RAG_ONLY:
                d.pop(name)
        if self.n_shards is None:
            for name in ("n_shards", *_SHARDED_ONLY):
                d.pop(name)
        if self.error is None:
            d.pop("error")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Row:
        """A row as written by this or an earlier version: unknown keys are ignored, missing ones
        default, and a missing first-sentence F1 is computed from the answer."""
        known = {f.name for f in fields(cls)}
        row = cls(**{k: v for k, v in d.items() if k in known})
        if row.f1_first is None and row.answer is not None and row.golds:
            row.f1_first = round(f1_first_sentence(row.answer, row.golds), 4)
        return row


def label(mode: str, k: int | None) -> str:
    """How reports name a mode: "cag", "cag@1000", "rag-bm25 k=3"."""
    return f"{mode} k={k}" if k is not None else mode


def variant_mode(shard_tokens: int) -> str:
    """The mode of one shard-size sweep value: 0 (what fits) is `cag` itself, N > 0 is `cag@N`."""
    return f"cag{VARIANT}{shard_tokens}" if shard_tokens else "cag"


def shard_cap(mode: str) -> int | None:
    """`cag@1000` -> 1000, `cag` -> 0 (what fits), any other mode -> None."""
    if mode == "cag":
        return 0
    base, sep, cap = mode.partition(VARIANT)
    return int(cap) if base == "cag" and sep and cap.isdigit() else None


def read_rows(path: Path) -> list[Row]:
    """Every complete row of a results.jsonl (none when the file does not exist)."""
    path = Path(path)
    rows: list[Row] = []
    if not path.exists():
        return rows
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill mid-write: that row is simply asked again
            missing = [k for k in _REQUIRED if not isinstance(d, dict) or k not in d]
            if missing:
                raise BadInput(f"{path}:{line_no} is not a compare result row (no {', '.join(missing)})")
            rows.append(Row.from_dict(d))
    return rows


class ResultsLog:
    """Appends rows to results.jsonl, one flushed line each: `with ResultsLog(path) as log: log.append(row)`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f: TextIO | None = None  # open inside `with`

    def __enter__(self) -> ResultsLog:
        cut = False
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"
        self._f = open(self.path, "a", encoding="utf-8")
        if cut:  # the last line was cut by a kill: end it, so the next row is a line of its own
            self._f.write("\n")
        return self

    def append(self, row: Row) -> None:
        assert self._f is not None, "append inside `with ResultsLog(path) as log`"
        self._f.write(json.dumps(row.to_dict(), ensure_ascii=False) + "\n")
        self._f.flush()

    def __exit__(self, *exc) -> None:
        assert self._f is not None
        self._f.close()


def write_json(path: Path, obj) -> None:
    """Replace a JSON file whole (temp file + rename): a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_run(out: Path) -> tuple[dict, list[dict], list[Row]]:
    """(run.json, sets.json, rows) of a run folder."""
    out = Path(out)
    try:
        meta = json.loads((out / RUN).read_text(encoding="utf-8"))
        sets = json.loads((out / SETS).read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise BadInput(f"{out} is not a compare run folder: {Path(e.filename).name} is missing") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{out}: cannot read the run's files: {e}") from None
    return meta, sets, read_rows(out / RESULTS)


# -- sets.json: one record per knowledge set (ingested_sets.SetInfo) --------------------------


def set_snapshots(s: dict, mode: str = "cag") -> list[dict]:
    """The snapshots (one per shard) a set was ingested into for `mode` (`cag`, or a sweep's
    `cag@N`). Runs written before the list existed carry a single `ingest` record."""
    if mode != "cag":
        return ((s.get("variants") or {}).get(mode) or {}).get("snapshots") or []
    if s.get("snapshots") is not None:
        return s["snapshots"]
    return [s["ingest"]] if s.get("ingest") else []


def shards_text(snaps: list[dict]) -> str:
    """A set's shards as one cell: "1" or "3 (7,612 / 7,598 / 1,204 tokens)"."""
    if len(snaps) <= 1:
        return str(len(snaps)) if snaps else "–"
    toks = [x.get("n_tokens") or 0 for x in snaps]
    if len(toks) > 6:
        return f"{len(toks)} ({min(toks):,}–{max(toks):,} tokens each)"
    return f"{len(toks)} ({' / '.join(f'{t:,}' for t in toks)} tokens)"


def ready_sets(sets: list[dict]) -> list[dict]:
    return [s for s in sets if not s.get("skipped")]


def sizes_run(sets: list[dict]) -> list[int]:
    """The sizes with at least one set that was run, in the order of the run."""
    return list(dict.fromkeys(s["size"] for s in ready_sets(sets)))


def prefix_range(sets: list[dict], size: int) -> str:
    """The real prefix tokens of a size's sets: "1,476" or "5,114–6,956"."""
    vals = [s["prefix_tokens"] for s in ready_sets(sets) if s["size"] == size]
    if not vals:
        return "–"
    lo, hi = min(vals), max(vals)
    return f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
