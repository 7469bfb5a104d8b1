"""Crash safety: kill -9 a real `cag ingest` process while it writes a snapshot, on a first build
and on a refresh, and prove the kill landed mid-write: the writer pauses after its temp file is
written and fsynced, just before the rename (a seam the test installs: tests/faults.py), and
the test kills it only once it has said so. Then nothing half-written is served, the previous
snapshot stays current, `cag gc` removes the leftover, and the next ingest completes."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cag.answering.query import Query
from cag.cli.main import app
from cag.config import get_settings
from cag.engine import Engine
from cag.store import snapshots

from . import faults
from .conftest import REPO

Q = "When does the ferry leave?"


def _paused_ingest(args: list[str], flag: Path) -> tuple[subprocess.Popen, Path]:
    """Start `cag ingest ARGS` and wait until it holds a complete temp file, just before the rename."""
    proc = subprocess.Popen(faults.command("rename", flag, "ingest", *args, "--json"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (flag.exists() and flag.read_text()):  # the flag holds the temp file's path
        if proc.poll() is not None:
            pytest.fail(f"ingest ended (rc {proc.returncode}) before it paused: {proc.stderr.read().decode()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("ingest never reached the rename")
        time.sleep(0.05)
    return proc, Path(flag.read_text())


def _kill_9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def _nothing_half_written_is_served(engine: Engine) -> None:
    for row in engine.index.snapshots():  # every indexed snapshot is complete and verifies
        snapshots.load(Path(row["path"]), expect_key=row["key"])
    for path in engine.settings.snapshots_dir.glob("*.safetensors"):  # no half file under a final name
        if not path.name.startswith("."):
            snapshots.load(path)


@pytest.mark.parametrize("case", ["first build", "refresh"])
def test_kill_9_mid_write_leaves_index_and_files_consistent(case, tiny_model_dir, small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    cag = CliRunner()
    engine = Engine(get_settings())
    before = None
    if case == "refresh":
        old = engine.ingest(str(small_corpus), name="corpus")
        before = engine.answer(Query("corpus", Q, max_tokens=6)).token_ids
        (small_corpus / "c.md").write_text("The bakery on Quay Street sells rye bread on Fridays now.\n")
        args = ["corpus"]  # a known name: an incremental refresh from the recorded source
    else:
        args = [str(small_corpus), "--name", "corpus"]

    proc, tmp = _paused_ingest(args, tmp_path / "paused")
    final = tmp.parent / tmp.name.split(".")[1]  # .<digest>.safetensors.<pid>.tmp -> <digest>
    final = final.with_name(final.name + ".safetensors")
    assert tmp.exists() and tmp.stat().st_size > 0 and not final.exists()  # mid-write: temp done, not renamed
    alive = json.loads(cag.invoke(app, ["gc", "--dry-run", "--json"]).stdout)
    assert {k["digest"]: k["why"] for k in alive["kept"]} == {tmp.name: f"being written by running process {proc.pid}"}

    _kill_9(proc)
    assert tmp.exists() and not final.exists()  # the kill hit between the write and the rename
    _nothing_half_written_is_served(engine)
    if case == "refresh":
        assert engine.index.corpus("corpus")["current_snapshot"] == old.snapshot
        assert engine.status("corpus").reasons == ["documents changed: c.md"]  # stale, never broken
        engine.evict()
        assert engine.answer(Query("corpus", Q, max_tokens=6)).token_ids == before  # the old snapshot, served
    else:
        assert engine.index.corpus("corpus") is None and engine.index.snapshots() == []

    gc = json.loads(cag.invoke(app, ["gc", "--json"]).stdout)
    assert {d["digest"]: d["why"] for d in gc["deleted"]} == {tmp.name: "temp file of an interrupted write"}
    assert gc["kept"] == [] and not tmp.exists()

    done = engine.ingest(args[0], name="corpus")
    assert done.status == ("refreshed" if case == "refresh" else "built") and Path(done.path) == final
    assert engine.answer(Query("corpus", Q, max_tokens=4, on_stale="refuse")).completion_tokens > 0
    assert sorted(p.name for p in final.parent.iterdir()) == sorted(
        Path(r["path"]).name for r in engine.index.snapshots())  # nothing else left behind
