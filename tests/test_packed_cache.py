"""Packed weights kept on disk (cag.model.packed_cache): a later load reads the very bytes packing made,
a damaged or foreign file is never used, and answers do not change."""

from __future__ import annotations

import logging

import pytest
import torch

from cag.model import weights
from cag.model.loading import load_model


def packed_tensors(lm) -> dict[str, torch.Tensor]:
    """Every plain tensor of every packed copy, by module and position."""
    out = {}
    for name, m in lm.model.named_modules():
        if isinstance(m, weights.FastLinear) and not m.cols or isinstance(m, weights.FastLinear) and m.cols[0] == 0:
            p = m.packs.packed  # a group's copy, once: at its first member
            for i, t in enumerate(p if isinstance(p, tuple) else (p,)):
                if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                    out[f"{name}/{i}"] = t
    return out


def greedy(lm, n: int = 12) -> list[int]:
    ids = torch.tensor([lm.tokenizer("The lighthouse keeper is").input_ids])
    with torch.no_grad(), weights.decoding():
        out = lm.model.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_second_load_reads_the_bytes_the_first_packed(tiny64_model_dir, tmp_path, fmt):
    first = load_model(str(tiny64_model_dir), tmp_path, weights=fmt, keep_packed=True)
    files = list((tmp_path / "packed").glob("*.safetensors"))
    assert len(files) == 1
    made = packed_tensors(first)
    assert made, "nothing packed: the test would prove nothing"
    again = load_model(str(tiny64_model_dir), tmp_path, weights=fmt, keep_packed=True)
    read = packed_tensors(again)
    assert made.keys() == read.keys()
    assert all(torch.equal(made[k], read[k]) and made[k].dtype == read[k].dtype for k in made)
    plain = load_model(str(tiny64_model_dir), tmp_path / "elsewhere", weights=fmt, keep_packed=False)
    assert not (tmp_path / "elsewhere" / "packed").exists()
    assert greedy(again) == greedy(first) == greedy(plain)


def test_a_damaged_file_is_deleted_and_packed_again(tiny64_model_dir, tmp_path, caplog):
    first = load_model(str(tiny64_model_dir), tmp_path, weights="int4", keep_packed=True)
    (path,) = (tmp_path / "packed").glob("*.safetensors")
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # a flipped bit in the last tensor's bytes: the header still parses
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="cag.packed"):
        again = load_model(str(tiny64_model_dir), tmp_path, weights="int4", keep_packed=True)
    assert "not used" in caplog.text and "checksum" in caplog.text
    made, read = packed_tensors(first), packed_tensors(again)
    assert all(torch.equal(made[k], read[k]) for k in made)
    assert path.exists() and path.read_bytes() != bytes(raw)  # written again, whole
    path.write_bytes(b"not a safetensors file")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cag.packed"):
        third = load_model(str(tiny64_model_dir), tmp_path, weights="int4", keep_packed=True)
    assert "not used" in caplog.text
    assert all(torch.equal(made[k], t) for k, t in packed_tensors(third).items())


def test_another_packing_of_the_model_replaces_the_file(tiny64_model_dir, tmp_path):
    load_model(str(tiny64_model_dir), tmp_path, weights="int4", keep_packed=True)
    (int4,) = (tmp_path / "packed").glob("*.safetensors")
    load_model(str(tiny64_model_dir), tmp_path, weights="int8", keep_packed=True)
    (int8,) = (tmp_path / "packed").glob("*.safetensors")  # one file a model: its last packing
    assert int8 != int4 and not int4.exists()
    load_model(str(tiny64_model_dir), tmp_path, weights="fp32", keep_packed=True)  # nothing packed: nothing kept
    assert list((tmp_path / "packed").glob("*.safetensors")) == [int8]


def test_an_unwritable_folder_costs_only_the_packing(tiny64_model_dir, tmp_path):
    (tmp_path / "packed").write_text("a file where the folder would be")
    lm = load_model(str(tiny64_model_dir), tmp_path, weights="int4", keep_packed=True)
    assert lm.weights == "int4" and packed_tensors(lm)
