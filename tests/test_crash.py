"""Crash safety: kill -9 a real `cag ingest` process at spread-out moments; every time the index
and the files stay consistent and the previous snapshot stays servable."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

from cag.config import get_settings
from cag.engine import Engine
from cag.store import snapshots


def _check_consistent(settings) -> None:
    engine = Engine(settings)
    rows = engine.index.snapshots()
    for row in rows:  # every indexed snapshot is complete and verifies
        if row["status"] in ("ready", "superseded"):
            snapshots.load(snapshots.Path(row["path"]), expect_key=row["key"])
    for path in settings.snapshots_dir.glob("*.safetensors"):  # no half-written file under a final name
        snapshots.load(path)
    corpus = engine.index.corpus("corpus")
    assert corpus and engine.index.snapshot(corpus["current_snapshot"])["status"] == "ready"
    assert engine.ask("corpus", "When does the ferry leave?", max_tokens=4).completion_tokens > 0


def test_kill_9_during_ingest_leaves_index_and_files_consistent(tiny_model_dir, small_corpus, cag_home):
    env = dict(os.environ, CAG_MODEL=str(tiny_model_dir), CAG_CHUNK_TOKENS="4")
    (small_corpus / "long.md").write_text("\n".join(f"Line {i}: the tide table for pier {i % 7} is posted daily." for i in range(60)))
    cmd = [sys.executable, "-m", "cag", "ingest", str(small_corpus), "--name", "corpus", "--json"]
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    full = time.monotonic() - t0
    settings = get_settings(home=cag_home, model=str(tiny_model_dir))
    rng = random.Random(7)
    for i in range(6):
        # each round changes the first document, so the whole corpus is prefilled and saved again
        (small_corpus / "a.md").write_text(f"The lighthouse keeper, round {i}, is Mara Voss.\n")
        proc = subprocess.Popen(cmd + ["--force"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 1.0) * full)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        _check_consistent(settings)
