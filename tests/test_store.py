"""Snapshots in a shared S3-compatible store: a real S3 server (moto's server mode) on loopback,
started and stopped by the fixture; two "machines" are two CAG_HOMEs on one store.

Each test says what it proves: answers on a machine that never prefilled, refresh propagation
after a ref lookup, gc never deleting a blob that a ref names, kill -9 in the middle of an upload,
a tampered blob refused on cache fill, an unreachable store (one line; the cache still serves),
conditional ref writes, the bounded LRU cache, and `cag reindex` from the store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cag.answering.query import Query
from cag.cli.main import app
from cag.config import get_settings
from cag.engine import Engine
from cag.errors import SnapshotCorrupt, StoreConflict, StoreUnreachable
from cag.store.remote import RemoteStore

from . import faults
from .conftest import REPO

Q = "When does the ferry leave?"
URL = "s3://cag-test/team"


@pytest.fixture
def s3(monkeypatch, tiny_model_dir):
    """A real S3 server on 127.0.0.1 (free port), a bucket, and CAG_STORE pointing at it."""
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps its state per process, not per server: start every test from an empty store
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("CAG_STORE", URL)
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_STORE_REF_TTL_S", "0")  # every question looks the ref up (the server default is 10 s)
    RemoteStore(URL).ensure_bucket()
    yield server
    server.stop()


def machine(tmp_path: Path, name: str) -> Engine:
    return Engine(get_settings(home=tmp_path / name))


def cli(home: Path, *args: str):
    """`cag ARGS` on the machine whose CAG_HOME is `home`."""
    old = os.environ.get("CAG_HOME")
    os.environ["CAG_HOME"] = str(home)
    try:
        return CliRunner().invoke(app, list(args))
    finally:
        os.environ["CAG_HOME"] = old


def blobs() -> set[str]:
    return {b["digest"] for b in RemoteStore(URL).blobs()}


def test_ingest_on_one_machine_answers_on_another(s3, small_corpus, tmp_path):
    a, b = machine(tmp_path, "a"), machine(tmp_path, "b")
    r = a.ingest(str(small_corpus), name="corpus")
    assert blobs() == {r.snapshot}
    ref = RemoteStore(URL).get_ref("corpus")
    assert ref.shards == [r.snapshot] and ref.generation == 1 and ref.body["source"] == str(small_corpus)
    want = a.answer(Query("corpus", Q, max_tokens=8))
    got = b.answer(Query("corpus", Q, max_tokens=8))  # b never prefilled: it looks the ref up and fetches the blob
    assert got.token_ids == want.token_ids and got.snapshot == r.snapshot and got.cached_tokens == r.n_tokens
    assert (tmp_path / "b" / "snapshots" / f"{r.snapshot}.safetensors").exists()
    assert b.status("corpus").stale is False
    moved = small_corpus.rename(small_corpus.parent / "elsewhere")  # b serves without a copy of the source
    assert b.status("corpus").stale is False and b.answer(Query("corpus", Q, max_tokens=8)).stale is False
    moved.rename(small_corpus)


def test_refresh_on_the_first_is_served_by_the_second_after_its_lookup(s3, small_corpus, tmp_path, monkeypatch):
    a, b = machine(tmp_path, "a"), machine(tmp_path, "b")
    old = a.ingest(str(small_corpus), name="corpus")
    assert b.answer(Query("corpus", Q, max_tokens=8)).snapshot == old.snapshot
    (small_corpus / "c.md").write_text("The bakery on Quay Street sells rye bread on Fridays now.\n")
    new = a.ingest("corpus")
    assert new.status == "refreshed" and new.snapshot != old.snapshot
    assert RemoteStore(URL).get_ref("corpus").generation == 2
    want = a.answer(Query("corpus", Q, max_tokens=8))
    got = b.answer(Query("corpus", Q, max_tokens=8))
    assert got.snapshot == new.snapshot and got.token_ids == want.token_ids and not got.stale
    # with a ref TTL, a machine that looked up recently keeps its snapshot until the TTL passes
    monkeypatch.setenv("CAG_STORE_REF_TTL_S", "3600")
    c = machine(tmp_path, "c")
    assert c.answer(Query("corpus", Q, max_tokens=4)).snapshot == new.snapshot
    (small_corpus / "c.md").write_text("The bakery on Quay Street sells rye bread on Mondays.\n")
    newer = a.ingest("corpus")
    assert c.answer(Query("corpus", Q, max_tokens=4)).snapshot == new.snapshot
    c.remote._checked.clear()  # what the TTL running out does
    assert c.answer(Query("corpus", Q, max_tokens=4)).snapshot == newer.snapshot


def test_gc_never_deletes_a_blob_that_a_ref_names(s3, small_corpus, tmp_path, monkeypatch):
    a = machine(tmp_path, "a")
    old = a.ingest(str(small_corpus), name="corpus")
    a.ingest(str(small_corpus), name="twin")  # identical content: one blob named by two refs
    (small_corpus / "c.md").write_text("The bakery on Quay Street sells rye bread on Fridays now.\n")
    new = a.ingest("corpus")
    assert blobs() == {old.snapshot, new.snapshot}
    # b has never seen any corpus: its local index names nothing, the refs still protect the blobs
    gc = json.loads(cli(tmp_path / "b", "gc", "--json").stdout)
    assert blobs() == {old.snapshot, new.snapshot}
    assert [k["why"] for k in gc["kept"]] == []  # old is named by twin's ref, so not even a candidate
    a.ingest(str(small_corpus), name="twin")  # twin moves on: old is named by no ref now
    young = json.loads(cli(tmp_path / "b", "gc", "--json").stdout)
    assert blobs() == {old.snapshot, new.snapshot}  # inside the grace period an unnamed blob stays
    assert any(k["digest"] == f"store:{old.snapshot}" and "younger than" in k["why"] for k in young["kept"])
    monkeypatch.setenv("CAG_STORE_GC_GRACE_S", "0")
    done = json.loads(cli(tmp_path / "b", "gc", "--json").stdout)
    assert blobs() == {new.snapshot}
    assert {d["digest"] for d in done["deleted"]} == {f"store:{old.snapshot}"}
    b = machine(tmp_path, "b")
    assert b.answer(Query("corpus", Q, max_tokens=4)).snapshot == new.snapshot
    assert b.answer(Query("twin", Q, max_tokens=4)).snapshot == new.snapshot


def test_kill_9_during_the_upload_leaves_no_ref_to_a_partial_blob(s3, small_corpus, tmp_path):
    a_home = tmp_path / "a"
    a, b = machine(tmp_path, "a"), machine(tmp_path, "b")
    old = a.ingest(str(small_corpus), name="corpus")
    before = b.answer(Query("corpus", Q, max_tokens=8)).token_ids
    (small_corpus / "c.md").write_text("The bakery on Quay Street sells rye bread on Fridays now.\n")

    flag = tmp_path / "uploading"
    env = dict(os.environ, CAG_HOME=str(a_home))
    proc = subprocess.Popen(faults.command("upload", flag, "ingest", "corpus", "--json"), env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (flag.exists() and flag.read_text()):  # half the blob has been read by the PUT
        if proc.poll() is not None:
            pytest.fail(f"ingest ended (rc {proc.returncode}) before the upload: {proc.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, "the ingest never reached the upload"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    ref = RemoteStore(URL).get_ref("corpus")
    assert ref.shards == [old.snapshot] and ref.generation == 1  # the ref still names the complete old blob
    assert blobs() == {old.snapshot}  # the interrupted PUT left no object at all
    served = b.answer(Query("corpus", Q, max_tokens=8))
    assert served.snapshot == old.snapshot and served.token_ids == before
    again = a.ingest("corpus")  # the next ingest completes (its local file was whole: reused, uploaded)
    assert again.snapshot != old.snapshot and blobs() == {old.snapshot, again.snapshot}
    assert RemoteStore(URL).get_ref("corpus").shards == [again.snapshot]
    assert b.answer(Query("corpus", Q, max_tokens=8)).snapshot == again.snapshot


def test_a_tampered_blob_is_detected_on_cache_fill_and_never_served(s3, small_corpus, tmp_path):
    a = machine(tmp_path, "a")
    r = a.ingest(str(small_corpus), name="corpus")
    store = RemoteStore(URL)
    key = f"{store.bucket}/{store.blob_key(r.snapshot)}"
    data = bytearray(store.fs.cat(key))
    data[-10] ^= 0xFF  # a flipped bit in the last tensor's bytes: same size, parseable, wrong checksum
    store.fs.pipe(key, bytes(data))
    out = cli(tmp_path / "b", "ask", "corpus", Q, "--max-tokens", "4")
    assert out.exit_code == 1 and "failed verification" in out.stderr and "checksum" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert list((tmp_path / "b" / "snapshots").iterdir()) == []  # neither the blob nor a temp file stays
    b = machine(tmp_path, "b")
    with pytest.raises(SnapshotCorrupt, match="failed verification"):
        b.answer(Query("corpus", Q, max_tokens=4))
    # a blob swapped for another valid snapshot (another key) is refused the same way
    twin = small_corpus.parent / "other"
    twin.mkdir()
    (twin / "x.md").write_text("Something else entirely.\n")
    other = a.ingest(str(twin), name="other")
    store.fs.pipe(key, store.fs.cat(f"{store.bucket}/{store.blob_key(other.snapshot)}"))
    with pytest.raises(SnapshotCorrupt, match="another key"):
        machine(tmp_path, "c").answer(Query("corpus", Q, max_tokens=4))


def test_an_unreachable_store_is_one_line_and_the_cache_still_serves(s3, small_corpus, tmp_path):
    a, b = machine(tmp_path, "a"), machine(tmp_path, "b")
    a.ingest(str(small_corpus), name="corpus")
    want = b.answer(Query("corpus", Q, max_tokens=8))  # b's cache holds the blob now
    s3.stop()
    t0 = time.monotonic()
    served = machine(tmp_path, "b").answer(Query("corpus", Q, max_tokens=8))
    assert served.token_ids == want.token_ids
    out = cli(tmp_path / "b", "ask", "corpus", Q, "--max-tokens", "8", "--json")
    assert out.exit_code == 0 and json.loads(out.stdout)["answer"] == want.answer
    for home, args in (("c", ["ask", "corpus", Q]), ("a", ["ingest", "corpus"]), ("c", ["reindex"])):
        out = cli(tmp_path / home, *args)
        assert out.exit_code == StoreUnreachable.exit_code == 6, (args, out.stderr)
        line = out.stderr.strip()
        assert "\n" not in line and line.startswith(f"error: snapshot store {URL} unreachable"), line
    assert time.monotonic() - t0 < 120
    with pytest.raises(StoreUnreachable):
        machine(tmp_path, "d").answer(Query("corpus", Q))


def test_ref_writes_are_conditional(s3):
    store = RemoteStore(URL)
    body = {"corpus": "race", "shards": ["a"], "generation": 1}
    first = store.put_ref(body, None)
    with pytest.raises(StoreConflict, match="published by another ingest"):
        store.put_ref(dict(body, shards=["b"]), None)  # both thought the corpus was new
    second = store.put_ref(dict(body, shards=["c"], generation=2), first)
    with pytest.raises(StoreConflict):
        store.put_ref(dict(body, shards=["d"], generation=2), first)  # read before `second` was written
    assert store.get_ref("race").shards == ["c"] and store.get_ref("race").etag == second.etag


def test_the_local_cache_is_bounded_lru(s3, small_corpus, tmp_path, monkeypatch):
    a = machine(tmp_path, "a")
    one = a.ingest(str(small_corpus), name="one")
    other = small_corpus.parent / "two"
    other.mkdir()
    (other / "x.md").write_text("The ferry leaves at noon from the north pier.\n")
    two = a.ingest(str(other), name="two")
    want = a.answer(Query("one", Q, max_tokens=6)).token_ids
    monkeypatch.setenv("CAG_STORE_CACHE_BYTES", str(one.bytes + 1))  # room for one blob
    b = machine(tmp_path, "b")
    cached = lambda: sorted(p.stem for p in (tmp_path / "b" / "snapshots").glob("*.safetensors"))  # noqa: E731
    b.answer(Query("one", Q, max_tokens=6))
    assert cached() == [one.snapshot]
    b.answer(Query("two", Q, max_tokens=6))
    assert cached() == [two.snapshot]  # the least recently used blob made room
    b = machine(tmp_path, "b")  # a new process: nothing resident in memory
    assert b.answer(Query("one", Q, max_tokens=6)).token_ids == want  # fetched again, verified again
    assert cached() == [one.snapshot]


def test_reindex_rebuilds_the_index_from_the_store(s3, small_corpus, tmp_path):
    a = machine(tmp_path, "a")
    r = a.ingest(str(small_corpus), name="corpus")
    out = cli(tmp_path / "b", "reindex", "--json")
    assert out.exit_code == 0 and json.loads(out.stdout)["store_corpora"] == ["corpus"]
    listed = json.loads(cli(tmp_path / "b", "list", "--json").stdout)["corpora"]
    assert [(c["name"], c["snapshot"], c["stale"]) for c in listed] == [("corpus", r.snapshot, False)]


def test_int8_snapshots_travel_through_the_store(s3, small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("CAG_KV_DTYPE", "int8")
    a, b = machine(tmp_path, "a"), machine(tmp_path, "b")
    r = a.ingest(str(small_corpus), name="corpus")
    assert RemoteStore(URL).read_header(r.snapshot)[0]["dtype"] == "int8"
    assert b.answer(Query("corpus", Q, max_tokens=8)).token_ids == a.answer(Query("corpus", Q, max_tokens=8)).token_ids


def test_of_two_ingests_racing_on_one_corpus_the_second_is_refused_not_lost(s3, small_corpus, tmp_path):
    from cag.knowledge import ingest as steps

    a, c = machine(tmp_path, "a"), machine(tmp_path, "c")
    first = a.ingest(str(small_corpus), name="corpus")
    (small_corpus / "c.md").write_text("The bakery on Quay Street sells rye bread on Fridays now.\n")
    # c reads the ref: generation 1
    plan = steps.read(c.index, c.remote, c.settings, "corpus", small_corpus, None, None)
    steps.pack_shards(c.snapshots(), plan)
    (small_corpus / "b.txt").write_text("The ferry leaves the harbour at 9:00 now.\n")
    won = a.ingest("corpus")  # a publishes generation 2 meanwhile
    built = [steps.build(c.snapshots(), plan, s, 0, None, None) for s in plan.shards]
    with pytest.raises(StoreConflict, match="published by another ingest meanwhile"):
        steps.publish(c.snapshots(), plan, built)
    ref = RemoteStore(URL).get_ref("corpus")
    assert ref.shards == [won.snapshot] and ref.generation == 2  # a's update is not lost
    assert [r["snapshot"] for r in c.index.shards("corpus")] == [first.snapshot]  # c did not publish locally either
    again = c.ingest("corpus")  # c's next ingest adopts a's ref first, and finds it current
    assert again.status == "fresh" and again.snapshot == won.snapshot
    assert RemoteStore(URL).get_ref("corpus").shards == [won.snapshot]


def test_the_store_flag_and_a_bad_store_url(s3, small_corpus, tmp_path, monkeypatch):
    monkeypatch.delenv("CAG_STORE")
    out = cli(tmp_path / "a", "ingest", str(small_corpus), "--name", "corpus", "--store", URL, "--json")
    assert out.exit_code == 0, out.stderr
    digest = json.loads(out.stdout)["snapshot"]
    assert blobs() == {digest}
    asked = cli(tmp_path / "b", "ask", "corpus", Q, "--max-tokens", "4", "--store", URL, "--json")
    assert asked.exit_code == 0 and json.loads(asked.stdout)["snapshot"] == digest
    assert cli(tmp_path / "c", "ask", "corpus", Q).exit_code == 1  # no store: c knows no such corpus
    bad = cli(tmp_path / "c", "ask", "corpus", Q, "--store", "http://not-s3/x")
    assert bad.exit_code == 1 and bad.stderr.strip() == (
        "error: bad setting store='http://not-s3/x': use s3://bucket or s3://bucket/prefix (unset: snapshots stay in "
        "CAG_HOME)"
    )


def test_a_damaged_cache_file_is_refused_then_fetched_again_from_the_store(s3, small_corpus, tmp_path):
    a = machine(tmp_path, "a")
    r = a.ingest(str(small_corpus), name="corpus")
    want = machine(tmp_path, "b").answer(Query("corpus", Q, max_tokens=8)).token_ids
    cached = tmp_path / "b" / "snapshots" / f"{r.snapshot}.safetensors"
    data = bytearray(cached.read_bytes())
    data[-10] ^= 0xFF
    cached.write_bytes(bytes(data))
    b = machine(tmp_path, "b")
    with pytest.raises(SnapshotCorrupt, match="checksum"):
        b.answer(Query("corpus", Q, max_tokens=8))  # never served
    # the next question fetches the store's copy
    healed = machine(tmp_path, "b").answer(Query("corpus", Q, max_tokens=8))
    assert healed.token_ids == want
    assert cached.read_bytes() == RemoteStore(URL).fs.cat(f"cag-test/{RemoteStore(URL).blob_key(r.snapshot)}")
    assert machine(tmp_path, "b").index.snapshot(r.snapshot)["status"] == "ready"
