"""Releasing a waiting thread's OpenMP workers, so that the decode thread keeps the CPU to itself.

torch's CPU kernels (and cag's) run on OpenMP, which gives every thread that calls them a pool of
workers of its own. Once more workers exist than there are CPUs, libgomp stops letting idle
workers spin and every parallel region has to wake its workers from the kernel: a decode step runs
~150 small regions, and on a 2-core machine a thread that had once prefilled (the CLI's main
thread, an API worker) halved the decode thread's speed while it merely waited (bench_decode's step
against the served rate). A thread about to wait for the decode thread gives its pool back (OpenMP
5.0's `omp_pause_resource_all`); its next parallel region builds a new one, which costs little.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

_lock = threading.Lock()
_fn: list = []  # [the runtime's omp_pause_resource_all, or None where there is none]
OMP_PAUSE_SOFT = 1


def _find():
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing to release
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if any(name in Path(path).name for name in ("libgomp", "libiomp", "libomp")):
            try:
                return ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
    return None


def release() -> bool:
    """Give back the calling thread's OpenMP workers, if it has any. True if a runtime took it."""
    with _lock:
        if not _fn:
            _fn.append(_find())
    return _fn[0] is not None and _fn[0](OMP_PAUSE_SOFT) == 0
