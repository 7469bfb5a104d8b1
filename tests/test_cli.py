"""The CLI end to end on the tiny model (a real HF folder passed like any user model)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cag.cli.main import app

runner = CliRunner()


def cag(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture
def ingested(tiny, small_corpus):
    r = cag("ingest", str(small_corpus), "--name", "town", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_ingest_json_then_fresh(ingested, small_corpus):
    assert ingested["corpus"] == "town" and ingested["status"] == "built"
    assert ingested["n_documents"] == 3 and ingested["n_tokens"] > 100 and ingested["bytes"] > 0
    assert set(ingested) >= {"corpus", "snapshot", "n_documents", "n_tokens", "bytes", "prefill_ms", "status"}
    again = json.loads(cag("ingest", str(small_corpus), "--name", "town", "--json").stdout)
    assert again["status"] == "fresh" and again["snapshot"] == ingested["snapshot"]


def test_ask_json_cag_and_full_agree(ingested):
    out = {}
    for mode in ("cag", "full"):
        r = cag("ask", "town", "When does the ferry leave?", "--mode", mode, "--max-tokens", "12", "--json")
        assert r.exit_code == 0, r.output
        out[mode] = json.loads(r.stdout)
    keys = {"answer", "mode", "snapshot", "stale", "prompt_tokens", "cached_tokens", "completion_tokens",
            "load_ms", "ttft_ms", "total_ms"}
    assert keys <= set(out["cag"])
    assert out["cag"]["cached_tokens"] == ingested["n_tokens"] and out["full"]["cached_tokens"] == 0
    assert out["cag"]["prompt_tokens"] == out["full"]["prompt_tokens"]
    assert out["cag"]["completion_tokens"] == 12


def test_ask_stream_prints_the_same_answer(ingested):
    plain = json.loads(cag("ask", "town", "Who keeps the lighthouse?", "--max-tokens", "10", "--json").stdout)
    streamed = cag("ask", "town", "Who keeps the lighthouse?", "--max-tokens", "10", "--stream")
    assert streamed.exit_code == 0
    assert streamed.stdout.strip() == plain["answer"]


def test_list_and_status_show_staleness(ingested, small_corpus):
    listed = json.loads(cag("list", "--json").stdout)["corpora"]
    assert [c["name"] for c in listed] == ["town"] and listed[0]["stale"] is False
    (small_corpus / "b.txt").write_text("The ferry now leaves at 8:05.\n")
    st = json.loads(cag("status", "town", "--json").stdout)
    assert st["stale"] is True and st["reasons"] == ["documents changed: b.txt"]
    human = cag("status", "town").stdout
    assert "STALE" in human and "documents changed: b.txt" in human
    r = cag("ask", "town", "When does the ferry leave?", "--max-tokens", "4", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["stale"] is True and "stale" in r.stderr


def _fails(args, message, code=1):
    r = cag(*args)
    assert r.exit_code == code, r.output
    assert message in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1
    return r


def test_bad_inputs_are_one_line_errors_and_harm_nothing(ingested, tmp_path, tiny_model_dir):
    before = json.loads(cag("ask", "town", "Who keeps the lighthouse?", "--max-tokens", "8", "--json").stdout)
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(["ingest", str(empty), "--name", "town"], "no supported documents")
    only_bad = tmp_path / "bad"
    only_bad.mkdir()
    (only_bad / "x.png").write_bytes(b"\x89PNG")
    _fails(["ingest", str(only_bad), "--name", "town"], "skipped unsupported: x.png")
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "notes.txt").write_bytes(b"ok \xff\xfe")
    _fails(["ingest", str(binary), "--name", "town"], "notes.txt: not valid UTF-8")
    pdf = tmp_path / "pdf"
    pdf.mkdir()
    (pdf / "broken.pdf").write_bytes(b"%PDF-1.4 garbage")
    _fails(["ingest", str(pdf), "--name", "town"], "broken.pdf: broken PDF")
    big = tmp_path / "big"
    big.mkdir()
    (big / "long.txt").write_text(" ".join(f"zq{i}x" for i in range(6000)))  # sharded, not refused: test_shards.py
    _fails(["ingest", str(big), "--name", "town", "--shard-tokens", "20"], "leave no room for knowledge")
    _fails(["ingest", str(tmp_path / "nope")], "no such file, folder or corpus")
    _fails(["ask", "nosuch", "question?"], "unknown corpus 'nosuch'")
    _fails(["ask", "town", "   "], "empty question")
    _fails(["ask", "town", "word " * 400], "the room left for it is 256")
    _fails(["ask", "town", "q?", "--mode", "psychic"], "unknown mode")
    after = json.loads(cag("ask", "town", "Who keeps the lighthouse?", "--max-tokens", "8", "--json").stdout)
    assert after["answer"] == before["answer"] and after["snapshot"] == before["snapshot"] and not after["stale"]


def test_truncated_snapshot_is_reported_then_rebuilt(ingested):
    from pathlib import Path

    path = Path(ingested["path"])
    good = json.loads(cag("ask", "town", "Who keeps the lighthouse?", "--max-tokens", "8", "--json").stdout)
    path.write_bytes(path.read_bytes()[:1000])
    _fails(["ask", "town", "Who keeps the lighthouse?"], "truncated or corrupt")
    rebuilt = json.loads(cag("ingest", "town", "--json").stdout)
    assert rebuilt["status"] == "built"
    again = json.loads(cag("ask", "town", "Who keeps the lighthouse?", "--max-tokens", "8", "--json").stdout)
    assert again["answer"] == good["answer"]


def test_names_and_ttl_that_make_no_sense_are_refused(ingested, small_corpus, cag_home):
    for bad, why in (("", "empty"), ("..", "must not start with a dot"), (".", "must not start with a dot"),
                     ("a/b", "must not contain /")):
        _fails(["ingest", str(small_corpus), "--name", bad], f"invalid corpus name {bad!r}: {why}")
    _fails(["ingest", str(small_corpus), "--name", "town", "--ttl", "-5"], "ttl must be 0 or more seconds")
    assert [c["name"] for c in json.loads(cag("list", "--json").stdout)["corpora"]] == ["town"]
    assert json.loads(cag("status", "town", "--json").stdout)["stale"] is False  # no ttl -5 recorded


def test_tampered_dtype_in_the_header_is_never_served(ingested):
    """Every layer tensor rewritten from F16 to BF16 in the safetensors header: same bytes, a file
    that parses. It is refused (exit 1, one line), shows as corrupt, and ingest rebuilds it."""
    import struct
    from pathlib import Path

    path = Path(ingested["path"])
    good = json.loads(cag("ask", "town", "Who keeps the lighthouse?", "--max-tokens", "8", "--json").stdout)
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + n]
    assert header.count(b'"dtype":"F16"') == 2 * 2  # keys and values of both layers of the tiny model
    header = header.replace(b'"dtype":"F16"', b'"dtype":"BF16"').rstrip(b" ")
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n:])
    _fails(["ask", "town", "Who keeps the lighthouse?"], "layer 0 is bfloat16, the header says float16")
    st = json.loads(cag("status", "town", "--json").stdout)
    assert st["stale"] is True and "snapshot is corrupt" in st["reasons"]
    assert json.loads(cag("ingest", "town", "--json").stdout)["status"] == "built"
    again = json.loads(cag("ask", "town", "Who keeps the lighthouse?", "--max-tokens", "8", "--json").stdout)
    assert again["answer"] == good["answer"]


def test_bad_models_are_refused(small_corpus, tmp_path):
    _fails(["ingest", str(small_corpus), "--model", str(tmp_path / "no-model")], "model not found")
    from transformers import LlamaConfig, LlamaForCausalLM

    # chunked attention (Llama 4's): a cache cag cannot snapshot (sliding windows it serves: test_sliding.py)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, layer_types=["chunked_attention"], attention_chunk_size=16)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "chunked")
    _fails(["ingest", str(small_corpus), "--model", str(tmp_path / "chunked")], "not supported")


def test_help_for_every_command():
    for cmd in ("ingest", "ask", "list", "status"):
        r = cag(cmd, "--help")
        assert r.exit_code == 0 and "--json" in r.stdout


def test_every_exit_code_is_documented():
    import cag.errors as errors

    from .conftest import REPO

    table = (REPO / "docs" / "cli.md").read_text().split("## Exit codes")[1].split("\n## ")[0]
    codes = {c.exit_code for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.CagError)}
    for code in codes | {0, 2, 130}:  # ok, typer's usage errors, Ctrl-C (cli/common.py)
        assert f"| `{code}` |" in table, f"exit code {code} is not in docs/cli.md's exit codes"
