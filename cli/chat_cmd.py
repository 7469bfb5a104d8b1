"""`cag chat NAME`: a terminal chat over a corpus; and reading a conversation from a JSON file for
`cag ask NAME --messages FILE`. The conversation is the prompt after the knowledge (cag.answering.chat), its
K/V kept between turns in this process (cag.runtime.kept_conversations): each turn prefills only its new tokens."""

from __future__ import annotations

import atexit
import io
import json
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from cag.answering.chat import unicode_problem
from cag.cli.common import (
    MaxTokensOpt,
    ModelOpt,
    ModeOpt,
    StoreOpt,
    _catalog,
    _engine,
    announce_load,
    handle_errors,
    require_corpus,
    require_mode,
    shown,
)
from cag.errors import BadInput

HELP = "Type a question and Enter (a line ending in \\ goes on on the next line); /help lists the commands."
COMMANDS = {  # what a line starting with / does; anything else starting with / is refused with this list
    "/help": "this list",
    "/new": "start a new conversation",
    "/mode NAME": "answer in another mode from the next question on: cag, cag+rag, rag or full",
    "/quit": "end the chat (also /exit or Ctrl-D); Ctrl-C stops an answer",
}
MODES = ("cag", "cag+rag", "rag", "full")


def line_editing(history: Path) -> bool:
    """Line editing and Up/Down history at the prompt (GNU readline, where Python has it, on a
    terminal), the history kept in `history` across sessions. False where there is none."""
    if not sys.stdin.isatty():
        return False
    try:
        import readline
    except ImportError:
        return False
    try:
        readline.read_history_file(history)
    except OSError:
        pass  # no history yet (or unreadable): start one
    readline.set_history_length(1000)

    def save():
        try:
            history.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(history)
        except OSError:
            pass  # a read-only home: the chat itself is unaffected

    atexit.register(save)
    return True


def read_turn() -> str:
    """One question: a line, and the lines after it while a line ends in a backslash. EOFError at the end."""
    lines, prompt = [], "you> "
    while True:
        line = input(prompt)
        if line.endswith("\\"):
            lines.append(line[:-1])
            prompt = "...> "
            continue
        return "\n".join([*lines, line])


def read_messages(path: str) -> list[dict]:
    """A JSON list of chat messages ({"role", "content"}) from a file, or stdin for `-`."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read messages file {path}: {e}") from None
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"messages file {path} is not JSON: {e}") from None
    if isinstance(messages, dict) and isinstance(messages.get("messages"), list):
        messages = messages["messages"]  # a chat completion request body works too
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadInput(f"messages file {path}: expected a JSON list of {{\"role\", \"content\"}} objects")
    return messages


@handle_errors
def chat(
    corpus: Annotated[str, typer.Argument(help="Corpus name (see `cag list`).")],
    system: Annotated[
        str | None, typer.Option(help="A system message for the conversation (it follows the knowledge).")
    ] = None,
    mode: ModeOpt = "cag",
    max_tokens: MaxTokensOpt = None,
    model: ModelOpt = None,
    store: StoreOpt = None,
):
    """Chat with a corpus in the terminal: the history is kept, answers stream in."""
    require_mode(mode)
    require_corpus(*_catalog(model, store=store)[1:], corpus)  # before the model loads (or torch is imported)
    from cag.answering.query import Query
    from cag.errors import CagError
    from cag.runtime.kv_cache import Cancelled

    engine = announce_load(_engine(model, store=store))
    start = [{"role": "system", "content": system}] if system else []
    # an unknown corpus or mode, a --system that is not text: one line before the first prompt
    engine.check(Query(corpus, None, mode, messages=[*start, {"role": "user", "content": "ping"}]))
    if isinstance(sys.stdin, io.TextIOWrapper):
        # bytes that are not UTF-8 arrive as lone surrogates, refused as one line below, where strict
        # decoding raised UnicodeDecodeError (a traceback, the session lost, the lines buffered with it too)
        sys.stdin.reconfigure(errors="surrogateescape")
    messages = list(start)
    line_editing(engine.settings.home / "chat_history")
    limit = min(max_tokens or engine.settings.max_tokens, engine.settings.answer_room)
    typer.echo(f"chatting with {shown(corpus)} ({mode}). {HELP}", err=True)
    stop = {"now": False}

    def interrupt(*_):
        stop["now"] = True

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    while True:
        try:
            line = read_turn()
        except EOFError:
            typer.echo("", err=True)
            return
        except KeyboardInterrupt:  # at the prompt: a fresh line, like a shell
            typer.echo("", err=True)
            continue
        text = line.strip()
        if not text:
            continue
        if why := unicode_problem(text):
            typer.echo(f"error: that line {why}; type it again", err=True)
            continue
        if text in ("/quit", "/exit"):
            return
        if text == "/new":
            messages = list(start)
            typer.echo("(new conversation)", err=True)
            continue
        if text == "/help":
            typer.echo("\n".join(f"  {c:<12} {what}" for c, what in COMMANDS.items()), err=True)
            continue
        if text.split()[0] == "/mode":
            name = text.split()[1] if len(text.split()) == 2 else None
            if name not in MODES:
                typer.echo(f"error: /mode takes one of {', '.join(MODES)}", err=True)
                continue
            mode = name
            typer.echo(f"(answering in {mode})", err=True)
            continue
        if text.startswith("/") and " " not in text:
            typer.echo(
                f"error: unknown command {shown(text)}; the commands: {', '.join(c.split()[0] for c in COMMANDS)}",
                err=True,
            )
            continue
        messages.append({"role": "user", "content": text})
        stop["now"] = False
        previous = signal.signal(signal.SIGINT, interrupt)
        try:
            a = engine.answer(Query(corpus, None, mode, max_tokens, messages=list(messages)), show, lambda: stop["now"])
        except Cancelled:
            messages.pop()
            typer.echo("(stopped)", err=True)
            continue
        except CagError as e:
            messages.pop()
            typer.echo("\nerror: " + shown(" ".join(str(e).splitlines())), err=True)
            continue
        finally:
            signal.signal(signal.SIGINT, previous)
        typer.echo("")
        if stop["now"]:
            typer.echo("(stopped)", err=True)
        elif a.completion_tokens >= limit:
            typer.echo(f"(cut at {limit} tokens: --max-tokens raises it, up to CAG_ANSWER_ROOM)", err=True)
        messages.append({"role": "assistant", "content": a.answer or "..."})
        typer.echo(
            f"[{a.mode}] prompt {a.prompt_tokens} tok ({a.cached_tokens} cached: {a.conversation_tokens} of them from "
            f"this conversation), answer {a.completion_tokens} tok; ttft {a.ttft_ms:.0f} ms",
            err=True,
        )
