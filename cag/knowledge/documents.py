"""Find and read corpus documents: .txt/.md as UTF-8, .html as extracted text, .pdf via pypdf.

Reading fails loudly (BadInput naming the file) rather than guessing: a silently mangled
document would be cached and served for as long as the snapshot lives.

Links: a file symlink is read when its target lies inside the corpus folder; one that leads out of
it (to /etc/passwd, to another folder) is skipped and reported by name, as is a broken one, so a
corpus holds what its folder holds and `cag ask` never quotes a file from elsewhere. Folder symlinks
are not followed. A file given as the corpus itself is read wherever it is.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from cag.errors import BadInput, TooLarge
from cag.hashing import hash_bytes
from cag.results import human_bytes

TEXT = {".txt", ".md", ".markdown", ".rst"}
HTML = {".html", ".htm"}
PDF = {".pdf"}
SUPPORTED = TEXT | HTML | PDF


@dataclass
class FileEntry:
    name: str  # path relative to the corpus root, posix form: the document's identity
    path: Path  # what is read: the file, or the target of a link inside the corpus folder
    size: int
    mtime: float


@dataclass
class Document:
    name: str
    text: str
    content_hash: str  # sha256 of the raw file bytes
    size: int
    mtime: float


def scan(root: Path) -> tuple[list[FileEntry], list[str]]:
    """Supported files under root in a stable (sorted) order, and the names of skipped ones (with why,
    when it is not their type: links out of the folder, broken links)."""
    if root.is_file():
        files, base = [root], root.parent
    else:
        files = sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink())
        base = root
    inside = base.resolve()
    keep, skipped = [], []
    for p in files:
        rel = p.relative_to(base).as_posix()
        if any(part.startswith(".") for part in Path(rel).parts):
            continue  # hidden files and folders (.git, editor swap files) are not knowledge
        path = p
        if p is not root:  # what it resolves to must stay in the folder (a link, or a path through one)
            path = p.resolve()
            if path.is_dir():
                continue  # a folder link: not followed
            if not path.is_file():
                skipped.append(f"{rel} (a broken link)")
                continue
            if not path.is_relative_to(inside):
                skipped.append(f"{rel} (a link to a file outside the corpus folder: not read)")
                continue
        if path.suffix.lower() in SUPPORTED:
            st = path.stat()
            keep.append(FileEntry(rel, path, st.st_size, st.st_mtime))
        else:
            skipped.append(rel)
    return keep, skipped


def extract(name: str, suffix: str, data: bytes) -> str:
    suffix = suffix.lower()
    if suffix in TEXT:
        try:
            return data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise BadInput(f"{name}: not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    if suffix in HTML:
        from bs4 import BeautifulSoup

        soup = BeautifulSoup(data, "html.parser")
        for tag in soup(["script", "style", "noscript"]):
            tag.decompose()
        lines = (line.strip() for line in soup.get_text("\n").splitlines())
        return "\n".join(line for line in lines if line)
    if suffix in PDF:
        return _pdf_text(name, data)
    raise BadInput(f"{name}: unsupported file type {suffix!r}")


def _pdf_text(name: str, data: bytes) -> str:
    import io

    from pypdf import PdfReader
    from pypdf.errors import PdfReadError

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # it warns on every minor defect
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise BadInput(f"{name}: PDF is encrypted; decrypt it first")
        return "\n".join(page.extract_text() or "" for page in reader.pages)
    except BadInput:
        raise
    except (PdfReadError, ValueError, KeyError, TypeError, OSError) as e:
        raise BadInput(f"{name}: broken PDF ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def read(entry: FileEntry, max_bytes: int | None = None) -> Document:
    """The document, reading at most `max_bytes` (TooLarge past it: a file that grew since the scan)."""
    with open(entry.path, "rb") as f:
        data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise too_large(entry.name, max_bytes, max_bytes, more=True)
    text = extract(entry.name, entry.path.suffix, data)
    return Document(entry.name, text, hash_bytes(data), entry.size, entry.mtime)


def too_large(name: str, size: int, limit: int, more: bool = False) -> TooLarge:
    return TooLarge(
        f"{name} is {'over ' if more else ''}{human_bytes(size)}; one document may be at most {human_bytes(limit)} "
        f"(CAG_MAX_DOCUMENT_BYTES={limit}): raise it to ingest this file, or split the file"
    )


def content_hash(entry: FileEntry, known: dict | None) -> str:
    """Hash of the file, reusing the known hash when size and mtime are unchanged (read in blocks:
    memory stays bounded whatever the file's size)."""
    if known and known.get("size") == entry.size and known.get("mtime") == entry.mtime:
        return known["content_hash"]
    h = hashlib.sha256()
    with open(entry.path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return "sha256:" + h.hexdigest()
