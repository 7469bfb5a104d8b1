"""Ingest / ask / status: wires model, prompt, kv, decode and the store together.

The engine speaks plain dataclasses; the CLI and the HTTP API are thin layers over it.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cag.store import snapshots as snapfiles
from cag.store.index import Index

from . import documents, kv
from .config import Settings
from .errors import BadInput, Busy, NotFound, SnapshotCorrupt, StaleRefused, TooLarge
from .freshness import stale_reasons
from .generate import DecodeConfig, TextStream, decode, stop_ids
from .hashing import hash_obj, short
from .model import LoadedModel, load_model
from .prompt import Layout, build_prefix, build_suffix, layout_for

MODES = ("cag", "full", "rag")
STALE_POLICIES = ("serve", "refuse", "refresh")


@dataclass
class IngestResult:
    corpus: str
    snapshot: str  # key digest
    n_documents: int
    n_tokens: int
    bytes: int
    prefill_ms: float
    status: str  # built | refreshed | fresh
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    estimate_bytes: int = 0
    skipped: list[str] = field(default_factory=list)
    path: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Answer:
    answer: str
    mode: str
    corpus: str
    snapshot: str | None
    stale: bool
    stale_reasons: list[str]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    load_ms: float
    ttft_ms: float
    total_ms: float
    retrieval_ms: float = 0.0  # rag mode only
    token_ids: list[int] = field(default_factory=list, repr=False)
    passages: list[dict] = field(default_factory=list, repr=False)  # rag mode: what was retrieved

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("token_ids")
        return d


@dataclass
class CorpusStatus:
    name: str
    source: str
    model: str
    snapshot: str | None
    n_documents: int
    n_tokens: int
    bytes: int
    created: float | None
    last_used: float | None
    stale: bool
    reasons: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


class Reporter:
    """Hooks for long work; the CLI draws them (progress bar on a terminal), the API records them."""

    def estimate(self, n_tokens: int, n_bytes: int, reused: int) -> None: ...
    def progress(self, total: int) -> Callable[[int], None]:
        return lambda n: None
    def done(self) -> None: ...


@dataclass
class _Resident:
    """A loaded snapshot: storage tensors plus ready request buffers (prefix already copied in)."""

    snap: snapfiles.Snapshot
    max_len: int
    free: list = field(default_factory=list)  # StaticCache buffers, positions [0, n) hold the prefix
    nbytes: int = 0


class Engine:
    def __init__(self, settings: Settings, lm: LoadedModel | None = None):
        self.settings = settings
        self.index = Index(settings.index_path)
        self._lm = lm
        self._lm_lock = threading.Lock()
        self._resident: OrderedDict[str, _Resident] = OrderedDict()
        self._res_lock = threading.Lock()
        self.stats = {"snapshot_hits": 0, "snapshot_loads": 0}  # resident-cache counters for /metrics

    # -- model ---------------------------------------------------------------------------------
    @property
    def lm(self) -> LoadedModel:
        with self._lm_lock:
            if self._lm is None:
                self._lm = load_model(self.settings.model, self.settings.models_dir, self.settings.threads, self.settings.dtype)
            return self._lm

    @property
    def kv_dtype(self) -> torch.dtype:
        try:
            return snapfiles.DTYPES[self.settings.kv_dtype]
        except KeyError:
            raise BadInput(f"unknown kv dtype {self.settings.kv_dtype!r}; use one of {', '.join(snapfiles.DTYPES)}") from None

    @property
    def room(self) -> int:
        return self.settings.question_room + self.settings.answer_room

    def layout(self) -> Layout:
        lm = self.lm
        if getattr(self, "_layout_for", None) is not lm:  # rendering the chat template costs ~1 ms
            self._layout, self._layout_for = layout_for(lm.tokenizer), lm
        return self._layout

    def snapshot_key(self, ids: list[int]) -> str:
        """Everything that determines the tensors; see DESIGN.md section 3-5."""
        lm = self.lm
        return hash_obj({
            "format": snapfiles.FORMAT_VERSION,
            "model": lm.fingerprint,
            "tokenizer": lm.tokenizer_fingerprint,
            "layout": self.layout().as_dict(),
            "ids": hash_obj(ids),
            "dtype": self.settings.kv_dtype,
            "compute_dtype": str(lm.dtype),
        })

    # -- ingest --------------------------------------------------------------------------------
    def resolve_source(self, target: str, name: str | None) -> tuple[str, Path]:
        """A bare name of a known corpus means that corpus (its recorded source), even when a
        folder of the same name sits in the working directory; anything else is a path."""
        row = self.index.corpus(target)
        if row and os.sep not in target and not target.startswith((".", "~")):
            return name or target, Path(row["source"])
        p = Path(target).expanduser()
        if p.exists():
            p = p.resolve()
            return name or (p.stem if p.is_file() else p.name), p
        raise NotFound(f"no such file, folder or corpus: {target}")

    @contextmanager
    def _lock(self, corpus: str):
        """One writer per corpus: a second ingest of it exits with Busy instead of racing."""
        locks = self.settings.home / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{hash_obj(corpus)[7:23]}.lock", "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Busy(f"corpus {corpus!r} is being ingested by another process; try again when it finishes") from None
            yield

    def read_corpus(self, source: Path, corpus: str | None) -> tuple[list[documents.Document], list[str]]:
        """Documents in prompt order: those already in the corpus keep their place, new ones are
        appended (sorted by name), so adding a document re-prefills only that document."""
        if not source.exists():
            raise NotFound(f"source missing: {source}")
        entries, skipped = documents.scan(source)
        if not entries:
            what = f" (skipped unsupported: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''})" if skipped else ""
            raise BadInput(f"no supported documents in {source}{what}; supported: {', '.join(sorted(documents.SUPPORTED))}")
        known = {d["path"]: d["ordinal"] for d in self.index.documents(corpus)} if corpus else {}
        entries.sort(key=lambda e: (e.name not in known, known.get(e.name, 0), e.name))
        docs = [documents.read(e) for e in entries]
        empty = [d.name for d in docs if not d.text.strip()]
        docs = [d for d in docs if d.text.strip()]
        if not docs:
            raise BadInput(f"every document in {source} is empty")
        return docs, skipped + [f"{n} (empty)" for n in empty]

    def ingest(self, target: str, name: str | None = None, force: bool = False, ttl_s: float | None = None,
               reporter: Reporter | None = None) -> IngestResult:
        reporter = reporter or Reporter()
        name, source = self.resolve_source(target, name)
        if not name or "/" in name:
            raise BadInput(f"invalid corpus name {name!r}")
        with self._lock(name):
            docs, skipped = self.read_corpus(source, name)
            lm = self.lm
            prefix = build_prefix(lm.tokenizer, self.layout(), [(d.name, d.text) for d in docs])
            n = len(prefix.ids)
            if n + self.room > lm.max_context:
                raise TooLarge(
                    f"knowledge is {n} tokens; with {self.room} reserved for question and answer the "
                    f"model's context of {lm.max_context} leaves room for {lm.max_context - self.room}"
                )
            key = self.snapshot_key(prefix.ids)
            digest = short(key, 32)
            path = self.settings.snapshots_dir / f"{digest}.safetensors"
            corpus_row = {"name": name, "source": str(source), "model": lm.name,
                          "ttl_s": ttl_s if ttl_s is not None else (self.index.corpus(name) or {}).get("ttl_s")}
            doc_rows = [{"path": d.name, "content_hash": d.content_hash, "size": d.size, "mtime": d.mtime} for d in docs]
            spans = [{"path": s[0], "content_hash": d.content_hash, "start": s[1], "end": s[2]}
                     for s, d in zip(prefix.spans, docs)]
            est = snapfiles.expected_bytes(lm.n_layers, lm.n_kv_heads, lm.head_dim, self.kv_dtype, n)

            existing = self.index.snapshot(digest)
            if not force and existing and existing["status"] in ("ready", "superseded") and path.exists():
                try:
                    snapfiles.load(path, expect_key=key)  # verified: a damaged file is rebuilt below
                    self.index.publish(corpus_row, doc_rows, dict(existing, corpus=existing["corpus"]), spans)
                    return IngestResult(name, digest, len(docs), n, existing["bytes"], 0.0, "fresh",
                                        reused_tokens=n, estimate_bytes=est, skipped=skipped, path=str(path))
                except snapfiles.SnapshotError:
                    pass

            reused, old_kv = (0, None) if force else self._reusable(name, prefix.ids)
            reporter.estimate(n, est, reused)
            t0 = time.perf_counter()
            cache = kv.new_cache(lm.model, n + self.room)
            if old_kv is not None:
                kv.load_into(cache, [(k[:, :, :reused], v[:, :, :reused]) for k, v in old_kv], lm.dtype)
            tick = reporter.progress(n - reused)
            kv.prefill(lm.model, cache, prefix.ids[reused:], reused, self.settings.chunk_tokens, tick)
            reporter.done()
            prefill_ms = (time.perf_counter() - t0) * 1e3
            meta = {"key": key, "corpus": name, "model": lm.name, "model_fingerprint": lm.fingerprint,
                    "tokenizer_fingerprint": lm.tokenizer_fingerprint, "layout": self.layout().as_dict(),
                    "n_kv_heads": lm.n_kv_heads, "head_dim": lm.head_dim, "spans": spans,
                    "created": time.time(), "compute_dtype": str(lm.dtype),
                    "source": str(source), "ttl_s": corpus_row["ttl_s"], "n_documents": len(docs),
                    "reused_tokens": reused, "prefill_ms": prefill_ms}
            nbytes = snapfiles.save(path, kv.export(cache, n), prefix.ids, meta, self.kv_dtype)
            del cache
            snap_row = {"key": key, "digest": digest, "corpus": name, "model": lm.name,
                        "model_fingerprint": lm.fingerprint, "tokenizer_fingerprint": lm.tokenizer_fingerprint,
                        "n_tokens": n, "n_documents": len(docs), "bytes": nbytes, "dtype": self.settings.kv_dtype,
                        "path": str(path), "created": meta["created"], "last_used": None,
                        "prefill_ms": prefill_ms, "reused_tokens": reused}
            self.index.publish(corpus_row, doc_rows, snap_row, spans)
            self._evict(digest)
            return IngestResult(name, digest, len(docs), n, nbytes, round(prefill_ms, 1),
                                "refreshed" if reused else "built", reused, n - reused, est, skipped, str(path))

    def _reusable(self, corpus: str, ids: list[int]) -> tuple[int, list | None]:
        """Tokens of the current snapshot that stay valid: the longest common prefix of token ids,
        cut back to a document boundary (KV at position i depends only on tokens 0..i)."""
        row = self.index.corpus(corpus)
        snap = self.index.snapshot(row["current_snapshot"]) if row and row.get("current_snapshot") else None
        if not snap or snap["model_fingerprint"] != self.lm.fingerprint or snap["dtype"] != self.settings.kv_dtype:
            return 0, None
        try:
            old = snapfiles.load(Path(snap["path"]), expect_key=snap["key"])
        except snapfiles.SnapshotError:
            return 0, None
        common = 0
        for a, b in zip(old.ids, ids):
            if a != b:
                break
            common += 1
        spans = self.index.snapshot_documents(snap["digest"])
        bounds = [s["start"] for s in spans] + [max((s["end"] for s in spans), default=0)]
        cut = max((b for b in bounds if b <= common), default=0)
        return cut, (old.kv if cut else None)

    # -- ask -----------------------------------------------------------------------------------
    def ask(self, corpus: str, question: str, mode: str = "cag", max_tokens: int | None = None,
            on_text: Callable[[str], None] | None = None, should_stop: Callable[[], bool] | None = None,
            on_stale: str = "serve", decoding: DecodeConfig | None = None, k: int = 3,
            retriever: str = "bm25") -> Answer:
        lm = self.lm  # loading the model is a one-time cost of the process, not of the question
        if self.settings.threads > 0:
            torch.set_num_threads(self.settings.threads)  # per calling thread: server workers need it too
        t_start = time.perf_counter()
        if mode not in MODES:
            raise BadInput(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
        if on_stale not in STALE_POLICIES:
            raise BadInput(f"unknown stale policy {on_stale!r}; use one of {', '.join(STALE_POLICIES)}")
        if not question or not question.strip():
            raise BadInput("empty question")
        row = self.index.corpus(corpus)
        if row is None:
            raise NotFound(f"unknown corpus {corpus!r}; `cag list` shows the known ones")
        max_tokens = self.settings.max_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise BadInput("max_tokens must be at least 1")
        max_tokens = min(max_tokens, self.settings.answer_room)
        cfg = decoding or DecodeConfig()
        cfg = DecodeConfig(max_tokens, cfg.temperature, cfg.top_p, cfg.seed)
        suffix = build_suffix(lm.tokenizer, self.layout(), question)
        if len(suffix) > self.settings.question_room:
            raise TooLarge(f"question is {len(suffix)} tokens; the room left for it is {self.settings.question_room}")

        reasons = self.stale_reasons(row)
        if reasons and on_stale == "refuse":
            raise StaleRefused(f"corpus {corpus!r} is stale: " + "; ".join(reasons))
        if reasons and on_stale == "refresh":
            self.ingest(row["source"], name=corpus)  # the recorded source, never a same-named folder in cwd
            row, reasons = self.index.corpus(corpus), []
        digest = row["current_snapshot"]

        if mode == "rag":
            from cag.rag.answer import answer_rag  # optional heavy import only when asked

            return answer_rag(self, row, question, cfg, k=k, retriever=retriever, on_text=on_text,
                              should_stop=should_stop, reasons=reasons, t_start=t_start)
        if mode == "full":
            docs, _ = self.read_corpus(Path(row["source"]), corpus)
            ids = build_prefix(lm.tokenizer, self.layout(), [(d.name, d.text) for d in docs]).ids
            if len(ids) + self.room > lm.max_context:
                raise TooLarge(f"knowledge is {len(ids)} tokens; too large for the model's context of {lm.max_context}")
            cache = kv.new_cache(lm.model, len(ids) + self.room)
            load_ms = 0.0
            kv.prefill(lm.model, cache, ids, 0, self.settings.chunk_tokens, should_stop=should_stop)
            n_prefix, cached, release = len(ids), 0, lambda: None
        else:
            t0 = time.perf_counter()
            res, cache = self._acquire(digest)
            load_ms = (time.perf_counter() - t0) * 1e3
            n_prefix, cached = res.snap.n_tokens, res.snap.n_tokens
            release = lambda: self._release(digest, res, cache)  # noqa: E731
        try:
            answer = self._generate(cache, n_prefix, suffix, cfg, on_text, should_stop, t_start)
        finally:
            release()
        ans = Answer(answer=answer[0], mode=mode, corpus=corpus, snapshot=digest, stale=bool(reasons),
                     stale_reasons=reasons, prompt_tokens=n_prefix + len(suffix), cached_tokens=cached,
                     completion_tokens=len(answer[1]), load_ms=round(load_ms, 2), ttft_ms=round(answer[2], 2),
                     total_ms=round((time.perf_counter() - t_start) * 1e3, 2), token_ids=answer[1])
        self.log(ans, question)
        return ans

    def _generate(self, cache, n_prefix: int, suffix: list[int], cfg: DecodeConfig, on_text, should_stop,
                  t_start: float) -> tuple[str, list[int], float]:
        lm = self.lm
        logits = kv.prefill(lm.model, cache, suffix, n_prefix, self.settings.chunk_tokens, should_stop=should_stop)
        stream, ids, ttft = TextStream(lm.tokenizer), [], None
        for tok in decode(lm.model, cache, logits, n_prefix + len(suffix), cfg, stop_ids(lm.model, lm.tokenizer), should_stop):
            if ttft is None:
                ttft = (time.perf_counter() - t_start) * 1e3
            ids.append(tok)
            piece = stream.push(tok)
            if on_text and piece:
                on_text(piece)
        if ttft is None:  # the first token was a stop token: an empty answer
            ttft = (time.perf_counter() - t_start) * 1e3
        return stream.text.strip(), ids, ttft

    def log(self, ans: Answer, question: str) -> None:
        row = ans.to_dict()
        for k in ("stale", "stale_reasons", "passages"):
            row.pop(k)
        self.index.log_query(dict(row, question=question))

    # -- resident snapshots ----------------------------------------------------------------------
    def _acquire(self, digest: str):
        """A request buffer holding the snapshot's prefix; loads and verifies the file on a miss."""
        with self._res_lock:
            res = self._resident.get(digest)
            if res is not None:
                self._resident.move_to_end(digest)
                self.stats["snapshot_hits"] += 1
                if res.free:
                    return res, res.free.pop()
        if res is None:
            res = self._load(digest)
        cache = kv.new_cache(self.lm.model, res.max_len)
        kv.load_into(cache, res.snap.kv, self.lm.dtype)
        return res, cache

    def _release(self, digest: str, res: _Resident, cache) -> None:
        kv.set_length(cache, res.snap.n_tokens)  # positions >= n are scratch for the next question
        with self._res_lock:
            if digest in self._resident and len(res.free) < self.settings.warm_buffers:
                res.free.append(cache)  # warm buffers make concurrent hits free; each holds (n + room) KV

    def _load(self, digest: str) -> _Resident:
        snap_row = self.index.snapshot(digest)
        if snap_row is None:
            raise NotFound("corpus has no snapshot: run `cag ingest` first")
        lm = self.lm
        try:
            snap = snapfiles.load(Path(snap_row["path"]), expect_key=snap_row["key"])
        except snapfiles.SnapshotError as e:
            self.index.set_snapshot_status(digest, "corrupt")
            raise SnapshotCorrupt(f"{e}; run `cag ingest {snap_row['corpus']}` to rebuild it") from None
        if snap.meta.get("model_fingerprint") != lm.fingerprint or self.snapshot_key(snap.ids) != snap.meta["key"]:
            raise StaleRefused(f"snapshot {digest[:12]} was built for another model or prompt layout; run `cag ingest {snap_row['corpus']}`")
        if not kv.kv_shape_ok(snap.kv, lm.n_layers, lm.n_kv_heads, lm.head_dim, snap.n_tokens):
            raise SnapshotCorrupt(f"snapshot {digest[:12]}: tensor shapes do not fit the model")
        per_tok = lm.kv_bytes_per_token(lm.dtype)
        res = _Resident(snap, snap.n_tokens + self.room,
                        nbytes=snap_row["bytes"] + self.settings.warm_buffers * per_tok * (snap.n_tokens + self.room))
        with self._res_lock:
            self.stats["snapshot_loads"] += 1
            self._resident[digest] = res
            self._resident.move_to_end(digest)
            self._shrink()
        return res

    def _shrink(self) -> None:
        while len(self._resident) > 1 and sum(r.nbytes for r in self._resident.values()) > self.settings.resident_bytes:
            self._resident.popitem(last=False)

    def _evict(self, digest: str | None = None) -> None:
        with self._res_lock:
            if digest is None:
                self._resident.clear()
            else:
                self._resident.pop(digest, None)

    @property
    def resident_bytes(self) -> int:
        with self._res_lock:
            return sum(r.nbytes for r in self._resident.values())

    # -- status --------------------------------------------------------------------------------
    def stale_reasons(self, row: dict, check_model: bool = True) -> list[str]:
        snap = self.index.snapshot(row["current_snapshot"]) if row.get("current_snapshot") else None
        lm = self.lm if check_model else None
        return stale_reasons(
            row, snap, self.index.snapshot_documents(snap["digest"]) if snap else [],
            self.index.documents(row["name"]),
            lm.fingerprint if lm else None, lm.tokenizer_fingerprint if lm else None, self.settings.ttl_s,
        )

    def status(self, corpus: str, check_model: bool = True) -> CorpusStatus:
        row = self.index.corpus(corpus)
        if row is None:
            raise NotFound(f"unknown corpus {corpus!r}; `cag list` shows the known ones")
        snap = self.index.snapshot(row["current_snapshot"]) if row.get("current_snapshot") else None
        reasons = self.stale_reasons(row, check_model)
        return CorpusStatus(
            name=row["name"], source=row["source"], model=row["model"],
            snapshot=snap["digest"] if snap else None, n_documents=snap["n_documents"] if snap else 0,
            n_tokens=snap["n_tokens"] if snap else 0, bytes=snap["bytes"] if snap else 0,
            created=snap["created"] if snap else None, last_used=snap["last_used"] if snap else None,
            stale=bool(reasons), reasons=reasons,
        )

    def list(self, check_model: bool = True) -> list[CorpusStatus]:
        return [self.status(r["name"], check_model) for r in self.index.corpora()]


def iter_answer(engine: Engine, *args, **kwargs) -> Iterator[str | Answer]:
    """Run `ask` in a worker thread and yield text pieces as they come, then the Answer."""
    import queue

    q: queue.Queue = queue.Queue()
    done = object()

    def work():
        try:
            q.put(engine.ask(*args, on_text=q.put, **kwargs))
        except BaseException as e:  # handed to the consumer, re-raised there
            q.put(e)
        finally:
            q.put(done)

    threading.Thread(target=work, daemon=True).start()
    while (item := q.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item
