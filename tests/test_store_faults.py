"""Store and snapshot faults of issue 55 (E5, E6, E9, E11, E12): a full disk in safetensors 0.8's
words, gc racing a write, a damaged blob that kept its digest metadata, and bad refs in the store.

The shared-store cases run against the real S3 server (moto's, on loopback) of tests/test_store.py.
A full disk is injected at the write seam of `snapshots.save` (safetensors' `save_file`), raising
safetensors' own error class with the text safetensors 0.8 gives on ENOSPC (a small filesystem
needs root to mount).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from cag.answering.query import Query
from cag.errors import SnapshotCorrupt, StorageFull, StoreCorrupt
from cag.store import snapshots
from cag.store.remote import RemoteStore
from tests.test_api import app_client, wait_job
from tests.test_faults_store import EDIT, cag, one_line_error, snapshot_path
from tests.test_store import URL, Q, cli, machine, s3  # noqa: F401 - s3: the fixture, used by name

# what safetensors 0.8 raises when the disk fills during save_file (its Rust io::Error, displayed)
ENOSPC_08 = "Error while serializing: I/O error: No space left on device (os error 28)"


# -- E5: a full disk in safetensors 0.8's words ---------------------------------------------------------
def _full_disk_08(tensors, filename, metadata=None):
    from safetensors import SafetensorError

    with open(filename, "wb") as f:  # what the writer got onto the disk before it filled
        f.write(b"\0" * 4096)
    raise SafetensorError(ENOSPC_08)


def test_a_full_disk_in_safetensors_08_words_is_one_line_and_507(tiny_engine, small_corpus, monkeypatch):
    r = tiny_engine.ingest(str(small_corpus), name="corpus")
    want = tiny_engine.answer(Query("corpus", Q, max_tokens=8)).token_ids
    folder = snapshot_path(Path(os.environ["CAG_HOME"]), r.snapshot).parent
    (small_corpus / "c.md").write_text(EDIT)
    monkeypatch.setattr(snapshots, "save_file", _full_disk_08)

    line = one_line_error(cag("ingest", "corpus"), StorageFull.exit_code, "No space left on device", "snapshot")
    assert "free space" in line
    assert sorted(p.name for p in folder.iterdir()) == [f"{r.snapshot}.safetensors"]  # no partial file left
    assert tiny_engine.index.corpus("corpus")["current_snapshot"] == r.snapshot
    tiny_engine.evict()
    assert tiny_engine.answer(Query("corpus", Q, max_tokens=8)).token_ids == want  # the old snapshot still answers

    with app_client(tiny_engine) as c:
        job = wait_job(c, c.post("/v1/corpora/corpus/refresh").json())
        assert job["status"] == "failed" and job["error"]["code"] == StorageFull.code, job
        assert job["error"]["status"] == StorageFull.http_status == 507


def test_other_io_errors_of_safetensors_08_are_one_line_too(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from cag.errors import IndexUnusable

    def lost_temp(tensors, filename, metadata=None):  # gc deleted the writer's temp file (E6's symptom)
        raise SafetensorError("Error while serializing: I/O error: No such file or directory (os error 2)")

    monkeypatch.setattr(snapshots, "save_file", lost_temp)
    with pytest.raises(IndexUnusable, match="No such file or directory"):
        snapshots.save(tmp_path / "s.safetensors", [], [1, 2], {"key": "k"}, torch.float16)
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_a_disk_with_room_for_the_tensors_but_not_the_header(tmp_path, monkeypatch):
    kv = [(torch.zeros(1, 2, 64, 8), torch.zeros(1, 2, 64, 8)) for _ in range(2)]
    ids = list(range(64))
    meta = {"key": "k", "spans": [{"path": "a" * 300 + ".md", "content_hash": "h" * 64, "start": 0, "end": 64}]}
    tensors = snapshots.expected_bytes(2, 2, 8, torch.float16, 64) + 4 * len(ids)  # KV and token ids, no header
    real = shutil.disk_usage
    room = {"free": tensors + 64}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=room["free"]))
    with pytest.raises(StorageFull, match="free space"):
        snapshots.save(tmp_path / "s.safetensors", kv, ids, meta, torch.float16)
    assert list(tmp_path.iterdir()) == []  # refused before a byte was written
    room["free"] = 10**9
    size = snapshots.save(tmp_path / "s.safetensors", kv, ids, meta, torch.float16)
    assert size > tensors + 64  # the header is what the first refusal counted


# -- E6: gc and a temp file being written -------------------------------------------------------------
def test_gc_leaves_a_young_library_temp_file_and_deletes_an_old_one(tmp_path):
    folder = Path(os.environ["CAG_HOME"]) / "snapshots"
    folder.mkdir(parents=True)
    young, old = folder / ".tmpABC123", folder / ".tmpOLD456"
    for p in (young, old):
        p.write_bytes(b"\0" * 100)
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    ours = folder / f".{'d' * 32}.safetensors.{os.getpid()}.tmp"  # cag's own temp name: its writer runs
    ours.write_bytes(b"\0")
    os.utime(ours, (two_hours_ago, two_hours_ago))

    out = cag("gc", "--json")
    assert out.exit_code == 0, out.output
    r = json.loads(out.stdout)
    assert young.exists() and ours.exists() and not old.exists()
    assert [d["digest"] for d in r["deleted"]] == [old.name]
    kept = {k["digest"]: k["why"] for k in r["kept"]}
    assert "written" in kept[young.name] and str(os.getpid()) in kept[ours.name]


# -- E9: a damaged blob that kept its blake3 metadata ---------------------------------------------------
def _flip_keeping_metadata(store: RemoteStore, digest: str) -> None:
    key = store.blob_key(digest)
    meta = store._call("head_object", Key=key)["Metadata"]
    data = bytearray(store.fs.cat(f"{store.bucket}/{key}"))
    data[-10] ^= 0xFF  # same size, parseable, wrong checksum; the blake3 claim copied over
    store._call("put_object", Key=key, Body=bytes(data), Metadata=meta)
    assert store.blob_head(digest)[1] == meta["blake3"]


@pytest.mark.usefixtures("s3")
def test_a_damaged_blob_that_kept_its_digest_is_healed_by_the_command_its_error_names(small_corpus, tmp_path):
    store = RemoteStore(URL)
    a = machine(tmp_path, "a")
    r = a.ingest(str(small_corpus), name="corpus")
    want = json.loads(cli(tmp_path / "a", "ask", "corpus", Q, "--max-tokens", "6", "--json").stdout)["answer"]
    _flip_keeping_metadata(store, r.snapshot)

    line = one_line_error(cli(tmp_path / "b", "ask", "corpus", Q, "--max-tokens", "6"), SnapshotCorrupt.exit_code,
                          "failed verification", "checksum")
    command = line.split("run `", 1)[1].split("`", 1)[0]
    assert command.startswith("cag ingest corpus"), line
    assert store._exists(store.failed_key(r.snapshot))  # b's report: the blob's own claim is not trusted now
    healed = cli(tmp_path / "a", *command.split()[1:])  # on the machine that holds a good copy
    assert healed.exit_code == 0, (healed.stderr, healed.exception)
    assert (
        store.fs.cat(f"{store.bucket}/{store.blob_key(r.snapshot)}")
        == snapshot_path(tmp_path / "a", r.snapshot).read_bytes()
    )
    assert not store._exists(store.failed_key(r.snapshot))  # answered: the next ingest skips the upload again
    fresh = cli(tmp_path / "c", "ask", "corpus", Q, "--max-tokens", "6", "--json")  # a machine that never saw it
    assert fresh.exit_code == 0, fresh.stderr
    assert json.loads(fresh.stdout)["answer"] == want


# -- E11, E12: bad refs in the store and `cag reindex` ----------------------------------------------------
BAD_NAMES = [".hidden", "a b ", "evil\u202eline", "x\ty"]


def _two_corpora_and(tmp_path, small_corpus, bad: dict[str, dict | bytes]) -> tuple[RemoteStore, str]:
    """alpha and beta ingested on machine a, then `bad` refs (name -> body, or raw bytes) in the store."""
    store = RemoteStore(URL)
    a = machine(tmp_path, "a")
    r = a.ingest(str(small_corpus), name="alpha")
    a.ingest(str(small_corpus), name="beta")
    body = store.get_ref("alpha").body
    for name, edit in bad.items():
        data = edit if isinstance(edit, bytes) else json.dumps(dict(body, corpus=name, **edit)).encode()
        store.fs.pipe(f"{store.bucket}/{store.ref_key(name)}", data)
    return store, r.snapshot


def _reindex(home: Path, refused: set[str]) -> dict[str, str]:
    """`cag reindex` on a fresh machine: alpha and beta adopted, exactly `refused` reported (name -> why)."""
    out = cli(home, "reindex", "--json")
    assert out.exit_code == 0, (out.stderr, out.exception)
    got = json.loads(out.stdout)
    assert got["store_corpora"] == ["alpha", "beta"]
    why = {x["corpus"]: x["why"] for x in got["store_refused"]}
    assert set(why) == refused, why
    listed = json.loads(cli(home, "list", "--json").stdout)["corpora"]
    assert [c["name"] for c in listed] == ["alpha", "beta"]
    assert cli(home, "ask", "alpha", Q, "--max-tokens", "4").exit_code == 0
    human = cli(home.with_name(home.name + "-human"), "reindex")
    assert human.exit_code == 0 and "alpha, beta" in human.stdout, human.output
    errs = human.stderr.strip().splitlines()
    assert len(errs) == len(refused) and all(e.startswith("store ref refused, not adopted: ") for e in errs), errs
    return why


@pytest.mark.usefixtures("s3")
def test_reindex_adopts_the_sound_refs_and_reports_a_corrupt_one(small_corpus, tmp_path):
    _two_corpora_and(tmp_path, small_corpus, {
        "trav": {"shards": ["../../refs/alpha"]},  # a traversal in its shards: a corrupt ref
        "gone": {"shards": ["f" * 32]},  # names a blob the store lacks
        "junk": b"{not json",
    })
    why = _reindex(tmp_path / "b", {"trav", "gone", "junk"})
    assert "corrupt" in why["trav"] and "corrupt" in why["junk"] and "missing from the store" in why["gone"]


BAD_NAMES = [".hidden", "a b ", "evil\u202eline", "x\ty"]


@pytest.mark.usefixtures("s3")
def test_refs_whose_names_break_the_naming_rules_are_refused(small_corpus, tmp_path):
    store, digest = _two_corpora_and(tmp_path, small_corpus, {name: {} for name in BAD_NAMES})
    why = _reindex(tmp_path / "b", set(BAD_NAMES))
    for name in BAD_NAMES:
        assert "invalid corpus name" in why[name], why[name]
    human = cli(tmp_path / "c", "reindex")
    assert "\u202e" not in human.stderr and "\\u202e" in human.stderr  # escaped for the terminal
    # a question on such a name is refused as well, not adopted; gc still counts its shards as named
    one_line_error(cli(tmp_path / "d", "ask", ".hidden", Q), StoreCorrupt.exit_code, "invalid corpus name")
    assert cli(tmp_path / "d", "gc").exit_code == 0 and digest in {b["digest"] for b in store.blobs()}
