r"""A conversation as the suffix of a prompt: chat messages -> checked turns -> token ids.

Prompt = head + documents + mid | [system +] user_1 + tail + assistant_1 + turn + user_2 + tail ...
         \______ the snapshot ______/   \________________ the conversation (suffix) ________________/

The knowledge stays the snapshot: its layout (cag.model.prompt) ends inside the first user turn, so every
conversation on a corpus continues the same cached prefix. A client's system messages therefore
come after the knowledge, at the start of the user turn that follows them ("system text, blank line,
user text"): they steer every later turn, and a system message that differs between clients costs
no snapshot of its own. `tail` (after a user message) and `turn` (after an assistant message) are the
model's own chat template pieces, found by rendering it with marker strings, as cag.model.prompt does.

A single user message gives exactly the suffix of a plain question (prompt.build_suffix), so a
one-turn chat answers as `cag ask` does. Message text is user text (special-token strings stay
plain text); template pieces are control tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from cag.errors import BadInput
from cag.model.prompt import _K, _Q, OPENINGS, Layout, encode_template, encode_text

_A, _Q2 = "\x00ANSWER\x00", "\x00FOLLOWUP\x00"
SYSTEM_ROLES = ("system", "developer")  # OpenAI's newer name for system messages
ROLES = (*SYSTEM_ROLES, "user", "assistant")
PLAIN_TURN = "\n\nQuestion: "  # the plain-text layout's (no chat template) piece after an answer


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "assistant"
    text: str


def unicode_problem(text: str) -> str | None:
    """Why `text` is not Unicode text a tokenizer can take, or None: a lone surrogate, from a JSON
    escape such as "\\ud800" with no pair, or from bytes that are not UTF-8 (Python decodes argv with
    surrogateescape: byte 0xff is U+DCFF). Tokenizers fail on it with a TypeError (an HTTP 500 and a
    CLI traceback before)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"is not valid text: character {e.start} is U+{ord(text[e.start]):04X}, a lone surrogate "
                "(an unpaired \\u escape, or bytes that are not UTF-8)")
    return None


def content_text(i: int, role, content) -> str:
    """A message's text: a string, or OpenAI's content parts ([{"type": "text", "text": ...}], their
    texts joined by newlines), read the same for the HTTP API (api.answers) and `cag ask --messages`;
    None is empty. Other part types (image_url, input_audio, file) are refused."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if other := [p.get("type") for p in content if p.get("type") != "text"]:
            raise BadInput(f"message {i} ({role}): content of type {other[0]!r} is not supported: cag reads text")
        texts = [p.get("text") for p in content]
        if all(t is None or isinstance(t, str) for t in texts):
            return "\n".join(t for t in texts if t)
    raise BadInput(f"message {i} ({role}): content must be text (a string or a list of text parts)")


def turns_of(messages: list) -> list[Turn]:
    """Checked turns from chat messages ({"role", "content"} dicts or (role, text) pairs): system
    text joins the next user message, consecutive messages of one role join with a blank line. The
    conversation starts with a user message (after any system ones) and ends with one."""
    if not messages:
        raise BadInput("no messages: a conversation needs at least one user message")
    turns: list[Turn] = []
    system: list[str] = []
    for i, m in enumerate(messages):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else tuple(m)
        if role in ("tool", "function"):
            raise BadInput(
                f"message {i}: role {role!r} is not supported: cag answers from its corpus and calls no tools"
            )
        if role not in ROLES:
            raise BadInput(f"message {i}: unknown role {role!r}; use one of {', '.join(ROLES)}")
        text = content_text(i, role, content)
        if not text.strip():
            raise BadInput(f"message {i} ({role}) is empty")
        if why := unicode_problem(text):
            raise BadInput(f"message {i} ({role}) {why}")
        text = text.strip()
        if role in SYSTEM_ROLES:
            system.append(text)
            continue
        if role == "user" and system:
            text, system = "\n\n".join([*system, text]), []
        if role == "assistant" and not turns:
            raise BadInput(
                f"message {i}: the conversation starts with an assistant message; it must start with a user message"
            )
        if turns and turns[-1].role == role:
            turns[-1] = Turn(role, f"{turns[-1].text}\n\n{text}")
        else:
            turns.append(Turn(role, text))
    if not turns:
        raise BadInput("no user message: a conversation needs at least one")
    if system or turns[-1].role != "user":
        raise BadInput("the conversation must end with a user message (the question to answer)")
    return turns


def turn_piece(tokenizer, layout: Layout) -> str:
    """The template text between an assistant message and the next user message."""
    if getattr(tokenizer, "chat_template", None):
        for first in OPENINGS:
            messages = [*first, {"role": "assistant", "content": _A}, {"role": "user", "content": _Q2}]
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - a template that refuses this shape: try the next
                continue
            if not isinstance(text, str) or any(text.count(m) != 1 for m in (_K, _Q, _A, _Q2)):
                continue
            after_q, rest = text.split(_Q)[1].split(_A)
            turn, after_q2 = rest.split(_Q2)
            if after_q == layout.tail == after_q2:  # the layout the snapshot was built with
                return turn
    return PLAIN_TURN


def encode(tokenizer, layout: Layout, turn: str, turns: list[Turn]) -> list[int]:
    """The conversation's token ids, continuing the snapshot's prefix."""
    ids: list[int] = []
    for t in turns:
        ids += encode_text(tokenizer, t.text)
        ids += encode_template(tokenizer, layout.tail if t.role == "user" else turn)
    return ids


def question(turns: list[Turn]) -> str:
    """The question being answered: the last user message."""
    return turns[-1].text
