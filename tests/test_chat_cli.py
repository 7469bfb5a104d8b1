"""`cag chat` as a terminal user meets it: commands (/help, /mode, unknown ones refused), multi-line
questions, a cut answer marked, and line editing with a history file where there is a terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import time

import pytest
from typer.testing import CliRunner

from bench.harness import cag_command
from cag.cli.main import app

runner = CliRunner()


@pytest.fixture
def town(tiny, small_corpus):
    r = runner.invoke(app, ["ingest", str(small_corpus), "--name", "town"], catch_exceptions=False)
    assert r.exit_code == 0, r.output


def chat(*lines: str, args: tuple = ()):
    return runner.invoke(
        app, ["chat", "town", *args], input="".join(line + "\n" for line in lines), catch_exceptions=False
    )


def test_commands_are_not_sent_to_the_model(town):
    r = chat("/help", "/nope", "/mode wizard", "/mode cag+rag", "Who keeps the lighthouse?", "/mode rag",
             "And the ferry?", args=("--max-tokens", "4"))
    assert r.exit_code == 0, r.output
    err = r.stderr
    assert "/mode NAME" in err and "error: unknown command /nope; the commands: /help, /new, /mode, /quit" in err
    assert "error: /mode takes one of cag, cag+rag, rag, full" in err
    assert err.count("[cag+rag] prompt") == 1 and err.count("[rag] prompt") == 1 and "[cag] prompt" not in err


def test_a_multi_line_question_and_a_cut_answer(town):
    cut = chat("Who keeps\\", "the lighthouse?", args=("--max-tokens", "3"))
    assert cut.exit_code == 0 and cut.stderr.count("prompt ") == 1, cut.output  # one question of two lines
    assert "(cut at 3 tokens: --max-tokens raises it" in cut.stderr
    one = runner.invoke(app, ["ask", "town", "Who keeps\nthe lighthouse?", "--max-tokens", "3", "--json"])
    assert json.loads(one.stdout)["answer"] in cut.stdout


def test_line_editing_and_the_history_file_on_a_terminal(town, cag_home):
    """Under a pseudo-terminal: Up recalls the previous question (readline), and the questions are in
    $CAG_HOME/chat_history afterwards."""
    pytest.importorskip("readline", reason="this Python has no readline: the chat reads plain lines")
    pid, fd = pty.fork()
    if pid == 0:  # the child: `cag chat` on the terminal
        os.execvpe(cag_command()[0], [*cag_command(), "chat", "town", "--max-tokens", "2"], os.environ)
    out = bytearray()

    def until(done, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, bytes(out[-400:])
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    out.extend(os.read(fd, 4096))
                except OSError:  # the child is gone
                    return

    answered = lambda n: lambda: out.count(b"[cag] prompt") >= n and out.rstrip().endswith(b"you>")  # noqa: E731
    until(lambda: out.rstrip().endswith(b"you>"))
    os.write(fd, b"Who keeps the lighthouse?\r")
    until(answered(1))
    os.write(fd, b"\x1b[A\r")  # Up, Enter: the same question again
    until(answered(2))
    os.write(fd, b"/quit\r")
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.WEXITSTATUS(status) == 0, bytes(out[-400:])
    assert b"^[[A" not in out  # the arrow moved through the history, not typed into the line
    assert out.count(b"[cag] prompt") == 2  # Up recalled the question, which was asked again
    assert (cag_home / "chat_history").read_text() == "Who keeps the lighthouse?\n/quit\n"  # a repeat is kept once
