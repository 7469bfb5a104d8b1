"""Settings and names: every value is checked once, where it is defined, and a bad one is one line
(exit 1) before any work, never a traceback; an unusable CAG_HOME or index.db is one line too, and
the file is left as it was."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cag.cli.main import app
from cag.config import Settings, get_settings
from cag.errors import BadInput, BadSettings, CagError
from cag.knowledge.names import MAX_NAME_CHARS, check_corpus_name

runner = CliRunner()


def _one_line_error(args: list[str], message: str):
    r = runner.invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 1, r.output
    assert message in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r


def test_defaults_are_valid_and_flags_win(monkeypatch):
    s = get_settings()
    assert (s.chunk_tokens, s.question_room, s.answer_room, s.max_tokens, s.ttl_s) == (0, 256, 256, 128, 0.0)
    monkeypatch.setenv("CAG_MAX_TOKENS", "7")
    assert get_settings().max_tokens == 7 and get_settings(max_tokens=9).max_tokens == 9
    assert get_settings(max_tokens=None).max_tokens == 7  # None means "flag not given"


@pytest.mark.parametrize(("var", "value", "message"), [
    ("CAG_CHUNK_TOKENS", "abc", "CAG_CHUNK_TOKENS='abc': Input should be a valid integer"),
    ("CAG_CHUNK_TOKENS", "-1", "CAG_CHUNK_TOKENS='-1': Input should be greater than or equal to 0"),
    ("CAG_QUESTION_ROOM", "-300", "CAG_QUESTION_ROOM='-300': Input should be greater than or equal to 1"),
    ("CAG_ANSWER_ROOM", "0", "greater than or equal to 1"),
    ("CAG_MAX_TOKENS", "0", "greater than or equal to 1"),
    ("CAG_THREADS", "-1", "CAG_THREADS='-1': Input should be greater than or equal to 0"),
    ("CAG_MAX_BATCH", "0", "greater than or equal to 1"),
    ("CAG_RESIDENT_BYTES", "-1", "greater than or equal to 0"),
    ("CAG_TTL_S", "-5", "CAG_TTL_S='-5': Input should be greater than or equal to 0"),
    ("CAG_TTL_S", "nan", "CAG_TTL_S='nan': Input should be a finite number"),
    ("CAG_KV_DTYPE", "int4", "CAG_KV_DTYPE='int4': Input should be 'auto', 'float16', 'bfloat16', 'float32' or 'int8'"),
    ("CAG_DTYPE", "float16", "CAG_DTYPE='float16': Input should be 'auto', 'float32' or 'bfloat16'"),
    ("CAG_MODEL", "", "CAG_MODEL='': String should have at least 1 character"),
    ("CAG_HOME", "", "CAG_HOME='': empty; unset it for the default ~/.cag"),
])
def test_bad_settings_are_one_line(var, value, message, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(BadSettings) as e:
        get_settings()
    assert str(e.value).startswith("bad setting ") and message in str(e.value)
    assert "\n" not in str(e.value) and isinstance(e.value, CagError) and e.value.exit_code == 1
    _one_line_error(["list"], message)  # the CLI's start-up path: before any model or index


def test_a_flag_value_is_named_by_its_field():
    with pytest.raises(BadSettings, match=r"^bad setting max_tokens=0: Input should be greater"):
        get_settings(max_tokens=0)


def test_an_empty_models_dir_means_unset(monkeypatch, cag_home):
    monkeypatch.setenv("CAG_MODELS_DIR", "")
    assert get_settings().models_dir == cag_home / "models"


def test_every_setting_is_documented():
    from .conftest import REPO

    page = (REPO / "docs" / "configuration.md").read_text()
    for name, info in Settings.model_fields.items():
        var = info.alias or f"CAG_{name.upper()}"
        assert f"| `{var}`" in page, f"{var} is not in a settings table of docs/configuration.md"


def test_negative_chunk_ingest_is_refused_before_any_work(small_corpus, cag_home, monkeypatch):
    monkeypatch.setenv("CAG_CHUNK_TOKENS", "-1")
    _one_line_error(["ingest", str(small_corpus)], "CAG_CHUNK_TOKENS='-1'")
    assert not cag_home.exists()  # nothing was created


def test_home_that_is_a_file(tmp_path, monkeypatch):
    home = tmp_path / "home-file"
    home.write_text("not a folder")
    monkeypatch.setenv("CAG_HOME", str(home))
    for args in (["list"], ["gc"], ["reindex"], ["status"]):
        _one_line_error(args, f"bad setting CAG_HOME='{home}': not a directory")
    assert home.read_text() == "not a folder"


def test_garbage_index_db_is_one_line_and_left_alone(cag_home):
    cag_home.mkdir()
    garbage = b"this is not a database, " * 200
    (cag_home / "index.db").write_bytes(garbage)
    for args in (["list"], ["gc"], ["reindex"], ["invalidate", "x"], ["ask", "x", "q?"]):
        _one_line_error(
            args, "index.db is not a usable index (file is not a database); move it away and run `cag reindex`"
        )
    assert (cag_home / "index.db").read_bytes() == garbage  # nothing stored was touched


def test_the_real_entry_point_prints_one_line(tmp_path):
    """The installed `python -m cag`, not a test runner: no traceback reaches the terminal."""
    env = dict(os.environ, CAG_CHUNK_TOKENS="abc", CAG_HOME=str(tmp_path / "home"))
    r = subprocess.run([sys.executable, "-m", "cag", "list"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "error: bad setting CAG_CHUNK_TOKENS='abc': Input should be a valid integer, unable to parse string as an "
        "integer"
    ]


@pytest.mark.parametrize("name", ["town", "Handbook 2024", "a.b", "q&a_v2", "é-文档", "x" * MAX_NAME_CHARS])
def test_valid_corpus_names(name):
    assert check_corpus_name(name) == name


@pytest.mark.parametrize(("name", "why"), [
    ("", "empty"),
    (".", "must not start with a dot"),
    ("..", "must not start with a dot"),
    (".hidden", "must not start with a dot"),
    ("a/b", "must not contain / or \\"),
    ("a\\b", "must not contain / or \\"),
    ("../etc", "must not start with a dot"),
    ("a\nb", "control or invisible characters"),
    ("a\x1b[31mred", "control or invisible characters"),
    ("a\u200bb", "control or invisible characters"),  # zero-width space: prints like "ab"
    (" town", "white space"),
    ("town\t", "white space"),
    ("x" * (MAX_NAME_CHARS + 1), f"at most {MAX_NAME_CHARS}"),
])
def test_invalid_corpus_names_are_one_clear_line(name, why):
    with pytest.raises(BadInput) as e:
        check_corpus_name(name)
    assert str(e.value).startswith(f"invalid corpus name {name!r}: ") and why in str(e.value)
    assert "\n" not in str(e.value)  # repr() escapes control characters: the message stays one line
