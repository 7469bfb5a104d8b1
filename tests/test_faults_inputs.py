"""Hostile or careless corpus inputs (issue 29): links out of the corpus folder, inputs too large to
finish, control characters in file names. Each test failed on the code before its fix."""

from __future__ import annotations

import json
import re

import pytest

from cag.knowledge import documents

from .test_cli import cag


# -- 6: file links that leave the corpus folder ---------------------------------------------------
@pytest.fixture
def linked(tmp_path, small_corpus):
    """The small corpus plus: a link to a file inside it (read), links to a file in another folder
    and to /etc/passwd (skipped), a broken link (skipped), a link to a folder (not followed)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.md").write_text("The vault code is 4711.\n")
    (small_corpus / "inside.md").symlink_to(small_corpus / "a.md")
    (small_corpus / "outside.md").symlink_to(elsewhere / "secret.md")
    (small_corpus / "passwd.txt").symlink_to("/etc/passwd")
    (small_corpus / "broken.md").symlink_to(tmp_path / "gone.md")
    (small_corpus / "folder").symlink_to(elsewhere, target_is_directory=True)
    return small_corpus


OUT = "(a link to a file outside the corpus folder: not read)"


def test_scan_reads_links_inside_the_folder_and_skips_those_that_leave_it(linked):
    keep, skipped = documents.scan(linked)
    assert [e.name for e in keep] == ["a.md", "b.txt", "c.md", "inside.md"]
    assert sorted(skipped) == ["broken.md (a broken link)", f"outside.md {OUT}", f"passwd.txt {OUT}"]
    assert next(e for e in keep if e.name == "inside.md").path == (linked / "a.md").resolve()


def test_ingest_skips_links_out_of_the_folder_with_a_line_each(tiny, linked):
    r = cag("ingest", str(linked), "--name", "town")
    assert r.exit_code == 0, r.output
    assert f"skipped: outside.md {OUT}" in r.stderr.splitlines()
    assert f"skipped: passwd.txt {OUT}" in r.stderr.splitlines()
    j = json.loads(cag("ingest", str(linked), "--name", "town", "--json", "--force").stdout)
    assert f"outside.md {OUT}" in j["skipped"] and f"passwd.txt {OUT}" in j["skipped"]
    from cag.config import get_settings
    from cag.store.index import Index

    names = {d["path"] for d in Index(get_settings().index_path).documents("town")}
    assert names == {"a.md", "b.txt", "c.md", "inside.md"}  # nothing of /etc/passwd or the other folder
    status = json.loads(cag("status", "town", "--json").stdout)
    assert not status["stale"], status  # skipped links are not "added" documents either


# -- 7: inputs too large to finish ----------------------------------------------------------------
def test_a_document_over_the_limit_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """The 50 MB file: tokenized in one call (7.5 GB) with nothing printed. Here a 3 MB file at a
    1 MiB limit, with a model that does not exist: the size is refused first, in one line."""
    root = tmp_path / "big"
    root.mkdir()
    (root / "small.md").write_text("A small note.\n")
    (root / "huge.txt").write_text("All work and no play makes Jack a dull boy. " * 70_000)  # ~3 MB
    monkeypatch.setenv("CAG_MODEL", str(tmp_path / "no-such-model"))
    monkeypatch.setenv("CAG_MAX_DOCUMENT_BYTES", str(1024**2))
    r = cag("ingest", str(root))
    assert r.exit_code == 1, r.output
    assert r.stderr.splitlines() == [
        "error: huge.txt is 2.9 MiB; one document may be at most 1.0 MiB (CAG_MAX_DOCUMENT_BYTES=1048576): "
        "raise it to ingest this file, or split the file"]
    monkeypatch.setenv("CAG_MAX_DOCUMENT_BYTES", str(4 * 1024**2))
    monkeypatch.setenv("CAG_MAX_CORPUS_BYTES", str(2 * 1024**2))
    r = cag("ingest", str(root), "--json")
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1, r.output
    assert re.fullmatch(
        r"error: \S+ holds 2\.9 MiB in 2 documents; a corpus may be at most 2\.0 MiB "
        r"\(CAG_MAX_CORPUS_BYTES=2097152\): raise it, or ingest a part of it",
        r.stderr.strip(),
    ), r.stderr


@pytest.mark.parametrize("var", ["CAG_MAX_DOCUMENT_BYTES", "CAG_MAX_CORPUS_BYTES"])
@pytest.mark.parametrize("value", ["0", "-5", "lots"])
def test_input_limits_are_validated_settings(var, value, monkeypatch, small_corpus):
    monkeypatch.setenv(var, value)
    r = cag("ingest", str(small_corpus))
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1 and f"bad setting {var}={value!r}" in r.stderr, r.output


def test_a_file_that_grows_past_the_limit_after_the_scan_is_not_read_whole(tmp_path):
    f = tmp_path / "grows.txt"
    f.write_text("x" * 100)
    entry = documents.scan(tmp_path)[0][0]
    f.write_text("x" * 5000)
    from cag.errors import TooLarge

    with pytest.raises(TooLarge, match=r"grows.txt is over 1000 B; one document may be at most 1000 B"):
        documents.read(entry, max_bytes=1000)


def test_long_text_is_tokenized_in_bounded_pieces_with_the_same_tokens(tiny_model_dir):
    """One call over megabytes held ~150 bytes per character; pieces of at most PIECE_CHARS give the
    very tokens of one call (cut before " word"), so cag == full and snapshot keys are unchanged for
    any document up to a piece."""
    from transformers import AutoTokenizer

    from cag.model.prompt import PIECE_CHARS, encode_text, pieces

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = ("The ferry leaves at 7:15.\n\n  Two  spaces,\ttabs; <|im_end|> 12345 über naïve.\n" * 8000)
    cut = pieces(text)
    assert len(cut) > 4 and all(len(p) <= PIECE_CHARS for p in cut) and "".join(cut) == text
    assert all(p.startswith(" ") and not p[1].isspace() for p in cut[1:])
    one = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    ticks = []
    assert encode_text(tok, text, ticks.append) == one
    assert sum(ticks) == len(text) and len(ticks) == len(cut)
    assert pieces("a" * (3 * PIECE_CHARS)) == ["a" * PIECE_CHARS] * 3  # no word boundary: cut at the size


def test_cutting_a_long_document_gives_the_parts_of_exact_counting(tiny_model_dir):
    """A document longer than a shard was cut by tokenizing the growing part again for every piece
    (48 s a megabyte here); now each piece is counted once: the parts must be what exact counting gives."""
    from transformers import AutoTokenizer

    from cag.knowledge import shards
    from cag.model.prompt import document_text, encode_text

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    count = lambda s: len(encode_text(tok, s))  # noqa: E731

    def exact(name, text, capacity):  # the cut before, piece by piece
        room = max(1, capacity - count(document_text(f"{name}{shards.PART}9999", "")) - 2)
        pieces = []
        for para in re.split(r"\n\s*\n", text):
            if not para.strip():
                continue
            if count(para) <= room:
                pieces.append((para, False))
                continue
            for sent in re.split(r"(?<=[.!?])\s+", para):
                if count(sent) <= room:
                    pieces.append((sent, False))
                    continue
                ids = encode_text(tok, sent)
                pieces += [(tok.decode(ids[i : i + room]), True) for i in range(0, len(ids), room)]
        parts = []
        for piece, by_tokens in pieces:
            if parts and count(parts[-1][0] + "\n\n" + piece) <= room:
                parts[-1] = (parts[-1][0] + "\n\n" + piece, parts[-1][1] or by_tokens)
            else:
                parts.append((piece, by_tokens))
        return parts

    texts = [
        "\n\n".join(f"Paragraph {i} tells how the harbour wall was repaired in year {1900 + i}." for i in range(300)),
        "\n\n\n  \n".join(f"Note {i}: the bakery sells rye.  Then   more!  And {i * 7}?" for i in range(200)),
        " ".join(f"word{i} and" for i in range(1500)),
    ]
    for capacity in (60, 300, 1000):
        for text in texts:
            assert shards._cut(tok, "x.md", text, capacity) == exact("x.md", text, capacity), capacity


def test_progress_is_reported_from_the_start(tiny_engine, small_corpus):
    """Reading, then tokenizing (characters, as they are done), then the estimate and prefill."""
    from cag.results import Reporter

    seen = []

    class Recorder(Reporter):
        def reading(self, n_documents, n_bytes):
            seen.append(("reading", n_documents, n_bytes))

        def tokenizing(self, n_chars):
            seen.append(("tokenizing", n_chars))
            return lambda n: seen.append(("tick", n))

        def tokenized(self):
            seen.append(("tokenized",))

        def estimate(self, n_tokens, n_bytes, reused):
            seen.append(("estimate",))

    tiny_engine.ingest(str(small_corpus), name="town", reporter=Recorder())
    size = sum(p.stat().st_size for p in small_corpus.iterdir())
    assert seen[0] == ("reading", 3, size)
    chars = seen[1][1]
    assert seen[1][0] == "tokenizing" and chars == sum(len(p.read_text()) for p in small_corpus.iterdir())
    ticks = [e[1] for e in seen if e[0] == "tick"]
    assert sum(ticks) >= chars and [e[0] for e in seen[-2:]] == ["tokenized", "estimate"]


def test_the_cli_says_what_it_reads_when_it_is_big(capsys):
    from cag.cli.common import _TqdmReporter

    r = _TqdmReporter(quiet=False)
    r.reading(3, 200)
    assert r.tokenizing(200) is None  # small: no extra output
    r.reading(1, 50 * 1024**2)
    tick = r.tokenizing(50 * 1024**2)
    tick(1000)
    r.tokenized()
    assert capsys.readouterr().err.splitlines()[0] == "reading 1 document (50.0 MiB), then tokenizing them"
    _TqdmReporter(quiet=True).reading(1, 50 * 1024**2)
    assert capsys.readouterr().err == ""


def test_snapshots_that_cannot_fit_on_the_disk_are_refused_before_prefill(tiny, small_corpus, monkeypatch):
    import shutil

    from cag.knowledge import ingest
    from cag.runtime import kv_cache

    monkeypatch.setattr(ingest.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    monkeypatch.setattr(kv_cache, "prefill", lambda *a, **k: pytest.fail("prefilled a corpus that cannot be saved"))
    r = cag("ingest", str(small_corpus), "--name", "town")
    assert r.exit_code == 1, r.output
    assert re.fullmatch(
        r"error: the knowledge of 'town' is \d+ tokens in 1 shard\(s\): its snapshots need ~[\d.]+ KiB and "
        r"\S+ has 1000 B free; free space, or ingest less",
        r.stderr.strip(),
    ), r.stderr


def test_the_room_estimate_counts_the_snapshot_header_too(tiny, small_corpus, monkeypatch, tmp_path):
    """Issue 55 E5: free space for the K/V formula alone, not for the file's header (ids, spans, metadata):
    refused before the prefill, not by the write after it."""
    import shutil

    from cag.config import get_settings
    from cag.engine import Engine
    from cag.knowledge import ingest
    from cag.runtime import kv_cache

    engine = Engine(get_settings())
    n = engine.ingest(str(small_corpus), name="probe").n_tokens
    free = engine.lm.kv_bytes(n, engine.kv_dtype) + 64  # the tensors fit, the header does not
    monkeypatch.setenv("CAG_HOME", str(tmp_path / "other-home"))
    monkeypatch.setattr(ingest.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - free, free))
    monkeypatch.setattr(
        kv_cache, "prefill_knowledge", lambda *a, **k: pytest.fail("prefilled a corpus that cannot be saved")
    )
    r = cag("ingest", str(small_corpus), "--name", "town")
    assert r.exit_code == 1 and "free space, or ingest less" in r.stderr, r.output


# -- 8: control characters in file names ----------------------------------------------------------
def test_control_characters_in_names_are_escaped_in_human_output(tiny, small_corpus):
    forged = "x\nforged: fresh, snapshot 000000000000, 0 docs.md"
    (small_corpus / forged).write_text("Nothing here.\n")
    (small_corpus / "bell\x07\x1b[2J.md").write_text("Nothing here either.\n")
    r = cag("ingest", str(small_corpus), "--name", "town")
    assert r.exit_code == 0, r.output
    (small_corpus / forged).write_text("Changed.\n")
    (small_corpus / "bell\x07\x1b[2J.md").write_text("Changed too.\n")
    r = cag("status", "town")
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and lines[2].startswith("  stale: documents changed: "), lines  # name, source, one reason
    assert "x\\nforged: fresh" in lines[2] and "bell\\x07\\x1b[2J.md" in lines[2]
    assert not any(ch in r.stdout.replace("\n", "") for ch in "\x07\x1b")
    raw = json.loads(cag("status", "town", "--json").stdout)
    assert any(forged in reason for reason in raw["reasons"])  # --json keeps the names as they are
    assert cag("list").stdout.count("\n") == 1
