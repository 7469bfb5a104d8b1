"""The engine: ingest a corpus into a snapshot, answer a question from it, say how fresh it is.

Read top to bottom: ingest (plan, reuse a verified snapshot, else prefill and save) and answer (check the Query once,
take the prefix for its mode, generate). The pieces live in their own rooms: knowledge/ (corpus files, ingest steps,
verify), answering/ (query, questions, chat, resident snapshots, shards, retrieval, quotes), runtime/ (decode), model/
(prompt layout), results.py, store/ (files, SQLite). `rag` and `cag+rag` retrieve through the Retrieval it is given."""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

from cag.answering import across_shards, answers, chat, questions, quotes, retrieval
from cag.answering.query import Query
from cag.answering.questions import Question, suffix_room
from cag.answering.resident import Resident, ResidentPool, codes_read
from cag.answering.retrieval import Retrieval
from cag.config import Settings
from cag.errors import BadInput, NotFound
from cag.knowledge import corpus as corpora
from cag.knowledge import freshness, verify
from cag.knowledge import ingest as steps
from cag.knowledge import shards as shard_plan
from cag.knowledge.names import check_corpus_name
from cag.knowledge.setup import SnapshotSetup
from cag.model import facts as model_facts
from cag.model.facts import ModelFacts
from cag.model.loading import LoadedModel, load_model
from cag.model.prompt import Layout, build_prefix, layout_for
from cag.results import Answer, CorpusStatus, IngestResult, Mode, Reporter, StalePolicy
from cag.runtime import describe, knowledge_kv, kv_cache
from cag.runtime.decoder import Decoder
from cag.runtime.generate import DecodeConfig
from cag.runtime.kept_conversations import KeptConversations
from cag.runtime.requests import Request
from cag.runtime.slots import PrefixKV
from cag.store import snapshots as snapfiles
from cag.store.index import Index
from cag.store.sync import shared_store

__all__ = ["Answer", "CorpusStatus", "Engine", "IngestResult", "Mode", "Query", "Reporter", "StalePolicy"]


