"""A real `cag serve` process on a free loopback port, for the tests and the API benchmark.

Standard library and httpx only: `serving(env, log)` starts `python -m cag serve` with the given
environment, polls `GET /health` until it answers 200 (failing fast if the process dies), yields a
`Served` (url, process, log path, seconds to ready) and stops the process afterwards.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


def cag_command() -> list[str]:
    """`cag` through the running interpreter: the same installation as the caller, PATH or not."""
    return [sys.executable, "-m", "cag"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 90.0,
                 poll_s: float = 0.05) -> list[int]:
    """Poll GET /health until 200; returns the statuses seen. Raises RuntimeError if `proc` exits
    first, TimeoutError past `timeout_s`."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            seen.append(r.status_code)
            if r.status_code == 200:
                return seen
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{url}/health not 200 after {timeout_s} s (saw {seen[-5:]})")


@dataclass
class Served:
    url: str
    proc: subprocess.Popen
    log: Path
    ready_s: float  # from starting the process to the first 200 from /health


def stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM (uvicorn shuts down gracefully), SIGKILL if it is still there after `grace_s`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def serving(env: dict, log: Path, timeout_s: float = 90.0, cwd: Path | None = None,
            args: tuple[str, ...] = ("--log-level", "warning")) -> Iterator[Served]:
    """`cag serve --port <free port> *args` under `env`, output in `log`; healthy when yielded,
    stopped on exit. The last lines of the log are printed when the server did not exit cleanly."""
    port = free_port()
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([*cag_command(), "serve", "--port", str(port), *args], env=env, cwd=cwd,
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=timeout_s)
        yield Served(url, proc, Path(log), time.perf_counter() - t0)
    finally:
        stop(proc)
        if proc.returncode not in (0, -15):
            print(Path(log).read_text()[-4000:], file=sys.stderr)
