"""`cag serve --replicas N`: the same HTTP app as an ingress on Ray Serve, answers on engine replicas.

Two deployments in one Serve application ("cag"):

* `Ingress` (one replica, no CPU reserved): the FastAPI app of plain `cag serve`, unchanged: auth,
  body and question limits, parsing, SSE, 429 admission, timeouts, corpora, refresh jobs. OpenAI
  clients name the corpus in the body (`model`), not in Serve's routing header, so the ingress reads
  it and calls the engine replicas through a deployment handle with the corpus as the multiplexed
  model id. Its `answers` (api/answers.py) are `RemoteAnswers`, so the routes do not change.
* `CorpusReplica` (N replicas, or autoscaled): api/replicas.py, one Engine each over the shared store.

/health is 200 when the ingress has loaded its model and at least one engine replica answered the
last poll (`replicas` in the body). /metrics is the ingress's own registry (HTTP, tokens, ingress
queue) plus `cag_replica_*` series labelled by replica, read from every replica by a broadcast call
at scrape time, so one scrape of the ingress covers the replicas.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from cag.config import Settings

from .answers import AskCall
from .errors import NotReady
from .replica_settings import ReplicaSettings
from .replicas import CorpusReplica
from .runner import Work
from .settings import ApiSettings

log = logging.getLogger("cag.api")

APP = "cag"
REPLICA_LOST = (RayActorError, ReplicaUnavailableError)  # the replica died or left while answering
POLL_S = 2.0  # replica stats for /health; /metrics asks afresh at each scrape


def per_replica(api: ApiSettings) -> int:
    """Serve's max_ongoing_requests of an engine replica: its workers plus one waiting request each, so
    a replica never idles between two answers; beyond that the router waits for a replica holding the
    corpus (CAG_SPILL_AFTER_S) and then spills to another, which makes the corpus resident too."""
    return 2 * api.workers


class RemoteAnswers:
    """Answers computed on engine replicas. The runner's threads wait on the replica's stream, so
    limits, timeouts and cancel-on-disconnect are the runner's, as for local answers."""

    def __init__(self, handle: DeploymentHandle):
        self.handle = handle
        self.last: list[dict] = []
        self.last_at = 0.0
        threading.Thread(target=self._poll_forever, name="cag-replica-poll", daemon=True).start()

    def work(self, call: AskCall) -> Work:
        return lambda on_text, should_stop: self._ask(call, on_text, should_stop)

    def _ask(self, call: AskCall, on_text, should_stop):
        """One question on a replica holding its corpus. A replica lost before any text reached the
        client is retried once on another (answers are deterministic for a given request); a stream
        that already sent text ends with a 503 error event instead."""
        for attempt in (1, 2):
            sent = False
            replica = self.handle.options(multiplexed_model_id=call.corpus, stream=True)
            stream = cast(DeploymentResponseGenerator, replica.ask.remote(call))  # stream=True: (kind, value) items
            try:
                for kind, value in stream:
                    if should_stop():  # checked at each token: the replica stops at its next one
                        stream.cancel()
                        return None
                    if kind == "error":
                        raise value
                    if kind == "answer":
                        return value
                    if call.stream:
                        on_text(value)
                        sent = True
            except REPLICA_LOST as e:
                if sent or attempt == 2:
                    raise NotReady("the engine replica answering this request stopped; retry it") from e
                log.warning("engine replica lost before answering (%s); asking another", type(e).__name__)
        return None  # not reached

    # -- replica stats ---------------------------------------------------------------------------
    def poll(self, timeout_s: float = 5.0) -> list[dict]:
        """Every live replica's stats (a replica that does not answer in time is left out)."""
        try:
            got = self.handle.broadcast("stats").results(timeout_s=timeout_s, return_exceptions=True)
        except Exception as e:  # noqa: BLE001 - no replica reachable (yet): report none
            log.debug("replica stats: %s", e)
            got = []
        self.last, self.last_at = [s for s in got if isinstance(s, dict)], time.monotonic()
        return self.last

    def _poll_forever(self) -> None:
        while True:
            self.poll()
            time.sleep(POLL_S)

    def health(self) -> dict:
        fresh = time.monotonic() - self.last_at < 5 * POLL_S
        return {"replicas": len(self.last) if fresh else 0}


