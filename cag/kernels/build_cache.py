"""A cached native library, trusted only once verified: the folder and the file owned by this user
(or root) and writable by no one else, not a link, and the file's sha256 the one written beside it
(`.so.sha256`) when it was built. A truncated or bit-flipped library would die in dlopen (SIGBUS,
SIGILL) at every start; one that fails here is built again instead (cag.kernels.native)."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
from pathlib import Path

log = logging.getLogger("cag.kernels.native")


class UnsafeCache(RuntimeError):
    """The kernels folder cannot be trusted (another user owns it)."""


def _ours(st: os.stat_result) -> bool:
    return st.st_uid in (os.geteuid(), 0)  # root can write anything anyway


def _others_can_write(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def private_folder(folder: Path) -> bool:
    """Create `folder` (0700) or check it: a folder owned by this user (or root), else UnsafeCache.
    True when others could write it (it is made private now): nothing it holds is to be trusted."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    if not stat.S_ISDIR(st.st_mode) or not _ours(st):
        raise UnsafeCache(f"{folder} belongs to uid {st.st_uid}, not this user: no kernels are loaded from it "
                          f"(remove it, or set XDG_CACHE_HOME to a folder of your own)")
    if _others_can_write(st):
        os.chmod(folder, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
        log.warning("cag: %s was writable by other users: made private, its kernels built again", folder)
        return True
    return False


def _open_trusted(path: Path) -> int:
    """A read-only descriptor on `path`: a regular file (not a link) owned by this user (or root) and
    writable by no one else. OSError when it cannot be opened, ValueError saying why it is not trusted."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else f"owned by uid {st.st_uid}" if not _ours(st)
           else f"writable by other users (mode {stat.S_IMODE(st.st_mode):o})" if _others_can_write(st) else None)
    if why:
        os.close(fd)
        raise ValueError(why)
    return fd


def _sha256_fd(fd: int) -> str:
    h, off = hashlib.sha256(), 0
    while chunk := os.pread(fd, 1 << 20, off):
        h.update(chunk)
        off += len(chunk)
    return "sha256:" + h.hexdigest()


def digest_path(lib: Path) -> Path:
    """Where the library's sha256 is written at build time."""
    return lib.with_name(lib.name + ".sha256")


def verify(lib: Path) -> tuple[int | None, str | None]:
    """(a read-only descriptor on `lib`, None) when it is trusted: it and its digest file owned by this
    user (or root) and writable by no one else, its sha256 the one written at build time. Else
    (None, why not): "missing", or what is wrong."""
    try:
        dfd = _open_trusted(digest_path(lib))
    except FileNotFoundError:
        return None, "missing" if not os.path.lexists(lib) else "no digest beside it"
    except (OSError, ValueError) as e:
        return None, f"its digest file is {e}"
    try:
        expected = os.read(dfd, 200).decode("ascii", "replace").strip()
    finally:
        os.close(dfd)
    try:
        fd = _open_trusted(lib)
    except FileNotFoundError:
        return None, "missing"
    except (OSError, ValueError) as e:
        return None, str(e)
    got = _sha256_fd(fd)
    if got != expected:
        size = os.fstat(fd).st_size
        os.close(fd)
        return None, f"damaged: {size} bytes of sha256 {got[7:19]}, built as {expected[7:19] or '?'}"
    return fd, None


def _write_new(dest: Path, data: bytes) -> None:
    """`data` to `dest` through a temp name (0644): it appears whole or not at all."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        os.fchmod(fd, 0o644)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, dest)
