r"""The only place text is laid out: the knowledge prefix and the question suffix.

Prompt = head + doc_1 + ... + doc_n + mid | question + tail
         \______________ prefix ________/   \___ suffix ___/

head/mid/tail come from the model's own chat template, rendered once with marker strings and
split at the markers, so any chat model gets its native layout. Each piece is tokenized on its
own and the token ids concatenated: a document's token span then depends only on the documents
before it, which is what incremental refresh needs. Document text is tokenized with
`split_special_tokens=True`: a "<|im_end|>" inside a document is plain text, never a control token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

PROMPT_VERSION = 1
INSTRUCTION = (
    "You answer questions using only the knowledge below. "
    "Answer briefly, with the exact words of the knowledge where possible. "
    "If the knowledge does not contain the answer, say you do not know."
)
_K = "\x00KNOWLEDGE\x00"
_Q = "\x00QUESTION\x00"


@dataclass(frozen=True)
class Layout:
    head: str
    mid: str
    tail: str

    def as_dict(self) -> dict:
        return {"version": PROMPT_VERSION, "head": self.head, "mid": self.mid, "tail": self.tail}


@dataclass
class PrefixTokens:
    ids: list[int]
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # (doc name, start, end) token spans


def openings(instruction: str) -> tuple[str, tuple[list[dict], ...]]:
    """The system text for `instruction` and the opening messages a template is rendered with, in order of
    preference: knowledge in a system turn; for templates without a system role, in the user turn
    (cag.answering.chat renders the same openings)."""
    system = f"{instruction}\n\n<knowledge>\n{_K}</knowledge>"
    return system, ([{"role": "system", "content": system}, {"role": "user", "content": _Q}],
                    [{"role": "user", "content": f"{system}\n\nQuestion: {_Q}"}])


SYSTEM, OPENINGS = openings(INSTRUCTION)


def layout_for(tokenizer) -> Layout:
    """Split the model's chat template at marker strings; plain-text layout when it has none."""
    if getattr(tokenizer, "chat_template", None):
        for messages in OPENINGS:
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception:
                continue
            if (
                isinstance(text, str)
                and text.count(_K) == 1
                and text.count(_Q) == 1
                and text.index(_K) < text.index(_Q)
            ):
                head, rest = text.split(_K)
                mid, tail = rest.split(_Q)
                return Layout(head, mid, tail)
    return Layout(f"{SYSTEM.split(_K)[0]}", "</knowledge>\n\nQuestion: ", "\nAnswer:")


def document_text(name: str, text: str) -> str:
    return f'<document name="{name}">\n{text.strip()}\n</document>\n'


# A fast tokenizer applies split_special_tokens by setting a flag on its shared Rust backend for
# the call: two threads encoding at once (API workers, a batch of questions) could each encode
# with the other's flag ("<|im_end|>" as plain text, or a user's "<|im_end|>" as a control token).
_ENCODE = threading.Lock()


def encode_text(tokenizer, text: str, progress=None) -> list[int]:
    """User text: special-token strings stay plain text. Long text goes in pieces (`pieces`): one call
    over megabytes held ~150 bytes of memory per character. `progress(n)`: n more characters done."""
    ids: list[int] = []
    for piece in pieces(text):
        with _ENCODE:
            ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if progress:
            progress(len(piece))
    return ids


PIECE_CHARS = 1 << 16


def pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of at most `size` characters, each (but the last) ending where a word
    ends before a single space and the next word, so that byte-level pre-tokenizers see the same words
    as in one call (a piece starts with " word"); a stretch without one is cut at `size`. Text of
    `size` or less is one piece: its tokens are exactly one call's. Deterministic: every path that
    lays out a document (ingest, `full`, shard packing) tokenizes it the same way."""
    out, start, n = [], 0, len(text)
    while n - start > size:
        end, lo = start + size, start + size // 2
        cut = text.rfind(" ", lo, end)
        while cut > lo and (text[cut - 1].isspace() or text[cut + 1].isspace()):
            cut = text.rfind(" ", lo, cut)
        end = cut if cut > lo else end
        out.append(text[start:end])
        start = end
    out.append(text[start:])
    return out


def encode_template(tokenizer, text: str) -> list[int]:
    """Our own template pieces: special-token strings are control tokens."""
    with _ENCODE:
        return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_prefix(tokenizer, layout: Layout, docs: list[tuple[str, str]]) -> PrefixTokens:
    ids = encode_template(tokenizer, layout.head)
    spans = []
    for name, text in docs:
        start = len(ids)
        ids += encode_text(tokenizer, document_text(name, text))
        spans.append((name, start, len(ids)))
    ids += encode_template(tokenizer, layout.mid)
    return PrefixTokens(ids, spans)


def build_suffix(tokenizer, layout: Layout, question: str) -> list[int]:
    return encode_text(tokenizer, question.strip()) + encode_template(tokenizer, layout.tail)