class ReplicaCollector:
    """`cag_replica_*` metric families, labelled by replica (and corpus), read at scrape time."""

    def __init__(self, answers: RemoteAnswers):
        self.answers = answers

    def collect(self):
        stats = self.answers.poll()

        def family(kind, name: str, doc: str, labels: tuple[str, ...], rows):
            f = kind(name, doc, labels=list(labels))
            for values, value in rows:
                f.add_metric(list(values), value)
            return f

        yield GaugeMetricFamily("cag_replicas", "Engine replicas that answered this scrape.", value=len(stats))
        per = [(s["replica"], s) for s in stats]
        yield family(GaugeMetricFamily, "cag_replica_info", "One per engine replica: its Ray actor name.",
                     ("replica", "actor"), [((r, s["actor"]), 1) for r, s in per])
        yield family(CounterMetricFamily, "cag_replica_corpus_loads", "Times a corpus was made resident on a replica "
                     "(Serve multiplexing misses).", ("replica", "corpus"),
                     [((r, c), n) for r, s in per for c, n in s["loads"].items()])
        yield family(CounterMetricFamily, "cag_replica_answers", "Answers computed on a replica, by corpus.",
                     ("replica", "corpus"), [((r, c), n) for r, s in per for c, n in s["answers"].items()])
        yield family(GaugeMetricFamily, "cag_replica_corpus_resident", "1 while a corpus is resident on a replica.",
                     ("replica", "corpus"), [((r, c), 1) for r, s in per for c in s["resident"]])
        for key, kind, doc in (
            ("snapshot_hits", CounterMetricFamily, "Questions served from a resident snapshot."),
            ("snapshot_loads", CounterMetricFamily, "Snapshot files loaded (resident cache misses)."),
            ("resident_bytes", GaugeMetricFamily, "Bytes held by resident snapshots."),
            ("running", GaugeMetricFamily, "Generations running on the replica."),
            ("waiting", GaugeMetricFamily, "Generations waiting for a worker on the replica."),
        ):
            name = {"running": "generations_running", "waiting": "generations_waiting"}.get(key, key)
            yield family(kind, f"cag_replica_{name}", doc, ("replica",), [((r,), s[key]) for r, s in per])


class Ingress:
    """The FastAPI app, built in the ingress replica (Serve calls __serve_build_asgi_app__ after the
    constructor), with answers sent to the engine replicas."""

    def __init__(self, replicas: DeploymentHandle, api_settings: ApiSettings, cag_settings: Settings, threads: int):
        self.replicas, self.api_settings, self.cag_settings, self.threads = (
            replicas,
            api_settings,
            cag_settings,
            threads,
        )

    def __serve_build_asgi_app__(self):
        from .app import create_app

        # the ingress's runner threads only wait on replica streams: one per request a replica may hold
        app = create_app(self.api_settings.model_copy(update={"workers": self.threads}), self.cag_settings)
        service = app.state.service
        service.answers = RemoteAnswers(self.replicas)
        service.metrics.registry.register(ReplicaCollector(service.answers))
        return app


def forwarded_env() -> dict[str, str]:
    """Variables the replicas need that the settings objects do not carry: the S3 store's (botocore
    reads them) and the Hugging Face hub's. Ray's runtime env carries them to every node."""
    return {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "HF_"))}


def application(api: ApiSettings, cag: Settings, rs: ReplicaSettings):
    """The Serve application: settings resolved here (flags, environment) travel to every replica as
    they are, so each one runs exactly the configuration the command validated."""
    env = {"env_vars": forwarded_env()}
    scale = {"autoscaling_config": rs.autoscaling} if rs.autoscaling else {"num_replicas": rs.replicas}
    # no access log line per call: the ingress polls every replica's stats every POLL_S
    # questions wait for a replica holding their corpus up to spill_after_s (api/ray_router.py)
    router = RequestRouterConfig(request_router_class="cag.api.ray_router.CorpusRouter",  # type: ignore[arg-type]  # Ray types **kwargs as dicts
                                 request_router_kwargs={"spill_after_s": rs.spill_after_s})
    engine = serve.deployment(name="CorpusReplica", max_ongoing_requests=per_replica(api), **scale,
                              request_router_config=router,
                              logging_config={"enable_access_log": False},
                              ray_actor_options={"num_cpus": rs.cpus_per_replica, "num_gpus": rs.gpus_per_replica,
                                                 "runtime_env": env})(CorpusReplica)
    threads = rs.most_replicas * per_replica(api)
    # the ingress queues nothing itself beyond its runner (429 past it); headroom for /health, /metrics, listings
    ingress = serve.deployment(name="Ingress", num_replicas=1, max_ongoing_requests=threads + api.max_queue + 32,
                               ray_actor_options={"num_cpus": 0, "runtime_env": env})(serve.ingress()(Ingress))
    torch_threads = max(1, int(rs.cpus_per_replica))  # process-wide: the replica's decode thread uses its cores
    return ingress.bind(engine.bind(cag, api, rs.corpora_per_replica, torch_threads), api, cag, threads)
