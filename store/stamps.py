"""Checks a file passed in this process, remembered while the file stays as it was checked.

A file's stamp is (device, inode, size, mtime_ns, ctime_ns). Every write moves its ctime, which no
call can set back, so a file with the stamp it had when a check read it holds the bytes that were
checked. File times are coarse (a clock tick), so a file checked within SETTLE_S of its last change
is not remembered: a write in the same tick could keep its stamp (git's "racily clean" index
entries, same cure)."""

from __future__ import annotations

import os
from pathlib import Path

SETTLE_S = 0.1


def stamp(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def settled(seen: tuple, t0_ns: int) -> bool:
    """A file at stamp `seen`, read from time `t0_ns` on, was last changed more than SETTLE_S before."""
    return t0_ns - max(seen[3], seen[4]) > SETTLE_S * 1e9


class Passed:
    """The files that passed one check (a checksum, a finite-values scan), by path."""

    def __init__(self) -> None:
        self._ok: dict[str, tuple] = {}

    def holds(self, path: Path, seen: tuple | None) -> bool:
        """The file, at stamp `seen` when it was read, passed this check and has not changed since."""
        return seen is not None and self._ok.get(str(path)) == seen == stamp(path)

    def remember(self, path: Path, seen: tuple | None, t0_ns: int) -> None:
        """The check passed over what the file held at stamp `seen`, read from time `t0_ns` on: kept
        if the file is unchanged since and was last changed well before that read."""
        if seen is not None and settled(seen, t0_ns) and stamp(path) == seen:
            self._ok[str(path)] = seen
        else:
            self.forget(path)

    def forget(self, path: Path) -> None:
        self._ok.pop(str(path), None)
