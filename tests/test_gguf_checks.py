"""GGUF files whose metadata and tensors disagree, or whose metadata is absurdly large (issue 55, E2 and E3),
refused by cag.model.gguf_checks.check in one line before transformers builds anything, so no model folder is
written: missing tensors (transformers would initialize them at random), hyperparameters the tensors do not
have (a 100000-block model to allocate), and metadata strings and arrays past cag's caps (transformers'
reader turns each into Python objects). Each file is the tiny random model of tests/test_gguf.py,
rewritten with the `gguf` package's writer."""

from __future__ import annotations

from pathlib import Path

import gguf as gg
import pytest
from typer.testing import CliRunner

from cag.cli.main import app
from cag.model import gguf_checks
from tests.test_gguf import tokenizer_fields, write  # noqa: F401  (tokenizer_fields: a fixture used here)

V = gg.GGUFValueType


@pytest.fixture(scope="module")
def good(tokenizer_fields, tmp_path_factory) -> Path:  # noqa: F811
    """A tiny llama (2 blocks, hidden 256, vocab 2048, tied head) that cag reads."""
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    write(path, gg.GGMLQuantizationType.Q8_0, tokenizer_fields)
    return path


def rewrite(src: Path, dst: Path, arch: str | None = None, meta: dict | None = None, keep=lambda name: True) -> Path:
    """`src` as `dst`: the same metadata but `meta` (key -> (value, type)), under architecture `arch` (its
    keys renamed), and the tensors `keep` keeps, bytes as they are."""
    r = gg.GGUFReader(src)
    old = r.fields["general.architecture"].contents()
    arch = arch or old
    w = gg.GGUFWriter(dst, arch)
    fields = {k.replace(f"{old}.", f"{arch}.", 1): (f.contents(), f.types[0]) for k, f in r.fields.items()
              if not k.startswith("GGUF.") and k != "general.architecture"}
    for key, (value, kind) in (fields | (meta or {})).items():
        if kind == V.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, kind)
    for t in r.tensors:
        if keep(t.name):
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def refused(path: Path, tmp_path: Path, monkeypatch, *messages: str) -> str:
    """`cag info --model path`: exit 1, one line holding each of `messages`, and no model folder written."""
    models = tmp_path / "models"
    monkeypatch.setenv("CAG_MODELS_DIR", str(models))
    r = CliRunner().invoke(app, ["info", "--model", str(path)], catch_exceptions=False)
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for m in messages:
        assert m in r.stderr, r.stderr
    assert not [p for p in (models / "gguf").glob("*") if p.is_dir()]  # nothing read into a folder
    return r.stderr


def test_the_good_file_passes_the_checks(good):
    assert gguf_checks.check(good).arch == "llama"


# -- E2: tensors the architecture needs ---------------------------------------------------------------------
def test_a_file_without_tensors_is_refused(good, tmp_path, monkeypatch):
    path = rewrite(good, tmp_path / "no_tensors.gguf", keep=lambda name: False)
    refused(path, tmp_path, monkeypatch, "no_tensors.gguf", "lacks 20 of the tensors",
            "token_embd.weight, output_norm.weight, blk.0.attn_norm.weight")


def test_a_file_with_only_the_token_embedding_is_refused(good, tmp_path, monkeypatch):
    path = rewrite(good, tmp_path / "only_embd.gguf", keep=lambda name: name == "token_embd.weight")
    err = refused(path, tmp_path, monkeypatch, "lacks 19 of the tensors", "output_norm.weight, blk.0.attn_norm.weight")
    assert "token_embd.weight" not in err


def test_qwen2_over_llamas_tensors_is_refused_for_its_missing_biases(good, tmp_path, monkeypatch):
    path = rewrite(good, tmp_path / "qwen2_with_llama_tensors.gguf", arch="qwen2")
    refused(
        path, tmp_path, monkeypatch, "lacks 6 of the tensors", "blk.0.attn_q.bias, blk.0.attn_k.bias, blk.0.attn_v.bias"
    )


