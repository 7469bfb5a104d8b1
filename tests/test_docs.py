"""The docs match the code.

docs/cli.md documents every CLI command with every argument and option, and nothing the CLI lacks;
docs/configuration.md names every CAG_* variable the code reads; links between the README and the
docs resolve, anchors included; the README stays a short page for users whose test command is the
one CI runs.
"""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from cag.cli.main import app

from .conftest import REPO

DOCS = REPO / "docs"
CLI_DOC = (DOCS / "cli.md").read_text()
CLICK = typer.main.get_command(app)
COMMANDS = sorted(CLICK.commands)
PAGES = [REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "bench" / "JOURNAL.md", *sorted(DOCS.glob("*.md"))]


def section(text: str, heading: str) -> str:
    """The text under `heading` (a whole heading line) down to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    m = re.search(rf"^{re.escape(heading)}[ \t]*$", text, re.M)
    assert m, f"no heading {heading!r}"
    end = re.search(rf"^#{{1,{level}}} ", text[m.end():], re.M)
    return text[m.end(): m.end() + end.start() if end else len(text)]


def command_section(command: str) -> str:
    """The command's section of docs/cli.md; empty when it has none (test_command_documented_with_help says so)."""
    heading = f"## `cag {command}`"
    return section(CLI_DOC, heading) if re.search(rf"^{re.escape(heading)}$", CLI_DOC, re.M) else ""


def table_entries(command: str) -> set[str]:
    """What the first column of the command's argument and option table names: `--opt`s and ARGs."""
    cells = re.findall(r"^\| (`[^|]*)\|", command_section(command), re.M)
    return {name for cell in cells for name in re.findall(r"--[\w-]+|(?<=`)[A-Z][A-Z_]*(?=`)", cell)}


def test_commands_are_registered():
    assert {"ingest", "ask", "list", "status", "invalidate", "gc", "reindex", "serve", "compare"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_command_documented_with_help(command):
    assert re.search(rf"^## `cag {command}`$", CLI_DOC, re.M), f"docs/cli.md lacks a section `## `cag {command}``"
    r = CliRunner().invoke(app, [command, "--help"])
    assert r.exit_code == 0 and "Usage" in r.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_argument_and_option_is_documented(command):
    documented = table_entries(command)
    for param in CLICK.commands[command].params:
        names = [param.name.upper()] if param.param_type_name == "argument" else param.opts + param.secondary_opts
        for name in names:
            if name != "--help":
                assert name in documented, f"`cag {command}` {name} is not in its table in docs/cli.md"


@pytest.mark.parametrize("command", COMMANDS)
def test_no_documented_option_is_missing_from_the_command(command):
    real = {o for p in CLICK.commands[command].params for o in (*p.opts, *p.secondary_opts)}
    options = {e for e in table_entries(command) if e.startswith("--")}
    assert options <= real, f"docs/cli.md documents options `cag {command}` does not have: {options - real}"


def test_every_documented_command_exists():
    documented = re.findall(r"^## `cag ([\w-]+)`$", CLI_DOC, re.M)
    assert set(documented) <= set(COMMANDS), (
        f"docs/cli.md documents commands that do not exist: {set(documented) - set(COMMANDS)}"
    )


def _variables_in_code() -> set[str]:
    from cag.api.replica_settings import ReplicaSettings
    from cag.api.settings import ApiSettings
    from cag.config import Settings

    names = set()
    for folder in ("cag", "store", "api", "cli", "rag", "compare", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            names |= set(re.findall(r"\bCAG_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    for model in (Settings, ApiSettings, ReplicaSettings):  # read through the env prefix, never spelled out
        names |= {info.alias or f"CAG_{name.upper()}" for name, info in model.model_fields.items()}
    names.add("CAG_TEST_MODELS_DIR")  # read by tests/conftest.py
    return names


def test_every_variable_is_in_the_configuration_page():
    text = (DOCS / "configuration.md").read_text()
    missing = sorted(v for v in _variables_in_code() if f"`{v}`" not in text)
    assert not missing, f"docs/configuration.md does not name {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # no headings inside code
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: link to {target}: no such heading"


def test_every_docs_page_is_in_the_readme_index():
    readme = (REPO / "README.md").read_text()
    for page in DOCS.glob("*.md"):
        assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_the_readme_is_short_and_names_the_ci_test_command():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "README.md is for users: move details to docs/"
    assert "make test" in readme
    assert re.search(r"^make (lint )?test$", (REPO / ".ci" / "run").read_text(), re.M), (
        ".ci/run must run the README's `make test`"
    )
