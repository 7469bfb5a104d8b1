"""Background refresh jobs: `engine.ingest` of a known corpus in a thread, progress recorded.

One active job per corpus: asking again while one runs returns that job. Finished jobs are kept
(the most recent `keep`) so clients can read their result.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

from cag.engine import Engine, Reporter
from cag.errors import CagError, NotFound

from .errors import status_of

log = logging.getLogger("cag.api")


@dataclass
class Job:
    id: str
    corpus: str
    status: str = "queued"  # queued | running | done | failed
    created: float = 0.0
    started: float | None = None
    finished: float | None = None
    total_tokens: int = 0
    done_tokens: int = 0
    reused_tokens: int = 0
    estimate_bytes: int = 0
    prefill_started: float | None = None
    result: dict | None = None
    error: dict | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        started = d.pop("prefill_started")
        d.pop("estimate_bytes")
        d["kind"] = "refresh"
        d["progress"] = 1.0 if self.status == "done" else (
            round(self.done_tokens / self.total_tokens, 4) if self.total_tokens else 0.0)
        rate = None
        if started and self.done_tokens:
            rate = self.done_tokens / max(1e-6, (self.finished or time.time()) - started)
        d["tokens_per_s"] = round(rate, 1) if rate else None
        d["eta_s"] = (round((self.total_tokens - self.done_tokens) / rate, 1)
                      if rate and self.status == "running" else None)
        return d


class JobReporter(Reporter):
    """Records ingest progress on the job (read by GET /v1/jobs/{id})."""

    def __init__(self, job: Job):
        self.job = job

    def estimate(self, n_tokens: int, n_bytes: int, reused: int) -> None:
        self.job.reused_tokens, self.job.estimate_bytes = reused, n_bytes
        self.job.total_tokens = n_tokens - reused

    def progress(self, total: int):
        self.job.total_tokens, self.job.done_tokens = total, 0
        self.job.prefill_started = time.time()

        def tick(n: int) -> None:
            self.job.done_tokens += n

        return tick


class Jobs:
    def __init__(self, engine: Engine, on_finish=lambda job: None, keep: int = 100):
        self.engine = engine
        self.on_finish = on_finish
        self.keep = keep
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._lock = threading.Lock()

    def refresh(self, corpus: str, force: bool = False) -> tuple[Job, bool]:
        """Start (or join) the refresh of a known corpus; returns (job, started_now)."""
        row = self.engine.index.corpus(corpus)
        if row is None:
            raise NotFound(f"unknown corpus {corpus!r}; GET /v1/corpora lists the known ones")
        with self._lock:
            for job in self._jobs.values():
                if job.corpus == corpus and job.status in ("queued", "running"):
                    return job, False
            job = Job(id="job_" + secrets.token_hex(8), corpus=corpus, created=time.time())
            self._jobs[job.id] = job
            while len(self._jobs) > self.keep:
                oldest = next((k for k, j in self._jobs.items() if j.status in ("done", "failed")), None)
                if oldest is None:
                    break
                del self._jobs[oldest]
        # the recorded source, not the name: a folder in the server's cwd that happens to carry the
        # corpus's name must not be ingested in its place
        threading.Thread(target=self._run, args=(job, row["source"], force), daemon=True,
                         name=f"cag-refresh-{job.id}").start()
        return job, True

    def _run(self, job: Job, source: str, force: bool) -> None:
        job.status, job.started = "running", time.time()
        try:
            r = self.engine.ingest(source, name=job.corpus, force=force, reporter=JobReporter(job))
            job.result = r.to_dict()
            job.status = "done"
        except CagError as e:
            job.error = {"message": str(e), "code": e.code, "status": status_of(e)}
            job.status = "failed"
        except Exception as e:  # noqa: BLE001 - recorded on the job, logged with its traceback
            log.exception("refresh job %s failed", job.id)
            job.error = {"message": f"internal error: {type(e).__name__}", "code": "internal_error", "status": 500}
            job.status = "failed"
        finally:
            job.finished = time.time()
            self.on_finish(job)

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"unknown job {job_id!r}")
        return job
