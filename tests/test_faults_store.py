"""Store and snapshot faults (issue 29, defects 2, 3, 4, 5, 9, 10): each fault is one line with a
documented exit code (HTTP: a documented status, never 500), and the command the error names heals it.

The shared-store cases run against the real S3 server (moto's, on loopback) of tests/test_store.py.
A read-only index is a real SQLite file opened read-only (`mode=ro`): the same SQLITE_READONLY a
file without write permission gives, which chmod cannot produce when the tests run as root. A full
disk is injected at the write seam of `snapshots.save` (safetensors' `save_file`), with the error
it raises on ENOSPC.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cag.answering.query import Query
from cag.cli.main import app
from cag.errors import IndexUnusable, SnapshotCorrupt, StorageFull, StoreCorrupt, StoreUnreachable
from cag.store import snapshots
from cag.store.remote import RemoteStore
from tests.test_api import _err, app_client, wait_job
from tests.test_snapshots import _rewrite_header
from tests.test_store import URL, Q, cli, machine, s3  # noqa: F401 - s3: the fixture, used by name

EDIT = "The bakery on Quay Street sells rye bread on Fridays now.\n"


def cag(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line_error(out, code: int, *words: str) -> str:
    """The command failed with exit `code` and one error line, the last on stderr (before it only the
    progress lines a command prints), holding `words`; no traceback."""
    assert out.exit_code == code, (out.exit_code, out.stderr, out.exception)
    assert isinstance(out.exception, SystemExit), repr(out.exception)  # a handled error, not a crash
    lines = out.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:] and "Traceback" not in out.output, out.stderr
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


def snapshot_path(home: Path, digest: str) -> Path:
    return home / "snapshots" / f"{digest}.safetensors"


# -- defect 2: every header field the code trusts is covered by a checksum or validated --------------
def _drop_spans(h):
    del h["__metadata__"]["spans"]


def _edit_spans(h):
    spans = json.loads(h["__metadata__"]["spans"])
    spans[1]["start"] += 1  # one token later: still a well-formed span, no longer the one that was built
    h["__metadata__"]["spans"] = json.dumps(spans)


def _legacy_without_spans(h):  # a file written before the header checksum, its spans deleted
    del h["__metadata__"]["header_checksum"], h["__metadata__"]["spans"]


def _legacy_bad_spans(h):
    del h["__metadata__"]["header_checksum"]
    h["__metadata__"]["spans"] = json.dumps([{"path": "a.md", "start": "0", "end": 5}])


@pytest.mark.parametrize("tamper", [_drop_spans, _edit_spans, _legacy_without_spans, _legacy_bad_spans],
                         ids=["deleted", "edited", "legacy-deleted", "legacy-malformed"])
def test_an_edited_header_is_refused_as_corrupt_and_rebuilt_by_ingest(tiny_engine, small_corpus, tamper):
    r = tiny_engine.ingest(str(small_corpus), name="corpus")
    want = tiny_engine.answer(Query("corpus", Q, max_tokens=8)).token_ids
    _rewrite_header(Path(r.path), tamper)
    tiny_engine.evict()
    with pytest.raises(SnapshotCorrupt, match="cag ingest corpus"):
        tiny_engine.answer(Query("corpus", Q, max_tokens=8))
    (small_corpus / "c.md").write_text(EDIT)  # a refresh reads the old snapshot's spans to reuse its prefix
    out = cag("ingest", "corpus", "--json")
    assert out.exit_code == 0 and "Traceback" not in out.output, (out.stderr, out.exception)
    assert json.loads(out.stdout)["status"] == "built"  # nothing reused from the refused file
    (small_corpus / "c.md").write_text("The bakery on Quay Street sells rye bread on Tuesdays only.\n")
    again = cag("ingest", "corpus", "--json")  # back to the first contents: the same key, rebuilt over the bad file
    assert again.exit_code == 0 and json.loads(again.stdout)["snapshot"] == r.snapshot, again.stderr
    assert tiny_engine.index.snapshot(r.snapshot)["status"] == "ready"
    assert tiny_engine.answer(Query("corpus", Q, max_tokens=8)).token_ids == want


def test_the_header_checksum_covers_every_field_but_reads_files_without_one():
    """Every metadata field is covered (a new one too); a file written before it still loads."""
    import torch

    from tests.test_snapshots import _kv

    path = Path(os.environ["CAG_HOME"]) / "s.safetensors"
    snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "k", "spans": [], "created": 1.0}, torch.float16)
    assert snapshots.load(path).meta["header_checksum"].startswith("blake3:")
    for field, value in (("created", "2.0"), ("corpus", '"other"'), ("checksum", '"blake3:00"'), ("extra", "1")):
        snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "k", "spans": [], "created": 1.0}, torch.float16)
        _rewrite_header(path, lambda h: h["__metadata__"].update({field: value}))
        for read in (snapshots.load, snapshots.read_header):
            with pytest.raises(snapshots.SnapshotError, match="header checksum"):
                read(path)
    snapshots.save(path, _kv(), [1, 2, 3, 4, 5], {"key": "k", "spans": [], "created": 1.0}, torch.float16)
    _rewrite_header(path, lambda h: h["__metadata__"].pop("header_checksum"))
    assert snapshots.load(path).ids == [1, 2, 3, 4, 5]  # format 2 as written before: tensors checked as then


def test_a_refresh_job_over_an_edited_header_rebuilds_instead_of_failing(tiny_engine, small_corpus):
    r = tiny_engine.ingest(str(small_corpus), name="corpus")
    _rewrite_header(Path(r.path), _drop_spans)
    (small_corpus / "c.md").write_text(EDIT)
    with app_client(tiny_engine) as c:
        job = wait_job(c, c.post("/v1/corpora/corpus/refresh").json())
        assert job["status"] == "done", job
        assert job["result"]["status"] == "built"
        assert c.post("/v1/ask", json={"corpus": "corpus", "question": Q, "max_tokens": 4}).status_code == 200


# -- defect 3: a same-size tampered blob is replaced by the next ingest --------------------------------
def _flip(store: RemoteStore, digest: str) -> None:
    key = f"{store.bucket}/{store.blob_key(digest)}"
    data = bytearray(store.fs.cat(key))
    data[-10] ^= 0xFF  # same size, parseable, wrong checksum
    store.fs.pipe(key, bytes(data))


@pytest.mark.usefixtures("s3")
def test_a_same_size_tampered_blob_is_healed_by_ingest(small_corpus, tmp_path):
    store = RemoteStore(URL)
    a = machine(tmp_path, "a")
    r = a.ingest(str(small_corpus), name="corpus")
    local = snapshot_path(tmp_path / "a", r.snapshot)
    blob = lambda: store.fs.cat(f"{store.bucket}/{store.blob_key(r.snapshot)}")  # noqa: E731
    want = json.loads(cli(tmp_path / "a", "ask", "corpus", Q, "--max-tokens", "6", "--json").stdout)["answer"]

    for home, args in (
        ("a", ["ingest", "corpus"]),
        ("a", ["ingest", "corpus", "--force"]),
        ("b", ["ingest", "corpus"]),
    ):
        _flip(store, r.snapshot)
        refused = cli(tmp_path / home, "ask", "corpus", Q, "--max-tokens", "6")  # b: a machine without the file
        if home == "b":
            one_line_error(refused, SnapshotCorrupt.exit_code, "failed verification", "cag ingest corpus")
        healed = cli(tmp_path / home, *args)  # the command the error names
        assert healed.exit_code == 0, (args, healed.stderr, healed.exception)
        if home == "a" and "--force" not in args:
            assert blob() == local.read_bytes()  # the verified local copy, uploaded again
        fresh = cli(tmp_path / f"fresh-{len(args)}-{home}", "ask", "corpus", Q, "--max-tokens", "6", "--json")
        assert fresh.exit_code == 0, (args, fresh.stderr)  # a machine that never saw it fetches a good blob
        assert json.loads(fresh.stdout)["answer"] == want


@pytest.mark.usefixtures("s3")
def test_put_blob_skips_only_a_blob_with_the_same_content(tmp_path):
    store = RemoteStore(URL)
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"a" * 100)
    store.put_blob(path, "d1")
    first = store.fs.info(f"{store.bucket}/{store.blob_key('d1')}")
    store.put_blob(path, "d1")  # the same content: not sent again, only dated again (copied onto itself)
    assert store.fs.cat(f"{store.bucket}/{store.blob_key('d1')}") == b"a" * 100
    path.write_bytes(b"b" * 100)  # the same size, other bytes
    store.put_blob(path, "d1")
    assert store.fs.cat(f"{store.bucket}/{store.blob_key('d1')}") == b"b" * 100
    assert store.fs.info(f"{store.bucket}/{store.blob_key('d1')}")["ETag"] != first["ETag"]


# -- defect 4: a blob a ref names is missing from the store -------------------------------------------
@pytest.mark.usefixtures("s3")
def test_a_blob_missing_from_the_store_is_one_line_503_and_healed_by_ingest(small_corpus, tmp_path):
    store = RemoteStore(URL)
    a = machine(tmp_path, "a")
    r = a.ingest(str(small_corpus), name="corpus")
    assert cli(tmp_path / "c", "ask", "corpus", Q, "--max-tokens", "4").exit_code == 0  # c holds it in its cache
    store.delete_blob(r.snapshot)
    snapshot_path(tmp_path / "c", r.snapshot).unlink()  # ... and evicted it since

    for home in ("b", "c"):  # a machine that never saw the corpus, and one whose cache lost the file
        one_line_error(cli(tmp_path / home, "ask", "corpus", Q), SnapshotCorrupt.exit_code,
                       f"snapshot {r.snapshot[:12]}", "missing from the store", "cag ingest corpus")
    with app_client(machine(tmp_path, "d")) as c:
        err = _err(c.post("/v1/ask", json={"corpus": "corpus", "question": Q}), 503, "snapshot_corrupt")
        assert "missing from the store" in err["message"]

    healed = cli(tmp_path / "b", "ingest", "corpus")  # b knows the corpus only from the store's ref
    assert healed.exit_code == 0, (healed.stderr, healed.exception)
    assert r.snapshot in {b["digest"] for b in store.blobs()}
    for home in ("b", "c", "e"):
        assert cli(tmp_path / home, "ask", "corpus", Q, "--max-tokens", "4").exit_code == 0, home

    store.delete_blob(r.snapshot)
    assert cli(tmp_path / "a", "ingest", "corpus").exit_code == 0  # the machine with the file uploads it again
    assert r.snapshot in {b["digest"] for b in store.blobs()}
    assert cli(tmp_path / "f", "ask", "corpus", Q, "--max-tokens", "4").exit_code == 0


# -- defect 5: a ref that is not a ref ----------------------------------------------------------------
@pytest.mark.parametrize("garbage", [b"{not json", b"[1, 2]", b'{"corpus": "corpus", "shards": "abc"}',
                                     b'{"corpus": "corpus", "shards": [1]}'],
                         ids=["not-json", "not-an-object", "shards-not-a-list", "shards-not-digests"])
@pytest.mark.usefixtures("s3")
def test_a_garbage_ref_is_a_corrupt_object_and_ingest_writes_it_again(small_corpus, tmp_path, garbage):
    store = RemoteStore(URL)
    a = machine(tmp_path, "a")
    r = a.ingest(str(small_corpus), name="corpus")
    ref_key = f"{store.bucket}/{store.ref_key('corpus')}"

    for force in ([], ["--force"]):
        store.fs.pipe(ref_key, garbage)
        assert StoreCorrupt.exit_code != StoreUnreachable.exit_code
        for args in (["ask", "corpus", Q], ["gc"]):  # gc cannot tell what the ref names: it deletes nothing
            one_line_error(cli(tmp_path / "b", *args), StoreCorrupt.exit_code, "ref of 'corpus'", "cag ingest")
        healed = cli(tmp_path / "a", "ingest", "corpus", *force)
        assert healed.exit_code == 0, (force, healed.stderr, healed.exception)
        ref = store.get_ref("corpus")
        assert ref.shards == [r.snapshot] and ref.body["source"] == str(small_corpus)
        assert cli(tmp_path / f"b{len(force)}", "ask", "corpus", Q, "--max-tokens", "4").exit_code == 0

    store.fs.pipe(ref_key, garbage)
    with app_client(machine(tmp_path, "d")) as c:
        _err(c.post("/v1/ask", json={"corpus": "corpus", "question": Q}), 503, "snapshot_corrupt")
    assert a.answer(Query("corpus", Q, max_tokens=4)).snapshot == r.snapshot  # a machine that knows it serves its cache


# -- defect 9: a read-only index -----------------------------------------------------------------------
@pytest.fixture
def read_only_index(monkeypatch):
    """From now on every connection to an index.db is a read-only one."""
    import sqlite3

    import sqlite_utils

    real = sqlite_utils.Database

    def database(path=None, *args, **kwargs):
        if isinstance(path, (str, Path)) and Path(path).name == "index.db":
            return real(sqlite3.connect(f"file:{path}?mode=ro", uri=True))
        return real(path, *args, **kwargs)

    return lambda: monkeypatch.setattr(sqlite_utils, "Database", database)


def test_a_read_only_index_answers_with_a_warning_and_refuses_ingest_in_one_line(
        tiny_engine, small_corpus, read_only_index, caplog):
    r = tiny_engine.ingest(str(small_corpus), name="corpus")
    want = json.loads(cag("ask", "corpus", Q, "--max-tokens", "6", "--json").stdout)["answer"]
    n_queries = len(tiny_engine.index.queries())
    files = sorted(p.name for p in snapshot_path(Path(os.environ["CAG_HOME"]), r.snapshot).parent.iterdir())
    read_only_index()

    out = cag("ask", "corpus", Q, "--max-tokens", "6")
    assert out.exit_code == 0 and out.exception is None, (out.stderr, out.exception)
    assert out.stdout.strip() == want
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "query log" in warnings[0] and "read-only" in warnings[0], out.stderr

    (small_corpus / "c.md").write_text(EDIT)
    one_line_error(cag("ingest", "corpus"), IndexUnusable.exit_code, "read-only", "cannot record")
    assert sorted(p.name for p in snapshot_path(Path(os.environ["CAG_HOME"]), r.snapshot).parent.iterdir()) == files

    from cag.config import get_settings
    from cag.engine import Engine

    engine = Engine(get_settings(), lm=tiny_engine.lm)
    with caplog.at_level(logging.WARNING, logger="cag"), app_client(engine) as c:
        ok = c.post("/v1/ask", json={"corpus": "corpus", "question": Q, "max_tokens": 4})
        assert ok.status_code == 200, ok.text
        job = wait_job(c, c.post("/v1/corpora/corpus/refresh").json())
        assert job["status"] == "failed" and job["error"]["code"] == "index_unusable", job
    assert any("query log" in rec.getMessage() for rec in caplog.records)
    assert len(tiny_engine.index.queries()) == n_queries


# -- defect 10: a full disk during ingest --------------------------------------------------------------
def _full_disk(kind: str):
    from safetensors import SafetensorError

    def save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:  # what the writer got onto the disk before it filled
            f.write(b"\0" * 4096)
        if kind == "oserror":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')  # what safetensors raises

    return save_file


@pytest.mark.parametrize("kind", ["safetensors", "oserror"])
def test_a_full_disk_during_ingest_is_one_line_and_the_old_snapshot_answers(
        tiny_engine, small_corpus, monkeypatch, kind):
    r = tiny_engine.ingest(str(small_corpus), name="corpus")
    want = tiny_engine.answer(Query("corpus", Q, max_tokens=8)).token_ids
    folder = snapshot_path(Path(os.environ["CAG_HOME"]), r.snapshot).parent
    (small_corpus / "c.md").write_text(EDIT)
    monkeypatch.setattr(snapshots, "save_file", _full_disk(kind))

    line = one_line_error(cag("ingest", "corpus"), StorageFull.exit_code, "No space left on device")
    assert "snapshot" in line
    assert sorted(p.name for p in folder.iterdir()) == [f"{r.snapshot}.safetensors"]  # no temp file left
    assert tiny_engine.index.corpus("corpus")["current_snapshot"] == r.snapshot
    tiny_engine.evict()
    assert tiny_engine.answer(Query("corpus", Q, max_tokens=8)).token_ids == want  # the old snapshot answers (stale)

    with app_client(tiny_engine) as c:
        job = wait_job(c, c.post("/v1/corpora/corpus/refresh").json())
        assert job["status"] == "failed" and job["error"]["code"] == StorageFull.code, job
        assert job["error"]["status"] == StorageFull.http_status == 507
