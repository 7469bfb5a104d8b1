"""The one rule for corpus names.

A corpus name is typed as `cag ask NAME`, sent as an OpenAI `model` id and written into every
snapshot header, and a bare name is told apart from a path by having no separator: so it must be
a visible, single-segment word, never something a shell, a path or a terminal would read otherwise.
"""

from __future__ import annotations

import unicodedata

from cag.errors import BadInput

MAX_NAME_CHARS = 200
# control, format (zero-width, bidi overrides), surrogates, line/paragraph separators: invisible
# or layout-changing characters that would make two different names print the same
_HIDDEN = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def check_corpus_name(name: str) -> str:
    """Return `name` if it is a valid corpus name; raise BadInput with one clear line if not."""
    why = name_problem(name)
    if why:
        raise BadInput(f"invalid corpus name {name!r}: {why}")
    return name


def name_problem(name: str) -> str | None:
    """Why `name` is not a valid corpus name, None when it is (also what refs in a shared store are held to)."""
    if not isinstance(name, str) or not name:
        return "empty"
    if name != name.strip():
        return "starts or ends with white space"
    if name.startswith("."):  # also ".", "..": never a hidden file or a parent folder
        return "must not start with a dot"
    if "/" in name or "\\" in name:
        return "must not contain / or \\ (a corpus name is one word, not a path)"
    if any(unicodedata.category(ch) in _HIDDEN for ch in name):
        return "must not contain control or invisible characters"
    if len(name) > MAX_NAME_CHARS:
        return f"{len(name)} characters long; at most {MAX_NAME_CHARS}"
    return None
