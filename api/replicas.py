"""An engine replica on Ray Serve: one Engine over the shared store, corpora resident by multiplexing.

Serve's model multiplexing maps one to one onto corpora: the ingress calls `ask` with the corpus as
the multiplexed model id, Serve routes it to a replica that already holds that corpus (or, when none
does or those are full, to the one holding the fewest), and `_corpus` below, wrapped by
`serve.multiplexed`, makes the corpus's snapshots resident on a miss. Beyond CAG_CORPORA_PER_REPLICA
corpora the least recently asked one is dropped (its snapshots leave the resident pool). The
engine's own resident LRU (CAG_RESIDENT_BYTES) still bounds the bytes.

Answers run on this replica's `Runner` (the same bounded thread pool as plain `cag serve`) and come
back as a stream of ("text", piece) ... ("answer", Answer), or one ("error", CagError): engine
errors travel as values so the ingress answers them with their own HTTP status.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from dataclasses import replace

from ray import serve

from cag.config import Settings
from cag.engine import Answer, Engine
from cag.errors import CagError
from cag.rag.index import retrieve
from cag.store.sync import known_corpus

from .answers import AskCall
from .runner import Runner
from .settings import ApiSettings

log = logging.getLogger("cag.api")


def make_resident(engine: Engine, digest: str) -> None:
    """Load and verify snapshot `digest` into the engine's resident pool (a hit costs nothing)."""
    engine.resident.get(digest, lambda: engine._load_resident(digest))  # the loader Engine itself hands the pool


def corpus_snapshots(engine: Engine, corpus: str) -> list[str]:
    """The snapshots a question on `corpus` reads now (one per shard), after the store's ref lookup."""
    row = known_corpus(engine.index, engine.remote, corpus)
    shards = [s["snapshot"] for s in engine.index.shards(corpus) if s.get("snapshot")]
    return shards or [d for d in [row.get("current_snapshot")] if d]


class ResidentCorpus:
    """What the multiplexer holds per corpus; Serve calls __del__ when it drops the corpus."""

    def __init__(self, replica: CorpusReplica, corpus: str, digests: list[str]):
        self.replica, self.corpus, self.digests = replica, corpus, set(digests)
        self.dropped = False

    def __del__(self):  # called by Serve on eviction, and once more by the garbage collector: only the first counts
        if not self.dropped:
            self.dropped = True
            self.replica._dropped(self)


class CorpusReplica:
    """The deployment class (cag.api.ray_app deploys it). Its constructor loads the model, so Serve
    routes to a replica only once it can answer."""

    def __init__(self, cag_settings: Settings, api_settings: ApiSettings, corpora_per_replica: int, threads: int):
        self.engine = Engine(cag_settings, retrieval=retrieve)
        self.engine.lm  # noqa: B018 - load the model now (seconds), before Serve calls the replica ready
        self.engine.layout()
        # one queued request per worker at most: Serve's max_ongoing_requests is 2 x workers
        self.runner = Runner(api_settings.workers, api_settings.workers, api_settings.request_timeout_s,
                             torch_threads=cag_settings.threads or threads)
        self.loads: Counter[str] = Counter()  # corpus -> times made resident here
        self.answers: Counter[str] = Counter()  # corpus -> questions answered here
        self.resident: dict[str, ResidentCorpus] = {}
        self._lock = threading.RLock()  # a garbage-collector __del__ may run while this thread holds it
        # Serve's LRU of "models" per replica: the bound comes from a setting, so the loader is wrapped here
        # (Serve detects multiplexing wired in the constructor as well as on the class). A plain function,
        # not the bound method: Serve keeps its per-replica cache as an attribute of what it wraps.
        async def load(corpus: str) -> ResidentCorpus:
            return await self._load_corpus(corpus)

        self._corpus = serve.multiplexed(max_num_models_per_replica=corpora_per_replica)(load)

    async def _load_corpus(self, corpus: str) -> ResidentCorpus:
        digests = await asyncio.to_thread(self._make_resident, corpus)
        with self._lock:
            self.loads[corpus] += 1
            held = self.resident[corpus] = ResidentCorpus(self, corpus, digests)
        log.info("corpus %s resident (%d snapshot(s))", corpus, len(digests))
        return held

    def _make_resident(self, corpus: str) -> list[str]:
        digests = corpus_snapshots(self.engine, corpus)
        for digest in digests:
            make_resident(self.engine, digest)
        return digests

    def _dropped(self, held: ResidentCorpus) -> None:
        with self._lock:
            if self.resident.get(held.corpus) is held:
                del self.resident[held.corpus]
            kept = {d for other in self.resident.values() for d in other.digests}  # identical corpora share a file
        for digest in held.digests - kept:
            self.engine.evict(digest)
        log.info("corpus %s dropped", held.corpus)

    async def ask(self, call: AskCall):
        """Stream the answer: text pieces (always, so the ingress can stop it at the next token), then
        the Answer; an engine error is one ("error", e) item."""
        gen = None
        try:
            corpus = serve.get_multiplexed_model_id() or call.corpus
            # an unknown corpus never reaches the multiplexer: Serve would keep it as "loading" in this replica's
            # routing entry (it re-reports only on the next load), which skews where new corpora go
            await asyncio.to_thread(corpus_snapshots, self.engine, corpus)
            held = await self._corpus(corpus)
            gen = self.runner.start(lambda on_text, should_stop: replace(call, stream=True).run(self.engine, on_text,
                                                                                                 should_stop))
            while True:
                kind, value = await gen.next()
                if kind == "answer":
                    assert isinstance(value, Answer)
                    with self._lock:
                        self.answers[call.corpus] += 1
                    held.digests.update(d for d in [value.snapshot, *(s.get("snapshot") for s in value.shards)] if d)
                yield kind, value
                if kind == "answer":
                    return
        except CagError as e:
            yield "error", e
        finally:  # finished, failed, or cancelled by the ingress: stop at the next token
            if gen is not None:
                gen.close()

    def stats(self) -> dict:
        """This replica's counters, for the ingress's /metrics and /health (a broadcast call)."""
        ctx = serve.get_replica_context()
        engine = self.engine
        with self._lock:
            return {"replica": ctx.replica_id.unique_id, "actor": ctx.replica_id.to_full_id_str(),
                    "resident": sorted(self.resident), "loads": dict(self.loads), "answers": dict(self.answers),
                    "snapshot_hits": engine.stats.get("snapshot_hits", 0),
                    "snapshot_loads": engine.stats.get("snapshot_loads", 0), "resident_bytes": engine.resident_bytes,
                    "running": self.runner.running, "waiting": self.runner.waiting}
