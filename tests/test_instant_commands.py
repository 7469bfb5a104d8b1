"""Commands that only read the index answer without loading the model or importing torch: the
fingerprints a load recorded (cag.model.facts) stand in for it, keyed by the model's files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from cag.cli.main import app
from cag.config import get_settings
from cag.model import facts as model_facts

runner = CliRunner()


def cag(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


# Runs the CLI in a fresh interpreter and says which heavy modules the command imported.
PROBE = textwrap.dedent("""
    import json, sys
    from typer.testing import CliRunner
    from cag.cli.main import app
    r = CliRunner().invoke(app, sys.argv[1:], catch_exceptions=False)
    print(json.dumps({"code": r.exit_code, "out": r.stdout, "err": r.stderr,
                      "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
""")


def probe(*args: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=os.environ, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def ingested(tiny, small_corpus):
    r = cag("ingest", str(small_corpus), "--name", "town", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_list_status_info_read_the_recorded_facts_without_torch(ingested, small_corpus):
    listed = probe("list", "--json")
    assert listed["code"] == 0 and not listed["torch"] and not listed["transformers"], listed
    assert [c["name"] for c in json.loads(listed["out"])["corpora"]] == ["town"]
    assert json.loads(listed["out"])["corpora"][0]["stale"] is False
    info = probe("info", "--json")
    assert info["code"] == 0 and not info["torch"], info
    d = json.loads(info["out"])
    assert d["layers"] == 2 and d["kernels"] and d["kv_bytes_per_token"] > 0
    (small_corpus / "b.txt").write_text("The ferry now leaves at 8:05.\n")
    st = probe("status", "town", "--json")
    assert st["code"] == 0 and not st["torch"], st
    assert json.loads(st["out"])["reasons"] == ["documents changed: b.txt"]


def test_the_recorded_facts_say_what_a_load_says(ingested, small_corpus):
    """The same status, stale reasons included, from the record and from a loaded model."""
    from cag.engine import Engine

    (small_corpus / "c.md").write_text("A new page.\n")
    recorded = json.loads(cag("status", "town", "--json").stdout)
    engine = Engine(get_settings())
    assert not engine.model_loaded
    engine.lm  # noqa: B018 - loaded: facts now come from the model itself
    assert engine.status("town").to_dict() == recorded
    assert model_facts.lookup(engine.index, engine.settings) == engine.facts()


def test_errors_about_names_come_before_any_model_load(ingested, small_corpus):
    for args, message in ((("ask", "nope", "hi"), "unknown corpus 'nope'"),
                          (("ask", "town", "hi", "--mode", "bogus"), "unknown mode 'bogus'"),
                          (("status", "nope"), "unknown corpus 'nope'"),
                          (("chat", "nope"), "unknown corpus 'nope'"),
                          (("ingest", str(small_corpus / "missing")), "no such file, folder or corpus"),
                          (("ingest", str(small_corpus), "--name", "a/b"), "invalid corpus name")):
        r = probe(*args)
        assert r["code"] == 1 and message in r["err"] and not r["torch"], (args, r)


def test_a_changed_model_file_or_setting_is_another_key(tiny_model_dir, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    monkeypatch.setenv("CAG_MODEL", str(model))
    key = model_facts.key(get_settings())
    assert key and model_facts.key(get_settings()) == key
    monkeypatch.setenv("CAG_WEIGHTS", "bf16")
    assert model_facts.key(get_settings()) != key
    monkeypatch.setenv("CAG_WEIGHTS", "fp32")
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert model_facts.key(get_settings()) != key
    monkeypatch.setenv("CAG_MODEL", "someone/some-model")  # a hub id: its files are unknown without a load
    assert model_facts.key(get_settings()) is None
    monkeypatch.setenv("CAG_MODEL", str(tmp_path / "absent"))
    assert model_facts.key(get_settings()) is None


def test_a_model_never_loaded_here_is_loaded_once_then_recorded(ingested, tiny_model_dir, tmp_path, monkeypatch):
    """Another model (a copy with another mtime: the same weights) has no record: `cag status`
    loads it, records it, and the next command reads the record."""
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    monkeypatch.setenv("CAG_MODEL", str(other))
    settings = get_settings()
    from cag.store.index import Index

    index = Index(settings.index_path)
    assert model_facts.lookup(index, settings) is None
    first = probe("status", "town", "--json")
    assert first["code"] == 0 and first["torch"], first  # loaded
    assert json.loads(first["out"])["stale"] is False  # the same weights: the same fingerprint
    again = probe("status", "town", "--json")
    assert again["code"] == 0 and not again["torch"] and again["out"] == first["out"], again
