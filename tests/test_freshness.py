"""Freshness and invalidation: stale reasons, incremental refresh, invalidate, gc, reindex, locks."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cag.answering.query import Query
from cag.cli.main import app
from cag.config import get_settings
from cag.engine import Engine
from cag.errors import Busy, StaleRefused
from cag.knowledge import upkeep
from cag.knowledge.freshness import stale_reasons
from cag.store import snapshots
from cag.store.index import MIGRATIONS, Index

from .conftest import PREFILL_BLOCK

Q = "When does the ferry leave?"


@pytest.fixture
def engine32(tiny_model_dir, monkeypatch):
    """float32 snapshots: refresh vs rebuild can be compared without fp16 storage rounding."""
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_KV_DTYPE", "float32")
    return Engine(get_settings())


def _rebuild_elsewhere(corpus: Path, tiny_model_dir: Path, tmp: Path, monkeypatch) -> tuple[Engine, object]:
    monkeypatch.setenv("CAG_HOME", str(tmp / "other-home"))
    other = Engine(get_settings())
    return other, other.ingest(str(corpus))


def _assert_same_tensors(a: Path, b: Path) -> None:
    """A refreshed snapshot holds what a rebuilt one holds, bit for bit (kv_cache.prefill_knowledge)."""
    sa, sb = snapshots.load(a), snapshots.load(b)
    assert sa.ids == sb.ids
    for (ka, va), (kb, vb) in zip(sa.kv, sb.kv):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_stale_reasons_by_content_not_mtime(tiny_engine, small_corpus):
    tiny_engine.ingest(str(small_corpus))
    assert tiny_engine.status("corpus").stale is False
    os.utime(small_corpus / "a.md", (time.time() + 100, time.time() + 100))  # touched, same bytes
    assert tiny_engine.status("corpus").reasons == []
    (small_corpus / "a.md").write_text("The keeper changed.\n")
    (small_corpus / "c.md").unlink()
    (small_corpus / "d.md").write_text("New.\n")
    assert tiny_engine.status("corpus").reasons == [
        "documents changed: a.md", "documents added: d.md", "documents removed: c.md"]


def test_ttl_and_model_change_are_reasons(tiny_model_dir, small_corpus, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    e = Engine(get_settings())
    e.ingest(str(small_corpus), ttl_s=0.01)
    time.sleep(0.05)
    assert any(r.startswith("expired: built") for r in e.status("corpus").reasons)
    # same architecture and name of folder contents, one weight changed: detected by fingerprint
    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        m.model.norm.weight[0] += 1
    changed = tmp_path / "changed-model"
    m.save_pretrained(changed)
    for f in tiny_model_dir.iterdir():  # tokenizer files and chat template, unchanged
        if not (changed / f.name).exists():
            (changed / f.name).write_bytes(f.read_bytes())
    monkeypatch.setenv("CAG_MODEL", str(changed))
    e2 = Engine(get_settings())
    reasons = e2.status("corpus").reasons
    assert "model changed: the configured model's weights differ from the snapshot's" in reasons
    assert not any("tokenizer" in r for r in reasons)
    with pytest.raises(StaleRefused):  # never served for a model it was not built for
        e2.answer(Query("corpus", Q, max_tokens=4))
    assert e2.answer(Query("corpus", Q, max_tokens=4, on_stale="refresh")).stale is False


def test_edit_last_document_reprefills_only_it(engine32, small_corpus, tiny_model_dir, tmp_path, monkeypatch):
    first = engine32.ingest(str(small_corpus))
    spans = {s["path"]: s for s in engine32.index.snapshot_documents(first.snapshot)}
    (small_corpus / "c.md").write_text("The bakery on Quay Street sells rye bread on Fridays now.\n")
    r = engine32.ingest("corpus")
    start = spans["c.md"]["start"]
    assert r.status == "refreshed" and r.reused_tokens == start - start % PREFILL_BLOCK  # from the block holding c.md
    assert r.prefilled_tokens == r.n_tokens - r.reused_tokens
    refreshed = [engine32.answer(Query("corpus", q, max_tokens=16)).token_ids for q in (Q, "Who keeps the lighthouse?")]
    other, rebuilt = _rebuild_elsewhere(small_corpus, tiny_model_dir, tmp_path, monkeypatch)
    assert rebuilt.snapshot == r.snapshot  # same key: same content, model, layout, dtype
    _assert_same_tensors(Path(r.path), Path(rebuilt.path))
    assert refreshed == [
        other.answer(Query("corpus", q, max_tokens=16)).token_ids for q in (Q, "Who keeps the lighthouse?")
    ]


def test_added_document_is_appended_and_alone_prefilled(engine32, small_corpus):
    first = engine32.ingest(str(small_corpus))
    (small_corpus / "0-first-by-name.md").write_text("The harbour master is Ilse Brandt.\n")
    r = engine32.ingest("corpus", reporter=None)
    docs = [s["path"] for s in engine32.index.snapshot_documents(r.snapshot)]
    assert docs == ["a.md", "b.txt", "c.md", "0-first-by-name.md"]  # appended, not sorted in front
    old_end = max(s["end"] for s in engine32.index.snapshot_documents(first.snapshot))
    assert r.reused_tokens == old_end - old_end % PREFILL_BLOCK and r.prefilled_tokens < r.n_tokens / 2
    # the no-cache baseline sees the same order, so answers still agree exactly
    assert (
        engine32.answer(Query("corpus", Q, max_tokens=12)).token_ids
        == engine32.answer(Query("corpus", Q, max_tokens=12, mode="full")).token_ids
    )


def test_force_rebuilds_from_scratch(tiny_engine, small_corpus):
    tiny_engine.ingest(str(small_corpus))
    (small_corpus / "c.md").write_text("Changed.\n")
    r = tiny_engine.ingest("corpus", force=True)
    assert r.status == "built" and r.reused_tokens == 0 and r.prefilled_tokens == r.n_tokens


runner = CliRunner()


def cag(*args):
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_invalidate_and_on_stale_policies(tiny_model_dir, small_corpus, monkeypatch):
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    assert cag("ingest", str(small_corpus)).exit_code == 0
    assert cag("invalidate", "--doc", "b.txt").stdout.strip() == "invalidated: corpus"
    st = json.loads(cag("status", "corpus", "--json").stdout)
    assert st["reasons"] == ["invalidated: document b.txt invalidated by user"]
    served = cag("ask", "corpus", Q, "--max-tokens", "4", "--json")
    assert served.exit_code == 0 and json.loads(served.stdout)["stale"] is True
    assert "warning: corpus 'corpus' is stale" in served.stderr
    refused = cag("ask", "corpus", Q, "--on-stale", "refuse")
    assert refused.exit_code == 3 and "invalidated" in refused.stderr
    refreshed = cag("ask", "corpus", Q, "--on-stale", "refresh", "--max-tokens", "4", "--json")
    assert refreshed.exit_code == 0 and json.loads(refreshed.stdout)["stale"] is False
    assert json.loads(cag("status", "corpus", "--json").stdout)["stale"] is False
    assert cag("invalidate", "--doc", "nope.md").exit_code == 1


def test_gc_deletes_superseded_keeps_current(tiny_model_dir, small_corpus, monkeypatch, cag_home):
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    first = json.loads(cag("ingest", str(small_corpus), "--json").stdout)
    (small_corpus / "c.md").write_text("Changed bakery.\n")
    second = json.loads(cag("ingest", "corpus", "--json").stdout)
    tmp = cag_home / "snapshots" / ".x.safetensors.tmp"
    tmp.write_bytes(b"partial")
    os.utime(tmp, (time.time() - 7200,) * 2)  # left by a write killed 2 h ago (a younger one may be in progress)
    dry = json.loads(cag("gc", "--dry-run", "--json").stdout)
    assert {d["digest"] for d in dry["deleted"]} == {first["snapshot"], tmp.name}
    assert Path(first["path"]).exists() and tmp.exists()
    done = json.loads(cag("gc", "--max-bytes", "0", "--json").stdout)
    assert done["freed_bytes"] == first["bytes"] + len(b"partial")
    assert not Path(first["path"]).exists() and not tmp.exists() and Path(second["path"]).exists()
    assert cag("ask", "corpus", Q, "--max-tokens", "4").exit_code == 0  # current kept despite budget 0
    assert [(k["digest"], k["why"]) for k in done["kept"]] == [
        (second["snapshot"], "current snapshot of corpus (over --max-bytes; --include-current deletes it)")]
    gone = json.loads(cag("gc", "--max-bytes", "0", "--include-current", "--json").stdout)
    assert [d["digest"] for d in gone["deleted"]] == [second["snapshot"]]
    assert cag("ask", "corpus", Q).exit_code == 1


def test_reindex_rebuilds_a_lost_index(tiny_model_dir, small_corpus, monkeypatch, cag_home):
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    cag("ingest", str(small_corpus))
    before = json.loads(cag("ask", "corpus", Q, "--max-tokens", "8", "--json").stdout)
    for f in cag_home.glob("index.db*"):
        f.unlink()
    assert cag("ask", "corpus", Q).exit_code == 1  # the index is gone: unknown corpus
    out = json.loads(cag("reindex", "--json").stdout)
    assert out["corpora"] == ["corpus"] and out["snapshots"] == 1
    st = json.loads(cag("status", "corpus", "--json").stdout)
    assert st["stale"] is False, st["reasons"]
    after = json.loads(cag("ask", "corpus", Q, "--max-tokens", "8", "--json").stdout)
    assert after["answer"] == before["answer"] and after["snapshot"] == before["snapshot"]


def test_second_writer_gets_busy(tiny_engine, small_corpus, cag_home):
    tiny_engine.ingest(str(small_corpus))
    from cag.hashing import hash_obj

    lock = cag_home / "locks" / f"{hash_obj('corpus')[7:23]}.lock"
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(Busy, match="being ingested by another process"):
            tiny_engine.ingest("corpus", force=True)
        # queries keep working while the writer holds the corpus
        assert tiny_engine.answer(Query("corpus", Q, max_tokens=4)).completion_tokens > 0


def test_a_corpus_name_wins_over_a_same_named_folder_in_cwd(tiny_engine, small_corpus, tmp_path, monkeypatch):
    tiny_engine.ingest(str(small_corpus))
    decoy = tmp_path / "cwd" / "corpus"
    decoy.mkdir(parents=True)
    (decoy / "other.md").write_text("Something else entirely.\n")
    monkeypatch.chdir(decoy.parent)
    r = tiny_engine.ingest("corpus")
    assert r.status == "fresh" and r.n_documents == 3
    assert tiny_engine.ingest("./corpus", name="decoy").n_documents == 1  # an explicit path is a path


def _snap_row(digest: str, folder: Path, corpus: str) -> dict:
    path = folder / f"{digest}.safetensors"
    path.write_bytes(b"x" * 10)
    return {"key": f"sha256:{digest}", "digest": digest, "corpus": corpus, "model": "m", "model_fingerprint": "f",
            "tokenizer_fingerprint": "t", "n_tokens": 5, "n_documents": 0, "bytes": 10, "dtype": "float16",
            "path": str(path), "created": time.time(), "last_used": None, "prefill_ms": 1.0, "reused_tokens": 0}


def test_identical_corpora_keep_their_own_status_in_the_index(cag_home, tmp_path):
    """Two corpora with identical content share one snapshot. When one moves on, the other still
    points to the shared snapshot: it must read ready (not superseded), fresh, and gc keeps it."""
    settings = get_settings()
    settings.snapshots_dir.mkdir(parents=True)
    index = Index(settings.index_path)
    source = tmp_path / "empty-source"
    source.mkdir()
    shared = _snap_row("s1", settings.snapshots_dir, "a")
    index.publish({"name": "a", "source": str(source), "model": "m", "ttl_s": None}, [], shared, [])
    index.publish({"name": "b", "source": str(source), "model": "m", "ttl_s": None}, [], shared, [])  # same content
    assert index.corpora_using("s1") == ["a", "b"]
    index.publish({"name": "b", "source": str(source), "model": "m", "ttl_s": None}, [],
                  _snap_row("s2", settings.snapshots_dir, "b"), [])
    row = index.snapshot("s1")
    assert row["status"] == "ready" and not index.superseded("s1") and index.corpora_using("s1") == ["a"]
    assert stale_reasons(index.corpus("a"), row, [], []) == []
    r = upkeep.gc(settings, index, max_bytes=0)
    assert r.deleted == [] and Path(shared["path"]).exists()  # every snapshot is some corpus's current one
    index.publish({"name": "a", "source": str(source), "model": "m", "ttl_s": None}, [],
                  _snap_row("s3", settings.snapshots_dir, "a"), [])
    assert index.superseded("s1")  # now no corpus points to it
    r = upkeep.gc(settings, index)
    assert [(d["digest"], d["why"]) for d in r.deleted] == [("s1", "superseded (no corpus uses it)")]
    assert not Path(shared["path"]).exists() and index.snapshot("s1") is None


def test_migration_drops_the_stored_superseded(cag_home, tmp_path):
    """An index written before `superseded` was derived: the word goes, nothing else changes."""
    import sqlite_utils

    db = sqlite_utils.Database(tmp_path / "old.db")
    MIGRATIONS[0](db)
    db.execute("PRAGMA user_version = 1")
    db["snapshots"].insert(dict(_snap_row("s1", tmp_path, "a"), status="superseded"))
    db["snapshots"].insert(dict(_snap_row("s2", tmp_path, "a"), status="corrupt"))
    db.conn.commit()
    db.conn.close()
    index = Index(tmp_path / "old.db")
    assert index.db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) >= 2
    assert {r["digest"]: r["status"] for r in index.snapshots()} == {"s1": "ready", "s2": "corrupt"}


def test_refreshing_one_corpus_leaves_its_identical_twin_fresh(tiny_model_dir, small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    twin = tmp_path / "twin"
    twin.mkdir()
    for f in small_corpus.iterdir():
        (twin / f.name).write_bytes(f.read_bytes())
    a = json.loads(cag("ingest", str(small_corpus), "--name", "a", "--json").stdout)
    b = json.loads(cag("ingest", str(twin), "--name", "b", "--json").stdout)
    assert b["status"] == "fresh" and b["snapshot"] == a["snapshot"]  # one file for both
    (twin / "c.md").write_text("The bakery on Quay Street closed.\n")
    assert json.loads(cag("ingest", "b", "--json").stdout)["snapshot"] != a["snapshot"]
    st = json.loads(cag("status", "a", "--json").stdout)
    assert st["stale"] is False and st["reasons"] == [] and st["snapshot"] == a["snapshot"]
    gc = json.loads(cag("gc", "--json").stdout)
    assert gc["deleted"] == [] and Path(a["path"]).exists()
    assert cag("ask", "a", Q, "--max-tokens", "4", "--on-stale", "refuse").exit_code == 0


def test_gc_removes_every_leftover_it_reports_and_reports_what_it_keeps(
    tiny_model_dir, small_corpus, monkeypatch, cag_home
):
    """kill -9 leaves temp names that are not `*.tmp` (a library's `.tmpXXXXXX`, any dot-file), and
    whole snapshots renamed but never recorded. gc deletes the first kind and reports the second."""
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    first = json.loads(cag("ingest", str(small_corpus), "--json").stdout)
    folder = cag_home / "snapshots"
    leftovers = {".tmpa1b2c3": b"half", ".x.safetensors.999999999.tmp": b"half a snapshot"}  # writer long gone
    for name, data in leftovers.items():
        (folder / name).write_bytes(data)
        os.utime(folder / name, (time.time() - 7200,) * 2)  # killed 2 h ago: past gc's grace for unnamed writers
    writing = folder / f".y.safetensors.{os.getpid()}.tmp"  # its writer (this process) is alive
    writing.write_bytes(b"in progress")
    (small_corpus / "c.md").write_text("Changed bakery.\n")
    second = json.loads(cag("ingest", "corpus", "--json").stdout)
    index = Index(get_settings().index_path)
    with index.atomic():  # a whole snapshot without a row: as if killed between the rename and the record
        index.db["snapshot_documents"].delete_where("snapshot = ?", [first["snapshot"]])
        index.db["snapshots"].delete(first["snapshot"])
    out = json.loads(cag("gc", "--json").stdout)
    assert {d["digest"]: d["why"] for d in out["deleted"]} == {
        n: "temp file of an interrupted write" for n in leftovers}
    assert out["freed_bytes"] == sum(len(d) for d in leftovers.values())
    assert not any((folder / n).exists() for n in leftovers)  # gone, as reported
    assert {k["digest"]: k["why"] for k in out["kept"]} == {
        Path(first["path"]).name: "not in the index: `cag reindex` adopts it",
        writing.name: f"being written by running process {os.getpid()}",
    }
    assert out["kept_bytes"] == second["bytes"] + first["bytes"] + len(b"in progress")
    human = cag("gc", "--dry-run").stdout
    assert f"kept {Path(first['path']).name} (-, " in human and "cag reindex" in human
    assert Path(first["path"]).exists() and writing.exists()
    assert json.loads(cag("reindex", "--json").stdout)["snapshots"] == 2  # adopted, as gc said


def test_a_snapshot_of_another_kv_dtype_is_stale_not_corrupt(tiny_model_dir, small_corpus, monkeypatch):
    """`CAG_KV_DTYPE=auto` stores what decode attends in when that is bf16, else float16. A snapshot
    of another storage dtype (the setting changed, or `auto` resolves otherwise) is sound: served as
    stored, flagged stale, rebuilt by `cag ingest` in the configured dtype (it was marked corrupt)."""
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    e = Engine(get_settings())
    assert e.kv_name == "float16"  # fp32 weights attend in float32
    e.ingest(str(small_corpus))
    monkeypatch.setenv("CAG_WEIGHTS", "int8")
    e2 = Engine(get_settings())
    assert e2.kv_name == "bfloat16"  # packed weights attend over bf16 K/V
    old = e2.index.corpus("corpus")["current_snapshot"]
    want = "snapshot stored as float16, CAG_KV_DTYPE means bfloat16 here: `cag ingest` rebuilds it"
    assert e2.status("corpus").reasons == [want]
    a = e2.answer(Query("corpus", Q, max_tokens=6))
    assert a.stale and a.stale_reasons == [want] and a.snapshot == old
    assert e2.index.snapshot(old)["status"] != "corrupt"
    with pytest.raises(StaleRefused):
        e2.answer(Query("corpus", Q, max_tokens=6, on_stale="refuse"))
    assert e2.ingest(str(small_corpus)).status == "built"
    new = e2.index.snapshot(e2.index.corpus("corpus")["current_snapshot"])
    assert new["dtype"] == "bfloat16" and snapshots.load(Path(new["path"])).kv[0][0].dtype == torch.bfloat16
    assert not e2.status("corpus").stale
    assert (
        e2.answer(Query("corpus", Q, max_tokens=6)).token_ids
        == e2.answer(Query("corpus", Q, max_tokens=6, mode="full")).token_ids
    )
