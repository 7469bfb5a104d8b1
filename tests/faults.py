"""A `cag` command with a fault seam installed by the test, not read by the product: the crash
tests run `python -m tests.faults HOOK FLAG -- cag-args...`, which patches one call of this process,
then runs the CLI. HOOK is where it pauses (writing FLAG first, so the test knows when to kill):

  rename  store/snapshots.save: after the temp file is written and fsynced, before its rename
  upload  store/remote.RemoteStore: halfway through the body of a PUT of a snapshot blob
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _pause(flag: Path, text: str) -> None:
    flag.write_text(text)
    time.sleep(3600)  # the test kills the process here


def before_rename(flag: Path) -> None:
    real = os.replace

    def replace(src, dst, *a, **k):
        if str(src).endswith(".tmp") and str(dst).endswith(".safetensors"):
            _pause(flag, str(src))
        return real(src, dst, *a, **k)

    os.replace = replace


class _Pausing:
    """A file whose reader pauses (for good) once half of it has been read."""

    def __init__(self, f, size: int, flag: Path):
        self.f, self.half, self.flag, self.done = f, size // 2, flag, 0

    def read(self, n: int = -1) -> bytes:
        out = self.f.read(n)
        self.done += len(out)
        if self.done >= self.half:
            _pause(self.flag, str(self.done))
        return out

    def __getattr__(self, name):
        return getattr(self.f, name)


def during_upload(flag: Path) -> None:
    from cag.store.remote import RemoteStore

    real = RemoteStore._call

    def call(self, method: str, **kw):
        if method == "put_object" and hasattr(kw.get("Body"), "read") and kw.get("ContentLength"):
            kw["Body"] = _Pausing(kw["Body"], kw["ContentLength"], flag)
        return real(self, method, **kw)

    RemoteStore._call = call


HOOKS = {"rename": before_rename, "upload": during_upload}


def command(hook: str, flag: Path, *args: str) -> list[str]:
    """The argv of `cag ARGS` with `hook` pausing it (see the module doc)."""
    return [sys.executable, "-m", "tests.faults", hook, str(flag), "--", *args]


if __name__ == "__main__":
    hook, flag, sep, *rest = sys.argv[1:]
    assert sep == "--" and hook in HOOKS, __doc__
    HOOKS[hook](Path(flag))
    from cag.cli.main import app

    sys.exit(app(rest, prog_name="cag", standalone_mode=True))