def test_a_missing_block_is_refused(good, tmp_path, monkeypatch):
    path = rewrite(good, tmp_path / "one_block.gguf", keep=lambda name: not name.startswith("blk.1."))
    refused(path, tmp_path, monkeypatch, "lacks 9 of the tensors", "blk.1.attn_norm.weight")


# -- E3: hyperparameters the tensors do not have --------------------------------------------------------------
def test_a_block_count_of_100000_over_one_tensor_is_refused(good, tmp_path, monkeypatch):
    """The issue's huge_hparams.gguf: transformers would allocate 100000 blocks of width 65536."""
    huge = {"llama.block_count": (100000, V.UINT32), "llama.embedding_length": (65536, V.UINT32),
            "llama.feed_forward_length": (262144, V.UINT32), "llama.attention.head_count": (64, V.UINT32),
            "llama.attention.head_count_kv": (64, V.UINT32)}
    path = rewrite(good, tmp_path / "huge_hparams.gguf", meta=huge, keep=lambda name: name == "token_embd.weight")
    refused(path, tmp_path, monkeypatch, "lacks 900001 of the tensors", "for its 100000 blocks (llama.block_count)")


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        (
            {"llama.embedding_length": (65536, V.UINT32)},
            "tensor token_embd.weight is [256, 2048] where its metadata says [65536, 2048]",
        ),
        (
            {"llama.feed_forward_length": (262144, V.UINT32)},
            "tensor blk.0.ffn_gate.weight is [256, 512] where its metadata says [256, 262144]",
        ),
        (
            {"llama.attention.head_count": (64, V.UINT32)},
            "tensor blk.0.attn_q.weight is [256, 256] where its metadata says [256, 4096]",
        ),
        ({"llama.block_count": (1, V.UINT32)}, "holds tensors of block 1, past its llama.block_count 1"),
        ({"llama.block_count": (0, V.UINT32)}, "llama.block_count is 0, not a whole number from 1"),
    ],
    ids=["embedding_length", "feed_forward_length", "head_count", "fewer_blocks", "no_blocks"],
)
def test_hyperparameters_the_tensors_do_not_have_are_refused(good, tmp_path, monkeypatch, meta, message):
    refused(rewrite(good, tmp_path / "lying.gguf", meta=meta), tmp_path, monkeypatch, "lying.gguf", message)


# -- E3: metadata of absurd length -------------------------------------------------------------------------
def test_a_5mb_metadata_string_is_refused(good, tmp_path, monkeypatch):
    meta = {"general.description": ("x" * (5 << 20), V.STRING)}
    path = rewrite(good, tmp_path / "long_string.gguf", meta=meta)
    refused(
        path,
        tmp_path,
        monkeypatch,
        "metadata general.description is a string of 5242880 bytes, over cag's cap of 1 MiB",
    )


def test_a_long_metadata_array_is_refused(good, tmp_path, monkeypatch):
    meta = {"general.tags": (["t"] * 70000, V.ARRAY)}
    path = rewrite(good, tmp_path / "long_array.gguf", meta=meta)
    refused(path, tmp_path, monkeypatch, "metadata general.tags is an array of 70000 entries, over cag's cap of 65536")


def test_a_256k_token_vocabulary_is_within_the_caps(tmp_path):
    """A tokenizer as large as real ones (Gemma's 262144 tokens, and as many merges and scores) passes
    the metadata caps; only its arrays are allowed that long."""
    path = tmp_path / "vocab.gguf"
    w = gg.GGUFWriter(path, "llama")
    n = 262144
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(n)])
    w.add_array("tokenizer.ggml.merges", [f"a{i} b" for i in range(n)])
    w.add_array("tokenizer.ggml.scores", [0.0] * n)
    w.add_array("tokenizer.ggml.token_type", [1] * n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gguf_checks.check_metadata_sizes(path)  # no error
