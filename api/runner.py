"""Bounded, cancellable model work for async routes.

The event loop never runs the model. A request becomes a `Generation`: `engine.answer` runs on a
small dedicated thread pool (`workers` threads) and hands text pieces and the final Answer back
through an asyncio queue. At most `workers + max_queue` generations are admitted at once; one
more is refused at once with 429 and a Retry-After estimate. A generation stops at its next token
when the client disconnects or its deadline passes (`should_stop`), and one still waiting for a
worker never starts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from starlette.requests import Request

from .errors import NotReady, QueueFull, Timeout

log = logging.getLogger("cag.api")

Work = Callable[[Callable[[str], None], Callable[[], bool]], object]  # (on_text, should_stop) -> Answer


def _set_threads(n: int) -> None:
    """torch's intra-op thread count is process-wide (the last torch.set_num_threads from any thread
    wins): set once, for the engine's decode thread (cag.runtime.decoder) that does every request's model work."""
    if n > 0:
        import torch

        torch.set_num_threads(n)


class ClientGone(Exception):
    """The client disconnected; nobody is left to answer."""


class Generation:
    def __init__(self, runner: Runner, work: Work, timeout_s: float):
        self.runner = runner
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + timeout_s
        self.timeout_s = timeout_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stop = threading.Event()
        self.stop_reason: str | None = None
        self.finished = False  # the request's task has seen the answer or the error
        self.worker_done = False  # the worker returned (set in its thread)
        self._work = work
        self._getter: asyncio.Task | None = None
        self.started_at: float | None = None

    # -- worker thread side ----------------------------------------------------------------------
    def _put(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.stop.set()

    def run(self) -> None:
        if self.stop.is_set():  # gave up while waiting for a worker: do not start
            self._put("error", Timeout("request timed out while queued") if self.stop_reason == "timeout"
                      else ClientGone())
            return
        self.started_at = time.perf_counter()
        with self.runner._count:
            self.runner.running += 1
        try:
            answer = self._work(lambda piece: self._put("text", piece), self.stop.is_set)
            self._put("answer", answer)
        except BaseException as e:  # handed to the request's task, raised there
            self._put("error", e)
        finally:
            self.worker_done = True
            with self.runner._count:
                self.runner.running -= 1

    # -- event loop side -------------------------------------------------------------------------
    def cancel(self, reason: str) -> None:
        """Ask the worker to stop at its next token (no-op once it finished)."""
        if self.finished or self.worker_done or self.stop.is_set():
            return
        self.stop_reason = reason
        self.stop.set()
        self.runner.on_stop(reason)

    async def next(self, request: Request | None = None, poll_s: float = 0.1) -> tuple[str, object]:
        """The next event: ("text", str) or ("answer", Answer). Raises the engine's error, Timeout
        past the deadline, ClientGone when `request` is given and its client disconnected."""
        while True:
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.queue.get())
            remaining = self.deadline - self.loop.time()
            if remaining <= 0:
                self.cancel("timeout")
                raise Timeout(f"request took longer than {self.timeout_s:g} s (CAG_REQUEST_TIMEOUT_S)")
            done, _ = await asyncio.wait({self._getter}, timeout=min(poll_s, remaining))
            if done:
                kind, value = self._getter.result()
                self._getter = None
                if kind == "error":
                    self.finished = True
                    raise value
                if kind == "answer":
                    self.finished = True
                return kind, value
            if request is not None and await request.is_disconnected():
                self.cancel("disconnect")
                raise ClientGone()

    async def result(self, request: Request | None = None):
        while True:
            kind, value = await self.next(request)
            if kind == "answer":
                return value

    def close(self) -> None:
        """The response is over (sent, failed or the client left): stop whatever still runs."""
        if self._getter is not None:
            self._getter.cancel()
        if not self.finished:
            self.cancel("disconnect")


class Runner:
    def __init__(self, workers: int, max_queue: int, timeout_s: float, on_stop: Callable[[str], None] = lambda r: None,
                 torch_threads: int = 0):
        self.workers = max(1, workers)
        self.capacity = self.workers + max(0, max_queue)
        self.timeout_s = timeout_s
        self.on_stop = on_stop
        _set_threads(torch_threads)
        self.pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="cag-gen")
        self.active = 0  # admitted, not yet finished (running or waiting); touched on the event loop only
        self.running = 0  # inside the engine right now; touched by worker threads
        self._count = threading.Lock()
        self.avg_s = 2.0  # moving average of a generation's duration, for Retry-After
        self.closed = False
        self._live: set[Generation] = set()  # admitted, not finished; event loop only

    @property
    def waiting(self) -> int:
        return max(0, self.active - self.running)

    def retry_after(self) -> int:
        ahead = self.active - self.workers + 1
        return max(1, math.ceil(self.avg_s * ahead / self.workers))

    def start(self, work: Work) -> Generation:
        if self.closed:
            raise NotReady("server is shutting down")
        if self.active >= self.capacity:
            raise QueueFull(f"server busy: {self.active} requests running or queued (CAG_WORKERS + CAG_MAX_QUEUE "
                            f"= {self.capacity}); retry later", retry_after=self.retry_after())
        gen = Generation(self, work, self.timeout_s)
        self.active += 1
        self._live.add(gen)
        loop = gen.loop

        def finished(fut) -> None:
            if fut.cancelled():  # the pool shut down before a worker took it
                gen._put("error", NotReady("server is shutting down"))
            try:
                loop.call_soon_threadsafe(self._finished, gen)
            except RuntimeError:
                pass

        self.pool.submit(gen.run).add_done_callback(finished)
        return gen

    def _finished(self, gen: Generation) -> None:
        self.active -= 1
        self._live.discard(gen)
        if gen.started_at is not None:
            self.avg_s = 0.8 * self.avg_s + 0.2 * (time.perf_counter() - gen.started_at)

    def shutdown(self) -> None:
        """Refuse new work, drop what waits, stop what runs at its next token."""
        self.closed = True
        for gen in list(self._live):
            gen.cancel("shutdown")
        self.pool.shutdown(wait=False, cancel_futures=True)