class Engine:
    def __init__(self, settings: Settings, lm: LoadedModel | None = None, retrieval: Retrieval | None = None):
        """`retrieval`: how `rag` and `cag+rag` find passages (cag.rag.index.retrieve); without one they are refused."""
        self.settings, self.retrieval, self.index = settings, retrieval, Index(settings.index_path)
        self._lm, self._lm_lock = lm, threading.Lock()
        self.on_load = None  # called with None before the model loads, with the seconds it took after (the CLI's line)
        # kept conversations and warmed quotes count in the resident budget (cag.answering.resident), each with a cap
        self.kept = KeptConversations(min(settings.conversation_bytes, settings.resident_bytes))
        self.quotes = KeptConversations(min(settings.quote_bytes, settings.resident_bytes), "quote")
        self.resident = ResidentPool(settings.resident_bytes, [self.kept, self.quotes])
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
        how = knowledge_kv.described(lm, self.settings.prefill_block, kv)
        return ModelFacts(lm.fingerprint, lm.tokenizer_fingerprint, attn, describe.info(lm, kv) | how)

    @property
    def decoder(self) -> Decoder:
        """Where answers are decoded: batched across concurrent requests (cag.runtime.decoder)."""
        lm, chunk = self.lm, self.chunk  # both take _lm_lock: read before holding it
        with self._lm_lock:
            if self._decoder is None or self._decoder.lm is not lm:
                s = self.settings
                for store in (self.kept, self.quotes):  # K/V of another model's (or format's) steps
                    store.clear()
                self._decoder = Decoder(lm, suffix_room(lm), s.max_batch, s.threads, chunk, s.cuda_graphs, self.kept,
                                        -(-self.room // 512) * 512, s.decode_rows, self.quotes)
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

    def prefill(self, n: int) -> str:
        """How `n` knowledge tokens are prefilled here (knowledge_kv.method: as decode rows, or in blocks)."""
        return knowledge_kv.method(self.lm, self.settings.prefill_block, self.kv_dtype, n)

    def layout(self) -> Layout:
        return self._layouts()[1]

    def _layouts(self) -> tuple[LoadedModel, Layout, str]:
        lm = self.lm
        if self._layout is None or self._layout[0] is not lm:  # rendering the chat template: once per model
            layout = layout_for(lm.tokenizer)
            self._layout = (lm, layout, chat.turn_piece(lm.tokenizer, layout))
        return self._layout

    def snapshots(self) -> SnapshotSetup:
        """What keying, building and verifying snapshots read (cag.knowledge.setup): the model loads here."""
        return SnapshotSetup(self.settings, self.index, self.remote, self.lm, self.layout(), self.kv_name,
                             self.prefill, partial(knowledge_kv.compute, self.decoder))

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
            plan = steps.read(self.index, self.remote, self.settings, name, source, ttl_s, shard_tokens, reporter)
            built, est = steps.run(self.snapshots(), plan, force, reporter, self.resident.evict)
        return IngestResult.of(plan, built, est)

    # -- answer ----------------------------------------------------------------------------------
    def answer(self, query: Query, on_text=None, should_stop=None) -> Answer:
        """Answer a Query in any mode, its question checked once: `cag` from the snapshot (a sharded corpus from
        its `shards` best shards), `full` from the whole corpus prefilled again, `rag` from a `full` prompt of
        the retrieved passages, `cag+rag` from the snapshot with the passages quoted before the question.
        `on_text` gets the answer's text as it is decoded; `should_stop` is polled between tokens."""
        if query.mode == Mode.HYBRID.value and query.k is not None and query.k < 1:
            raise BadInput("k must be at least 1")
        q = self.check(query)
        if q.mode is Mode.RAG:
            a = self._answer_rag(q, query, on_text, should_stop)
        elif q.mode is Mode.HYBRID:
            a = self._answer_hybrid(q, query, on_text, should_stop)
        else:
            a = self._answer(q, on_text, should_stop, query.shards)
        return answers.stopped(a, self.lm.tokenizer, query.decoding)

    def check(self, query: Query) -> Question:
        """Everything a query needs before any model work (cag.answering.questions); a refresh ingests again."""
        q = questions.check(query, self.settings, self.index, self.remote, self._layouts, self.stale_reasons)
        if q.refresh:  # the recorded source, never a same-named folder in cwd
            self.ingest(q.row["source"], name=q.corpus)
            q.row, q.reasons, q.refresh = self.index.corpus(q.corpus) or q.row, [], False
        return q

    def _answer(self, q: Question, on_text, should_stop, shards: int = 1) -> Answer:
        """`cag` or `full`, for a checked question."""
        if q.mode is Mode.FULL and len(self.index.shards(q.corpus)) > 1:  # no context holds it all: the routed shard
            rows, (route, *_), routing_ms = across_shards.route(self.index, self.remote, self.lm.tokenizer, q.corpus,
                                                                q.search_text, 1)
            snap = self.index.snapshot(rows[route.shard]["snapshot"])
            assert snap is not None  # a shard row names a snapshot the index holds (published together)
            ids = snapfiles.read_ids(self.remote.ensure_local(snap["digest"], Path(snap["path"])))
            shard = {"shard": route.shard, "score": round(route.score, 4), "n_tokens": len(ids)}
            return self._answer_prompt(q, ids, on_text, should_stop, held=snap, routing_ms=round(routing_ms, 2),
                                       shards=[shard])
        if q.mode is Mode.FULL:
            docs, _ = self.read_corpus(Path(q.row["source"]), q.corpus)
            prefix = build_prefix(self.lm.tokenizer, self.layout(), [(d.name, d.text) for d in docs])
            return self._answer_prompt(q, prefix.ids, on_text, should_stop)
        return self._answer_cached(q, on_text, should_stop, max(1, shards))  # across_shards.route clamps to the count

    def _retrieve(self, q: Question, query: Query, k: int, passage_tokens: int | None):
        """(the corpus's documents, the k best passages for the question, retrieval ms)."""
        if self.retrieval is None:
            raise BadInput(f"mode {q.mode.value!r} needs a retriever: this engine was built without one "
                           "(Engine(settings, retrieval=cag.rag.index.retrieve))")
        docs, _ = self.read_corpus(Path(q.row["source"]), q.corpus)
        t0 = time.perf_counter()
        hits = self.retrieval(docs, q.search_text, k, query.retriever, passage_tokens, self.lm)
        return docs, hits, (time.perf_counter() - t0) * 1e3

    def _answer_rag(self, q: Question, query: Query, on_text, should_stop) -> Answer:
        """`rag`: the `full` prompt of a corpus made only of the top-k passages (cag.answering.retrieval)."""
        k = retrieval.RAG_K if query.k is None else query.k
        if k < 1:
            raise BadInput("k must be at least 1")
        docs, hits, retrieval_ms = self._retrieve(q, query, k, query.passage_tokens)
        ids = retrieval.rag_prefix(self.lm, self.layout(), self.room, docs, hits)
        return self._answer_prompt(q, ids, on_text, should_stop, retrieval_ms=round(retrieval_ms, 2),
                                   passages=retrieval.described(hits))

    def _answer_hybrid(self, q: Question, query: Query, on_text, should_stop) -> Answer:
        """`cag+rag`: the snapshot, and the top-k passages that fit quoted in the last user message, answered as
        that conversation in `cag` (routed by the question, not by its quote)."""
        k = retrieval.HYBRID_K if query.k is None else query.k
        tokens = query.passage_tokens or self.settings.quote_tokens or None
        docs, hits, retrieval_ms = self._retrieve(q, query, k, tokens)
        lm, layout, turn = self._layouts()
        room = retrieval.quote_room(self.index, q, lm.max_context)
        chosen = retrieval.fitting(lm.tokenizer, docs, hits, q.text, room)
        quote = retrieval.in_corpus_order(docs, chosen)
        messages = retrieval.messages_with_quote(query.question, query.messages, q.text, quote)
        quoted = questions.conversation(q, messages, Mode.CAG, lm, layout, turn)
        quoted.routes = quotes.routes(shard_plan.owners(self.index, q.corpus), hits) if query.shards == 1 else None
        a = self._answer(quoted, on_text, should_stop, query.shards)
        return retrieval.quoting(a, hits, chosen, retrieval_ms)

    def warm_quotes(self, corpus: str, retriever: str = "bm25", tick=None, should_stop=None) -> quotes.Warmed:
        """Prefill and keep each passage's cag+rag quote after its shard's snapshot: a question quoting it prefills
        only its own tokens (cag.answering.quotes). `tick(tokens)` after each passage; stops where `should_stop()`."""
        q = self.check(Query(corpus, "warm", mode=Mode.HYBRID.value))
        if not q.row.get("current_snapshot"):
            raise NotFound(f"corpus {corpus!r} has no snapshot: run `cag ingest {corpus}`")
        if not self.decoder.keeps:
            return quotes.Warmed(corpus, reason=quotes.NOT_KEPT)
        every = 1 << 30  # k past the passage count: every passage (a retriever scores them all)
        docs, hits, _ = self._retrieve(q, Query(corpus, retriever=retriever), every, self.settings.quote_tokens or None)
        owner = shard_plan.owners(self.index, corpus)
        todo = quotes.plan(self.index, corpus, q.row["current_snapshot"], owner, docs, hits, self.lm.tokenizer)

        def run(digest: str, ids: list[int]) -> None:
            prefix = self.resident.get(digest, lambda: self._load_resident(digest)).prefix
            self.decoder.run(Request(prefix, ids, DecodeConfig(max_tokens=1), key=digest + quotes.WARM, quote=True))

        size = partial(self.lm.kv_bytes, dtype=self.lm.attn_dtype)
        return quotes.warm(corpus, todo, run, self.quotes.budget_bytes, size, tick, should_stop)

    def _answer_prompt(self, q: Question, prefix_ids: list[int], on_text=None, should_stop=None,
                       held: dict | None = None, **extra) -> Answer:
        """Answer over a prefix prefilled now, with no snapshot (`full`, RAG's passages): ingest's prefill, then `cag`'s
        question and decode path. `full` prefills and holds its K/V as the snapshot `cag` reads was (`held`, else the
        corpus's; stale, still served, it may differ from the settings'): cag == full, bitwise."""
        lm, n = self.lm, len(prefix_ids)
        self.snapshots().require_fit(n, "the prompt's knowledge")
        store = self.kv_dtype
        if q.mode is not Mode.RAG:  # RAG's passages have no snapshot to match
            held = held or (self.index.snapshot(q.row["current_snapshot"]) if q.row.get("current_snapshot") else None)
            store = snapfiles.DTYPES.get(held["dtype"], self.kv_dtype) if held else self.kv_dtype
        how = knowledge_kv.matching(lm, self.settings.prefill_block, store, n, held)
        kv = knowledge_kv.compute(self.decoder, how, store, prefix_ids, should_stop=should_stop)
        views, codes = kv_cache.stored(kv, store)
        prefix = PrefixKV.of(views, lm.attn_dtype, lm.device, codes_read(lm, codes))
        gen, _ = self._generate(prefix, q, on_text, should_stop)
        snapshot = None if q.mode is Mode.RAG else q.row["current_snapshot"]
        return answers.finish(self.index, self.lm, q, gen, n, 0, 0.0, snapshot, **extra)

    def _answer_cached(self, q: Question, on_text, should_stop, shards: int = 1) -> Answer:
        if len(self.index.shards(q.corpus)) > 1:
            best, tried, routing_ms = across_shards.answer(self.index, self.remote, self.lm.tokenizer,
                                                           self._generate_cached, q, shards, on_text, should_stop)
            return answers.finish(self.index, self.lm, q, best.gen, best.n_tokens, best.n_tokens + best.gen.reused,
                                  best.load_ms, best.snapshot, shards=[t.info() | {"chosen": t is best} for t in tried],
                                  routing_ms=round(routing_ms, 2))
        digest = q.row["current_snapshot"]
        if not digest or self.index.snapshot(digest) is None:
            raise NotFound(f"corpus {q.corpus!r} has no snapshot: run `cag ingest {q.corpus}`")
        gen, n, load_ms, _ = self._generate_cached(q, digest, on_text, should_stop)
        return answers.finish(self.index, self.lm, q, gen, n, n + gen.reused, load_ms, digest)

    def _generate_cached(self, q: Question, digest: str, on_text=None, should_stop=None, score: bool = False):
        """Answer over resident snapshot `digest`: (Generated, prefix tokens, load ms, mean
        log-probability of the answer's tokens when `score`)."""
        t0 = time.perf_counter()
        res = self.resident.get(digest, lambda: self._load_resident(digest))
        load_ms = (time.perf_counter() - t0) * 1e3
        key = digest if q.scope is None else f"{digest}/{q.scope}"  # one key's conversations: invisible to another's
        gen, logprob = self._generate(res.prefix, q, on_text, should_stop, score, key, digest + quotes.WARM)
        return gen, res.prefix.n, load_ms, logprob

    def _generate(self, prefix: PrefixKV, q: Question, on_text, should_stop, score: bool = False,
                  key: str | None = None, shared: str | None = None):
        """Decode over `prefix`; `key` (a snapshot digest) keeps the suffix for, and reuses, kept conversations."""
        questions.fit(q, prefix.n, self.lm.max_context, suffix_room(self.lm))
        req = self.decoder.run(Request(prefix, q.suffix, q.decoding, on_text, should_stop, q.t_start, score, key=key,
                                       shared=shared))
        assert req.result is not None  # run returns a finished request, or raises its error
        req.result.reused = req.start
        return req.result, req.mean_logprob()

    def _load_resident(self, digest: str) -> Resident:
        row = self.index.snapshot(digest)
        if row is None:  # gone from the index since it was routed to (a gc, a reindex): as a missing file
            raise NotFound(f"snapshot {digest[:12]} is no longer in the index; `cag ingest` the corpus again")
        return Resident.of(verify.open_snapshot(self.snapshots(), row), self.lm)  # a failure marks it corrupt

    # -- resident snapshots ----------------------------------------------------------------------
    @property
    def stats(self) -> dict:  # resident snapshot, kept conversation and quote counters, and the decoder's once it runs
        return self.resident.stats | self.kept.snapshot() | self.quotes.snapshot() | (self._decoder.snapshot()
                                                                                      if self._decoder else {})

    @property
    def resident_bytes(self) -> int:  # snapshots, kept conversations and quotes, as the resident budget counts them
        return self.resident.nbytes + self.kept.nbytes + self.quotes.nbytes

    def evict(self, digest: str | None = None) -> None:
        self.resident.evict(digest)

    # -- status ----------------------------------------------------------------------------------
    def stale_reasons(self, row: dict, check_model: bool = True) -> list[str]:
        facts = self.facts() if check_model else None
        return freshness.corpus_reasons(self.index, self.remote, self.settings, row, facts)

    def status(self, corpus: str, check_model: bool = True) -> CorpusStatus:
        return freshness.status(self.index, self.remote, self.settings, corpus, self.facts() if check_model else None)

    def list(self, check_model: bool = True) -> list[CorpusStatus]:
        return [self.status(r["name"], check_model) for r in self.index.corpora()]
