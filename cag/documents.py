"""Find and read corpus documents: .txt/.md as UTF-8, .html as extracted text, .pdf via pypdf.

Reading fails loudly (BadInput naming the file) rather than guessing: a silently mangled
document would be cached and served for as long as the snapshot lives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from .errors import BadInput
from .hashing import hash_bytes

TEXT = {".txt", ".md", ".markdown", ".rst"}
HTML = {".html", ".htm"}
PDF = {".pdf"}
SUPPORTED = TEXT | HTML | PDF


@dataclass
class FileEntry:
    name: str  # path relative to the corpus root, posix form: the document's identity
    path: Path
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
    """Supported files under root in a stable (sorted) order, and the names of skipped ones."""
    if root.is_file():
        files, base = [root], root.parent
    else:
        files = sorted(p for p in root.rglob("*") if p.is_file())
        base = root
    keep, skipped = [], []
    for p in files:
        rel = p.relative_to(base).as_posix()
        if any(part.startswith(".") for part in Path(rel).parts):
            continue  # hidden files and folders (.git, editor swap files) are not knowledge
        if p.suffix.lower() in SUPPORTED:
            st = p.stat()
            keep.append(FileEntry(rel, p, st.st_size, st.st_mtime))
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


def read(entry: FileEntry) -> Document:
    data = entry.path.read_bytes()
    text = extract(entry.name, entry.path.suffix, data)
    return Document(entry.name, text, hash_bytes(data), entry.size, entry.mtime)


def content_hash(entry: FileEntry, known: dict | None) -> str:
    """Hash of the file, reusing the known hash when size and mtime are unchanged."""
    if known and known.get("size") == entry.size and known.get("mtime") == entry.mtime:
        return known["content_hash"]
    return hash_bytes(entry.path.read_bytes())
