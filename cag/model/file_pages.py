"""Weights that are views of their checkpoint file: dropping their pages from this process's resident
memory once packed copies are made from them, and refusing to read them after the file changed.

Loading a safetensors checkpoint in its own dtype, transformers maps the file (private, copy on write)
and hands out views of it: nothing is read until a weight is touched. A packed format's decode copy
(cag.model.weights) is made from the model's own weights, which then serve the knowledge prefill
alone. Touched once by the packing, they would stay resident beside the copy; `release` drops those
pages (madvise MADV_DONTNEED on a mapping no page of which was ever written), and the kernel reads them
again from its page cache, or from the file, when a prefill needs them: the same bytes, so the same
bits. Clean file pages are what the kernel reclaims first under memory pressure anyway; released, they
no longer count in the process's resident set.

A mapped file rewritten in place would hand a prefill other weights than the fingerprint was made
from (a snapshot poisoned under the old key). `watch` keeps a descriptor on each mapped file, and
`check` (before every prefill) refuses with one line once a file's size or modification time moved.
A file replaced by a rename leaves the mapped one as it was: nothing to refuse.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cag.errors import ModelChanged

MADV_DONTNEED = 4  # Linux's value on every architecture
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
ATTR = "cag_weight_files"  # on a loaded model: [(path, descriptor, (size, mtime_ns))] of the files its weights map
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ (\d+)\s*(.*)$")


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    path: str
    inode: int
    clean: bool  # no page of it ever copied on write: every page is the file's


def mappings() -> list[Mapping]:
    """This process's private mappings of regular files (/proc/self/smaps); [] off Linux."""
    if platform.system() != "Linux":
        return []
    out: list[list[Any]] = []  # start, end, path, inode, clean
    cur: list[Any] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if m := _HEADER.match(line):
            start, end, perms, inode, path = m.groups()
            cur = (
                [int(start, 16), int(end, 16), path, int(inode), True]
                if path.startswith("/") and int(inode) and "p" in perms
                else None
            )
            if cur is not None:
                out.append(cur)
        elif cur is not None and line.startswith("Anonymous:") and int(line.split()[1]) > 0:
            cur[4] = False
    return [Mapping(*m) for m in out]


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The address range of a contiguous CPU tensor's own bytes, else None."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return None
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _holder(t: torch.Tensor, maps: list[Mapping]) -> Mapping | None:
    span = _span(t)
    return None if span is None else next((m for m in maps if m.start <= span[0] and span[1] <= m.end), None)


def file_backed(t: torch.Tensor, maps: list[Mapping] | None = None) -> bool:
    """Whether `t`'s bytes are a view of a mapped file, untouched by writes."""
    m = _holder(t, mappings() if maps is None else maps)
    return m is not None and m.clean


def release(tensors, maps: list[Mapping] | None = None) -> int:
    """Drop the pages of those `tensors` that view a clean file mapping from the resident set (whole
    pages inside each tensor: a page it shares with a neighbour stays). `maps`: `mappings()` read
    once for many calls (reading it costs tens of ms). Returns the bytes released."""
    maps = mappings() if maps is None else maps
    if not maps:
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done = 0
    for t in tensors:
        m = _holder(t, maps)
        span = _span(t)
        if m is None or not m.clean or span is None:  # never on anonymous memory (DONTNEED zeroes it) or a written page
            continue  # (span is None only where m is: _holder found none)
        a, b = span
        a, b = -(-a // PAGE) * PAGE, b // PAGE * PAGE
        if b > a and madvise(a, b - a, MADV_DONTNEED) == 0:
            done += b - a
    return done


def watch(model: torch.nn.Module) -> None:
    """Remember (an open descriptor, its size and modification time) each file the model's weights map."""
    maps = mappings()
    files = {m.path: m.inode for t in model.state_dict().values() if (m := _holder(t, maps)) is not None}
    held = []
    for path, inode in sorted(files.items()):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        st = os.fstat(fd)
        if st.st_ino != inode:  # the path names another file already: the mapped one cannot change
            os.close(fd)
            continue
        held.append((path, fd, (st.st_size, st.st_mtime_ns)))
        weakref.finalize(model, os.close, fd)
    setattr(model, ATTR, held)


def check(model: torch.nn.Module) -> None:
    """Raise ModelChanged (one line) when a file the model's weights map changed since `watch`."""
    for path, fd, seen in getattr(model, ATTR, ()):
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns) != seen:
            raise ModelChanged(
                f"the model's weights file {path} changed on disk after it was loaded; restart cag to load it again"
            )
