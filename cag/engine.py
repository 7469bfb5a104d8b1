"""The engine: ingest a corpus into a snapshot, answer a question from it, say how fresh it is.

Read top to bottom: ingest (plan the prefix, reuse a verified snapshot, else prefill and save)
and ask (check the question, take the prefix for the mode, generate). The pieces live in their
own rooms: corpus.py (files, lock), prompt.py (layout), kv.py (cache), generate.py (decode),
resident.py (snapshots kept in memory), results.py (what comes back), store/ (files, SQLite).
RAG is a `full` prompt over retrieved passages, built above the engine in cag.rag.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from cag.answering import across_shards, chat, questions
from cag.answering.questions import Question, suffix_room
from cag.answering.resident import Resident, ResidentPool
from cag.config import Settings
from cag.errors import BadInput, NotFound, TooLarge
from cag.hashing import hash_obj
from cag.kernels import native
from cag.knowledge import corpus as corpora
from cag.knowledge import freshness, verify
from cag.knowledge import ingest as steps
from cag.knowledge.names import check_corpus_name
from cag.model import facts as model_facts
from cag.model.facts import ModelFacts
from cag.model.loading import LoadedModel, load_model
from cag.model.prompt import Layout, build_prefix, layout_for
from cag.results import Answer, CorpusStatus, IngestResult, Mode, Reporter, StalePolicy
from cag.runtime import describe, kv_cache
from cag.runtime.decoder import Decoder
from cag.runtime.generate import DecodeConfig, Generated
from cag.runtime.kept_conversations import KeptConversations
from cag.runtime.requests import Request
from cag.runtime.slots import PrefixKV
from cag.store import snapshots as snapfiles
from cag.store.index import Index
from cag.store.sync import shared_store

__all__ = ["Answer", "CorpusStatus", "Engine", "IngestResult", "Mode", "Reporter", "StalePolicy"]


class Engine:
    def __init__(self, settings: Settings, lm: LoadedModel | None = None):
        self.settings = settings
        self.index = Index(settings.index_path)
        self._lm = lm
        self._lm_lock = threading.Lock()
        # called with None before the model loads and with the seconds it took after (the CLI's line)
        self.on_load = None
        # kept conversations count in the resident budget (cag.answering.resident), with a cap of their own
        self.kept = KeptConversations(min(settings.conversation_bytes, settings.resident_bytes))
        self.resident = ResidentPool(settings.resident_bytes, self.kept)
        self._decoder: Decoder | None = None
        self._layout: tuple[LoadedModel, Layout, str] | None = None
        self.remote = shared_store(settings, self.index)  # CAG_STORE (store/sync.py); falsy without one

    # -- the model and what follows from it ------------------------------------------------------
    @property
    def lm(self) -> LoadedModel:
        with self._lm_lock:
            if self._lm is None:
                s, t = self.settings, time.perf_counter()
                if self.on_load:
                    self.on_load(None)
                self._lm = load_model(s.model, s.models_dir, s.threads, s.dtype, s.weights, s.device, s.decode_kernels,
                                      s.keep_packed)
                model_facts.record(self.index, s, self._facts_of(self._lm))
                if self.on_load:
                    self.on_load(time.perf_counter() - t)
            return self._lm

    @property
    def model_loaded(self) -> bool:
        return self._lm is not None

    def facts(self) -> ModelFacts:
        """The configured model's fingerprints and description: from the loaded model, else as a load
        under these settings recorded them (cag.model.facts), else from loading it."""
        if self._lm is None and (known := model_facts.lookup(self.index, self.settings)) is not None:
            return known
        return self._facts_of(self.lm)

    def _facts_of(self, lm: LoadedModel) -> ModelFacts:
        attn = str(lm.attn_dtype).removeprefix("torch.")
        kv = snapfiles.DTYPES[model_facts.kv_name(self.settings.kv_dtype, attn)]
        return ModelFacts(lm.fingerprint, lm.tokenizer_fingerprint, attn, describe.info(lm, kv))

    @property
    def decoder(self) -> Decoder:
        """Where answers are decoded: batched across concurrent requests (cag.runtime.decoder)."""
        lm, chunk = self.lm, self.chunk  # both take _lm_lock: read before holding it
        with self._lm_lock:
            if self._decoder is None or self._decoder.lm is not lm:
                s = self.settings
                self.kept.clear()  # K/V of another model's (or format's) steps
                self._decoder = Decoder(lm, suffix_room(lm), s.max_batch, s.threads, chunk, s.cuda_graphs,
                                        self.kept, graph_room=-(-self.room // 512) * 512, rows=s.decode_rows)
            return self._decoder

    @property
    def kv_name(self) -> str:
        """Snapshot storage dtype: CAG_KV_DTYPE, `auto` = what decode attends in when that is bf16 (a
        snapshot then loads with no conversion), else float16 (half of float32's bytes)."""
        return model_facts.kv_name(self.settings.kv_dtype, str(self.lm.attn_dtype).removeprefix("torch."))

    @property
    def kv_dtype(self):
        return snapfiles.DTYPES[self.kv_name]

    @property
    def room(self) -> int:
        return self.settings.question_room + self.settings.answer_room

    @property
    def chunk(self) -> int:
        """Prefill chunk: CAG_CHUNK_TOKENS, 0 = auto (256 on a CPU, 4096 on CUDA; config.py says why)."""
        return self.settings.chunk_tokens or (4096 if self.lm.device.type == "cuda" else 256)

    @property
    def prefill_block(self) -> int:
        """Rows of each knowledge-prefill forward on this model's device (kv_cache.BLOCK: part of the key)."""
        return self.settings.prefill_block or kv_cache.block_for(self.lm.device)

    @property
    def suffix_room(self) -> int:
        return suffix_room(self.lm)

    def layout(self) -> Layout:
        return self._layouts()[1]

    def _layouts(self) -> tuple[LoadedModel, Layout, str]:
        lm = self.lm
        if self._layout is None or self._layout[0] is not lm:  # rendering the chat template: once per model
            layout = layout_for(lm.tokenizer)
            self._layout = (lm, layout, chat.turn_piece(lm.tokenizer, layout))
        return self._layout

    def require_fit(self, n_prefix: int, what: str) -> None:
        lm = self.lm
        if not lm.fits(n_prefix, self.room):
            raise TooLarge(f"{what} is {n_prefix} tokens; with {self.room} reserved for question and answer the "
                           f"model's context of {lm.max_context} leaves room for {lm.max_context - self.room}")

    def snapshot_key(self, ids: list[int], kv_name: str | None = None) -> str:
        """Everything that determines the tensors (stored as `kv_name`, default the configured dtype);
        docs/concepts.md (snapshot keys)."""
        lm = self.lm
        return hash_obj({
            "format": snapfiles.FORMAT_VERSION, "model": lm.fingerprint, "tokenizer": lm.tokenizer_fingerprint,
            "layout": self.layout().as_dict(), "ids": hash_obj(ids), "dtype": snapfiles.codec(kv_name or self.kv_name),
            "compute_dtype": str(lm.dtype), "prefill_block": self.prefill_block,
        })

    def read_corpus(self, source: Path, corpus: str | None):
        return corpora.read_corpus(self.index, source, corpus, self.settings)  # within the input limits

    # -- ingest ----------------------------------------------------------------------------------
    def ingest(self, target: str, name: str | None = None, force: bool = False, ttl_s: float | None = None,
               reporter: Reporter | None = None, shard_tokens: int | None = None) -> IngestResult:
        """Prefill a corpus into one snapshot per shard (one shard when it fits a context). A shard
        whose key has a verified snapshot is reused; otherwise its current snapshot is reused up to
        the first changed document. `shard_tokens` caps a shard (0: what fits; kept for refreshes)."""
        if ttl_s is not None and not ttl_s >= 0:
            raise BadInput(f"ttl must be 0 or more seconds, got {ttl_s}")
        if shard_tokens is not None and shard_tokens < 0:
            raise BadInput(f"shard tokens must be 0 (what fits) or more, got {shard_tokens}")
        try:
            name, source = corpora.resolve_source(self.index, target, name)
        except NotFound:  # a corpus only the shared store knows here: its ref's source (store/sync.py)
            if not (self.remote and (known := self.remote.source_of(target))):
                raise
            name, source = name or target, Path(known)
        name = check_corpus_name(name)
        reporter = reporter or Reporter()
        with corpora.writer_lock(self.settings.home, name):
            plan = steps.plan(self, name, source, ttl_s, shard_tokens, reporter)
            fresh = [None if force else steps.reuse_fresh(self, s) for s in plan.shards]
            reuse = [(0, None) if f or force else steps.reusable(self, name, s) for f, s in zip(fresh, plan.shards)]
            todo = sum(len(s.prefix.ids) - r for (r, _), s, f in zip(reuse, plan.shards, fresh) if not f)
            n = sum(len(s.prefix.ids) for s in plan.shards)
            est = [self.lm.kv_bytes(len(s.prefix.ids), self.kv_dtype) for s in plan.shards]
            getattr(reporter, "shards", lambda _: None)([{"shard": s.index, "n_tokens": len(s.prefix.ids), "bytes": b}
                                                         for s, b in zip(plan.shards, est)])
            if todo:
                reporter.estimate(n, sum(est), n - todo)
                tick = reporter.progress(todo)
            built = [f or steps.build(self, plan, s, r, old, tick) for f, s, (r, old) in zip(fresh, plan.shards, reuse)]
            if todo:
                reporter.done()
            steps.publish(self, plan, built)
        return IngestResult.of(plan, built, est)

    def open_snapshot(self, row: dict, dequant=None) -> snapfiles.Snapshot:
        """Load a snapshot file and verify it (cag.knowledge.verify); a failure marks it corrupt."""
        return verify.open_snapshot(self, row, dequant)

    # -- ask -------------------------------------------------------------------------------------
    def ask(self, corpus: str, question: str | None, mode: str = "cag", max_tokens: int | None = None,
            on_text=None, should_stop=None, on_stale: str = "serve", decoding: DecodeConfig | None = None,
            shards: int = 1, messages: list | None = None, scope: str | None = None, search: str | None = None) -> Answer:
        """Answer from the snapshot (`cag`) or from the whole corpus prefilled again (`full`). A
        sharded corpus answers from its `shards` best shards (more than it has: all of them).
        `messages` (chat messages, cag.answering.chat) in place of `question`: answer a conversation's last
        user message with the whole conversation in the prompt. `scope`: whose kept conversations the
        answer may reuse and extend (an API key's; None: the one user's). `search`: what a sharded corpus
        routes by, in place of the question (cag+rag's quote is not what the question asks)."""
        q = self.check(corpus, question, mode, max_tokens, on_stale, decoding, messages)
        q.scope, q.search = scope, search
        if q.mode in (Mode.RAG, Mode.HYBRID):
            raise BadInput(f"mode {q.mode.value!r} is answered by cag.rag.answer.ask, above the engine")
        if q.mode is Mode.FULL and len(self.index.shards(corpus)) > 1:  # no context holds it all: the routed shard
            rows, (route, *_), routing_ms = across_shards.route(self, corpus, q.search_text, 1)
            snap = self.index.snapshot(rows[route.shard]["snapshot"])
            assert snap is not None  # a shard row names a snapshot the index holds (published together)
            ids = snapfiles.read_ids(self.remote.ensure_local(snap["digest"], Path(snap["path"])))
            return self.answer_prompt(q, ids, on_text, should_stop, held=snap, routing_ms=round(routing_ms, 2),
                                      shards=[{"shard": route.shard, "score": round(route.score, 4), "n_tokens": len(ids)}])
        if q.mode is Mode.FULL:
            docs, _ = self.read_corpus(Path(q.row["source"]), corpus)
            prefix = build_prefix(self.lm.tokenizer, self.layout(), [(d.name, d.text) for d in docs])
            return self.answer_prompt(q, prefix.ids, on_text, should_stop)
        return self._answer_cached(q, on_text, should_stop, max(1, shards))  # across_shards.route clamps to the count

    def check(self, corpus: str, question: str | None, mode: str = "cag", max_tokens: int | None = None,
              on_stale: str = "serve", decoding: DecodeConfig | None = None, messages: list | None = None) -> Question:
        """Everything a question (or a conversation: `messages`) needs before any model work (cag.answering.questions)."""
        return questions.check(self, corpus, question, mode, max_tokens, on_stale, decoding, messages)

    def answer_prompt(self, q: Question, prefix_ids: list[int], on_text=None, should_stop=None,
                      held: dict | None = None, **extra) -> Answer:
        """Answer over a prefix prefilled now, with no snapshot (`full`, and RAG's passages): the same
        prefill as ingest's, then the same question and decode path as `cag`'s. `full` holds its K/V
        at the precision of the snapshot `cag` reads (`held`, else the corpus's), which may differ
        from the setting's (stale, still served): cag == full, bitwise."""
        lm, n = self.lm, len(prefix_ids)
        self.require_fit(n, "the prompt's knowledge")
        store = self.kv_dtype
        if q.mode is not Mode.RAG:  # RAG's passages have no snapshot to match
            held = held or (self.index.snapshot(q.row["current_snapshot"]) if q.row.get("current_snapshot") else None)
            store = snapfiles.DTYPES.get(held["dtype"], self.kv_dtype) if held else self.kv_dtype
        cache = kv_cache.new_cache(lm.model, kv_cache.padded(n, self.prefill_block))
        kv_cache.prefill_knowledge(lm.model, cache, prefix_ids, 0, self.prefill_block, store, should_stop=should_stop)
        views, codes = kv_cache.stored(kv_cache.views(cache, n), store)
        gen, _ = self._generate(PrefixKV.of(views, lm.attn_dtype, lm.device, self._read(codes)), q, on_text, should_stop)
        return self._finish(q, gen, n, 0, 0.0, None if q.mode is Mode.RAG else q.row["current_snapshot"], **extra)

    def _answer_cached(self, q: Question, on_text, should_stop, shards: int = 1) -> Answer:
        if len(self.index.shards(q.corpus)) > 1:
            best, tried, routing_ms = across_shards.answer(self, q, shards, on_text, should_stop)
            return self._finish(q, best.gen, best.n_tokens, best.n_tokens + best.gen.reused, best.load_ms, best.snapshot,
                                shards=[t.info() | {"chosen": t is best} for t in tried], routing_ms=round(routing_ms, 2))
        digest = q.row["current_snapshot"]
        if not digest or self.index.snapshot(digest) is None:
            raise NotFound(f"corpus {q.corpus!r} has no snapshot: run `cag ingest {q.corpus}`")
        gen, n, load_ms, _ = self.generate_cached(q, digest, on_text, should_stop)
        return self._finish(q, gen, n, n + gen.reused, load_ms, digest)

    def generate_cached(self, q: Question, digest: str, on_text=None, should_stop=None, score: bool = False):
        """Answer over resident snapshot `digest`: (Generated, prefix tokens, load ms, mean
        log-probability of the answer's tokens when `score`)."""
        t0 = time.perf_counter()
        res = self.resident.get(digest, lambda: self._load_resident(digest))
        load_ms = (time.perf_counter() - t0) * 1e3
        key = digest if q.scope is None else f"{digest}/{q.scope}"  # one key's conversations: invisible to another's
        gen, logprob = self._generate(res.prefix, q, on_text, should_stop, score, key=key)
        return gen, res.prefix.n, load_ms, logprob

    def _generate(self, prefix: PrefixKV, q: Question, on_text, should_stop, score: bool = False, key: str | None = None):
        """Decode over `prefix`; `key` (a snapshot digest) keeps the suffix for, and reuses, kept conversations."""
        questions.fit(q, prefix.n, self.lm.max_context, self.suffix_room)
        req = self.decoder.run(Request(prefix, q.suffix, q.decoding, on_text, should_stop, q.t_start, score, key=key))
        assert req.result is not None  # run returns a finished request, or raises its error
        req.result.reused = req.start
        return req.result, req.mean_logprob()

    def _load_resident(self, digest: str) -> Resident:
        row = self.index.snapshot(digest)
        if row is None:  # gone from the index since it was routed to (a gc, a reindex): as a missing file
            raise NotFound(f"snapshot {digest[:12]} is no longer in the index; `cag ingest` the corpus again")
        snap = self.open_snapshot(row)
        prefix = PrefixKV.of(snap.kv, self.lm.attn_dtype, self.lm.device, self._read(snap.codes))  # once: every request reads it
        snap.kv, snap.codes = [], None  # the storage-dtype tensors are not needed again
        return Resident(snap, prefix)

    def _read(self, codes: list | None) -> list | None:
        """An int8 snapshot's codes where decode rows read them (cag.kernels.native's AVX-512 attention, heads of
        native.INT8_HEAD_DIMS, 80 included), else None: the prefix is then its dequantized K/V."""
        return codes if self.lm.backend.int8_codes and self.lm.head_dim in native.INT8_HEAD_DIMS else None

    def _finish(self, q: Question, gen: Generated, n_prefix: int, cached: int, load_ms: float,
                snapshot: str | None, **extra) -> Answer:
        ans = Answer(answer=gen.text, mode=q.mode.value, corpus=q.corpus, snapshot=snapshot, stale=bool(q.reasons),
                     stale_reasons=q.reasons, prompt_tokens=n_prefix + len(q.suffix), cached_tokens=cached,
                     completion_tokens=len(gen.ids), load_ms=round(load_ms, 2), ttft_ms=round(gen.ttft_ms, 2),
                     total_ms=round((time.perf_counter() - q.t_start) * 1e3, 2), decode_tok_s=gen.decode_tok_s,
                     token_ids=gen.ids, conversation_tokens=gen.reused, decode=describe.decode_path(self.lm), **extra)
        row = ans.to_dict()
        for k in ("stale", "stale_reasons", "passages", "decode_tok_s", "shards", "routing_ms", "conversation_tokens"):
            row.pop(k)
        if (failed := self.index.log_query(dict(row, question=q.text))) is not None:
            ans.warnings.append(failed)  # the answer stands (a read-only index, a full disk)
        return ans

    # -- resident snapshots ----------------------------------------------------------------------
    @property
    def stats(self) -> dict:  # resident snapshot and kept conversation counters, and the decoder's once one runs
        return self.resident.stats | self.kept.snapshot() | (self._decoder.snapshot() if self._decoder else {})

    @property
    def resident_bytes(self) -> int:  # snapshots and kept conversations, as the resident budget counts them
        return self.resident.nbytes + self.kept.nbytes

    def evict(self, digest: str | None = None) -> None:
        self.resident.evict(digest)

    # -- status ----------------------------------------------------------------------------------
    def stale_reasons(self, row: dict, check_model: bool = True) -> list[str]:
        return freshness.corpus_reasons(self.index, self.remote, self.settings, row, self.facts() if check_model else None)

    def status(self, corpus: str, check_model: bool = True) -> CorpusStatus:
        return freshness.status(self.index, self.remote, self.settings, corpus, self.facts() if check_model else None)

    def list(self, check_model: bool = True) -> list[CorpusStatus]:
        return [self.status(r["name"], check_model) for r in self.index.corpora()]
