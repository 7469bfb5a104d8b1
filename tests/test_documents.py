"""Reading corpus documents: supported types, skipped files, and each kind of bad file."""

from __future__ import annotations

import io

import pytest

from cag.errors import BadInput
from cag.knowledge import documents


def test_scan_is_sorted_recursive_and_reports_skipped(tmp_path):
    (tmp_path / "b.md").write_text("b")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("a")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / ".hidden.md").write_text("secret")
    keep, skipped = documents.scan(tmp_path)
    assert [e.name for e in keep] == ["b.md", "sub/a.txt"]
    assert skipped == ["image.png"]


def test_html_text_is_extracted_without_markup_or_scripts():
    html = (
        b"<html><head><title>T</title><script>var x=1;</script></head>"
        b"<body><h1>Hours</h1><p>Open <b>9</b> to 5.</p></body></html>"
    )
    text = documents.extract("page.html", ".html", html)
    assert "Hours" in text and "9" in text and "<" not in text and "var x" not in text


def test_undecodable_text_names_the_file_and_offset():
    with pytest.raises(BadInput, match=r"notes.txt: not valid UTF-8 \(byte 0xff at offset 3\)"):
        documents.extract("notes.txt", ".txt", b"abc\xffdef")


def _pdf_bytes(encrypt: bool = False) -> bytes:
    from pypdf import PdfWriter

    w = PdfWriter()
    w.add_blank_page(width=200, height=200)
    if encrypt:
        w.encrypt("secret")
    buf = io.BytesIO()
    w.write(buf)
    return buf.getvalue()


def test_pdf_encrypted_and_broken_are_refused():
    assert documents.extract("ok.pdf", ".pdf", _pdf_bytes()) == ""
    with pytest.raises(BadInput, match="ok.pdf: PDF is encrypted"):
        documents.extract("ok.pdf", ".pdf", _pdf_bytes(encrypt=True))
    with pytest.raises(BadInput, match="bad.pdf: broken PDF"):
        documents.extract("bad.pdf", ".pdf", b"%PDF-1.4\nthis is not a pdf at all")


def test_content_hash_reuses_known_hash_only_when_size_and_mtime_match(tmp_path):
    p = tmp_path / "a.md"
    p.write_text("one")
    (entry,), _ = documents.scan(tmp_path)
    real = documents.content_hash(entry, None)
    known = {"size": entry.size, "mtime": entry.mtime, "content_hash": "sha256:cached"}
    assert documents.content_hash(entry, known) == "sha256:cached"
    assert documents.content_hash(entry, dict(known, mtime=0.0)) == real
