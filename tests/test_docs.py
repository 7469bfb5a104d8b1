"""Every CLI command is documented in the README and has working --help."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from cag.cli.main import app

from .conftest import REPO

README = (REPO / "README.md").read_text()
COMMANDS = sorted(c.name or c.callback.__name__ for c in app.registered_commands)


def test_commands_are_registered():
    assert {"ingest", "ask", "list", "status", "invalidate", "gc", "reindex", "serve", "compare"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_command_documented_with_help(command):
    assert re.search(rf"^### `cag {command}\b", README, re.M), f"README lacks a section for `cag {command}`"
    r = CliRunner().invoke(app, [command, "--help"])
    assert r.exit_code == 0 and "Usage" in r.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_is_documented(command):
    import typer.main

    cmd = typer.main.get_command(app).commands[command]
    section = README.split(f"### `cag {command}")[1].split("\n### ")[0]
    for param in cmd.params:
        for opt in param.opts:
            if opt.startswith("--") and opt != "--help":
                assert opt in section, f"`cag {command}` option {opt} is not in the README"
