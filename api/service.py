"""What one app holds: the engine, readiness, the generation runner, refresh jobs and metrics."""

from __future__ import annotations

import logging
import threading

from cag.engine import Engine
from cag.errors import TooLarge
from cag.results import human_bytes

from .answers import LocalAnswers
from .errors import NotReady
from .jobs import Jobs
from .metrics import Metrics
from .runner import Runner
from .settings import ApiSettings

log = logging.getLogger("cag.api")


class Service:
    def __init__(self, settings: ApiSettings, engine: Engine):
        self.settings = settings
        self.engine = engine
        self.ready = False
        self.load_error: str | None = None
        # the collector reads these at scrape time; the runner is created just below
        self.metrics = Metrics(engine, running=lambda: self.runner.running, waiting=lambda: self.runner.waiting,
                               ready=lambda: self.ready)
        self.runner = Runner(settings.workers, settings.max_queue, settings.request_timeout_s,
                             on_stop=lambda reason: self.metrics.stopped.labels(reason).inc(),
                             torch_threads=engine.settings.threads)  # 0: torch's default, every core
        self.jobs = Jobs(engine, on_finish=self._refreshed)
        self._closing = threading.Event()  # ends warming (CAG_WARM_QUOTES) between passages
        # where answers are computed: this engine, or engine replicas on Ray Serve (api/ray_app.py swaps it)
        self.answers = LocalAnswers(engine)

    # -- lifecycle -------------------------------------------------------------------------------
    def load(self) -> None:
        """Load the model (seconds); runs in a thread while /health answers 503."""
        try:
            lm = self.engine.lm
            self.engine.layout()
            self.ready = True
            log.info("model %s loaded; serving", lm.name)
        except Exception as e:  # noqa: BLE001 - reported by /health and every route
            self.load_error = str(e) or type(e).__name__
            log.error("model failed to load: %s", self.load_error)
            return
        self.warm([r["name"] for r in self.engine.index.corpora()])

    def warm(self, corpora: list[str]) -> None:
        """CAG_WARM_QUOTES: each corpus's cag+rag quotes prefilled and kept (Engine.warm_quotes), in a thread of its
        own while questions are served; logged, never fatal."""
        if not self.engine.settings.warm_quotes or not corpora or not isinstance(self.answers, LocalAnswers):
            return  # (replicas on Ray Serve answer from engines of their own)

        def run() -> None:
            for name in corpora:
                try:
                    w = self.engine.warm_quotes(name, should_stop=self._closing.is_set)
                except Exception as e:  # noqa: BLE001 - a corpus that cannot be warmed is answered cold
                    log.warning("quotes of %s not warmed: %s", name, e)
                    continue
                log.info("warmed %d quotes of %s (%d tokens, %s) in %.1f s%s", w.passages, name, w.tokens,
                         human_bytes(w.kept_bytes), w.seconds, f"; {w.reason}" if w.reason else "")

        threading.Thread(target=run, name="cag-warm-quotes", daemon=True).start()

    def _refreshed(self, job) -> None:
        self.metrics.jobs.labels(job.status).inc()
        if job.status == "done":  # its new snapshots' quotes
            self.warm([job.corpus])

    def close(self) -> None:
        self._closing.set()
        self.runner.shutdown()

    @property
    def model_name(self) -> str | None:
        return self.engine.lm.name if self.ready else None  # never triggers a load

    # -- checks ----------------------------------------------------------------------------------
    def require_ready(self) -> None:
        if self.load_error:  # the reason (paths, hub errors) is in the server's log, not for clients
            raise NotReady("the model failed to load; see the server log")
        if not self.ready:
            raise NotReady("model is loading; retry when GET /health answers 200")

    def check_question(self, question: str, mode: str) -> None:
        if len(question) > self.settings.max_question_chars:
            raise TooLarge(f"question is {len(question)} characters; the limit is "
                           f"{self.settings.max_question_chars} (CAG_MAX_QUESTION_CHARS)")

    def effective_max_tokens(self, requested: int | None) -> int:
        s = self.engine.settings
        return min(s.max_tokens if requested is None else requested, s.answer_room)
