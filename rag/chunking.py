"""Split documents into retrieval passages of a bounded token size.

The RAG baseline retrieves passages, not whole documents, so every document is
cut into pieces small enough that top-k of them fit a prompt. Cuts prefer the
most natural boundary available: paragraph, then line, then sentence, then
word. Text is never cut inside a word, so a single word longer than the target
(a URL, a long number) becomes a passage of its own and is the only case where
a passage exceeds ``target_tokens``.

Passages keep exact character offsets into their source document, so
``doc_text[p.start_char:p.end_char] == p.text`` always holds; that lets the
evaluation map a retrieved passage back to its document and check gold hits.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_TARGET_TOKENS = 384
"""Default passage size: inside the 256-512 token range usual for RAG, large
enough to hold a SQuAD paragraph whole, small enough that top-5 stays short."""


@dataclass(frozen=True)
class Passage:
    """One retrievable piece of a document.

    ``index`` numbers the passages of one document from 0; ``n_tokens`` is
    ``count_tokens(text)`` with the counter given to :func:`chunk_documents`.
    """

    doc_id: str
    index: int
    text: str
    n_tokens: int
    start_char: int
    end_char: int


# Boundary patterns from coarsest to finest. Each one matches the separator
# *between* two pieces; the pieces themselves are what lies between matches.
# The sentence rule splits after ., ! or ? (optionally followed by a closing
# quote or bracket) when whitespace follows: it misfires on "e.g. x", which only
# costs a slightly earlier cut, never a cut inside a word.
_BOUNDARIES: tuple[re.Pattern[str], ...] = (
    re.compile(r"\n[ \t\r\f\v]*\n\s*"),  # blank line: paragraph
    re.compile(r"\n\s*"),  # single newline: line
    re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+"),  # sentence end
    re.compile(r"\s+"),  # any whitespace: word
)

Span = tuple[int, int]


def _trim(text: str, start: int, end: int) -> Span:
    """Shrink [start, end) so it neither starts nor ends with whitespace."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _split_on(text: str, span: Span, pattern: re.Pattern[str]) -> list[Span]:
    """Cut ``span`` at every separator matched by ``pattern``; drop empty pieces."""
    start, end = span
    pieces: list[Span] = []
    cursor = start
    for match in pattern.finditer(text, start, end):
        piece = _trim(text, cursor, match.start())
        if piece[0] < piece[1]:
            pieces.append(piece)
        cursor = match.end()
    piece = _trim(text, cursor, end)
    if piece[0] < piece[1]:
        pieces.append(piece)
    return pieces


def _atoms(
    text: str,
    span: Span,
    level: int,
    count_tokens: Callable[[str], int],
    target_tokens: int,
) -> list[Span]:
    """Break ``span`` into pieces that each fit ``target_tokens``.

    A piece that fits is kept whole; only oversized pieces are cut further, and
    with the coarsest boundary that actually splits them. Word level is the
    floor: an oversized single word is returned as is.
    """
    if count_tokens(text[span[0] : span[1]]) <= target_tokens:
        return [span]
    for next_level in range(level, len(_BOUNDARIES)):
        pieces = _split_on(text, span, _BOUNDARIES[next_level])
        if len(pieces) > 1:
            out: list[Span] = []
            for piece in pieces:
                out.extend(_atoms(text, piece, next_level + 1, count_tokens, target_tokens))
            return out
    return [span]  # one word that is larger than the target on its own


def _pack(
    text: str,
    atoms: list[Span],
    count_tokens: Callable[[str], int],
    target_tokens: int,
    overlap_tokens: int,
) -> list[tuple[Span, int]]:
    """Greedily merge consecutive atoms into passages of at most ``target_tokens``.

    The candidate passage is re-counted as a whole string (not as a sum of atom
    counts) because subword tokenizers are not additive across joins.
    Returns ((start, end), n_tokens) per passage.
    """
    passages: list[tuple[Span, int]] = []
    first = 0  # index of the first atom of the passage being built
    while first < len(atoms):
        last = first
        n_tokens = count_tokens(text[atoms[first][0] : atoms[first][1]])
        while last + 1 < len(atoms):
            candidate = count_tokens(text[atoms[first][0] : atoms[last + 1][1]])
            if candidate > target_tokens:
                break
            last += 1
            n_tokens = candidate
        passages.append(((atoms[first][0], atoms[last][1]), n_tokens))
        if last + 1 >= len(atoms):
            break
        first = _overlap_start(text, atoms, first, last, count_tokens, target_tokens, overlap_tokens)
    return passages


def _overlap_start(
    text: str,
    atoms: list[Span],
    first: int,
    last: int,
    count_tokens: Callable[[str], int],
    target_tokens: int,
    overlap_tokens: int,
) -> int:
    """First atom of the next passage: ``last + 1``, moved back to repeat the
    trailing atoms of the previous passage that fit in ``overlap_tokens``.

    The overlap never reaches back to ``first`` (that would make no progress)
    and is shrunk until the overlap plus the next new atom still fits.
    """
    nxt = last + 1
    if overlap_tokens <= 0:
        return nxt
    start = nxt
    while start - 1 > first and count_tokens(text[atoms[start - 1][0] : atoms[last][1]]) <= overlap_tokens:
        start -= 1
    while start < nxt and count_tokens(text[atoms[start][0] : atoms[nxt][1]]) > target_tokens:
        start += 1
    return start


def chunk_documents(
    docs: list[tuple[str, str]],
    count_tokens: Callable[[str], int],
    target_tokens: int = DEFAULT_TARGET_TOKENS,
    overlap_tokens: int = 0,
) -> list[Passage]:
    """Split ``(doc_id, text)`` documents into passages of at most ~``target_tokens``.

    The default target is 384 tokens (within the usual 256-512 range).
    Boundaries are tried in order paragraph (blank line), line, sentence, word;
    text is never split inside a word, so one word longer than the target
    becomes its own over-sized passage. Passages never span two documents.
    ``overlap_tokens`` > 0 repeats whole trailing pieces (sentences or words) of
    a passage at the start of the next one, up to that many tokens.
    Empty or whitespace-only documents yield no passages.
    """
    if target_tokens <= 0:
        raise ValueError(f"target_tokens must be positive, got {target_tokens}")
    if not 0 <= overlap_tokens < target_tokens:
        raise ValueError(f"overlap_tokens must be in [0, target_tokens), got {overlap_tokens}")
    passages: list[Passage] = []
    for doc_id, text in docs:
        whole = _trim(text, 0, len(text))
        if whole[0] == whole[1]:
            continue
        atoms = _atoms(text, whole, 0, count_tokens, target_tokens)
        for index, ((start, end), n_tokens) in enumerate(
            _pack(text, atoms, count_tokens, target_tokens, overlap_tokens)
        ):
            passages.append(Passage(doc_id, index, text[start:end], n_tokens, start, end))
    return passages
