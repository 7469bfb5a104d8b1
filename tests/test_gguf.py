"""GGUF files users bring (cag.model.gguf): tiny random-weight models written here with the `gguf`
package, in every tensor type cag reads, each read into a model folder and answering (`cag` == `full`);
Llama 3.1+'s rope scaling recovered from llama.cpp's rope_freqs.weight, one no Llama 3 parameters make
refused; a type it does not read, a missing or corrupt file and an architecture it does not serve refused in one
line; the folder written once and found again by the file's bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf as gg
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from bench import gguf_file
from cag.answering.query import Query
from cag.cli.main import app
from cag.config import get_settings
from cag.engine import Engine
from cag.errors import ModelError
from cag.kernels import native
from cag.model import gguf, gguf_checks, gguf_rope
from cag.model.auto_weights import on_4bit_grid
from cag.store import stamps
from tests.test_exactness import QUESTIONS
from tests.test_families import build

T = gg.GGMLQuantizationType
VOCAB = 2048  # the embedded tokenizer's first tokens and the merges that make them (a valid BPE)
WEIGHT_SCALE = 0.15  # the size of a random weight, as tests/test_families.py's models have


@pytest.fixture(scope="module")
def tokenizer_fields() -> dict:
    """The embedded GGUF's tokenizer.* fields, cut to VOCAB tokens: its merge i makes token 252 + i
    (checked), so the first VOCAB - 252 merges only make tokens kept."""
    fields = gguf_file.tokenizer_fields()
    tokens, merges = fields["tokenizer.ggml.tokens"][0], fields["tokenizer.ggml.merges"][0]
    assert all(tokens.index(merges[i].replace(" ", "")) == 252 + i for i in (0, 1, VOCAB - 253))
    for key, n in (
        ("tokenizer.ggml.tokens", VOCAB),
        ("tokenizer.ggml.token_type", VOCAB),
        ("tokenizer.ggml.merges", VOCAB - 252),
    ):
        fields[key] = (fields[key][0][:n], fields[key][1])
    return fields


# -- writing a GGUF file as llama.cpp's converter lays it out ------------------------------------------
# Where the fp16 scales sit in a K-quant block (bytes), and the values they get so weights come out near
# WEIGHT_SCALE: (d offset, dmin offset or None, d, dmin). gguf.quants only dequantizes these types.
K_SCALES = {
    T.Q2_K: (80, 82, WEIGHT_SCALE / 12, WEIGHT_SCALE / 8),  # d * (sc & 15) * q - dmin * (sc >> 4), q 0..3
    T.Q3_K: (108, None, WEIGHT_SCALE / 64, None),  # d * (sc - 32) * q, q -4..3
    T.Q4_K: (0, 2, WEIGHT_SCALE / 240, 7.5 * WEIGHT_SCALE / 240),  # d * sc * q - dmin * m, q 0..15, sc, m 0..63
    T.Q5_K: (0, 2, WEIGHT_SCALE / 500, 15.5 * WEIGHT_SCALE / 500),  # the same, q 0..31
    T.Q6_K: (208, None, WEIGHT_SCALE / 1024, None),  # d * sc * (q - 32), sc int8
}


def encode(w: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """An (out, in) float32 matrix in `qtype`: gguf.quants' quantizer where it has one, else valid
    blocks of random bytes with sane fp16 scales -> (out, bytes per row) uint8, or float rows."""
    if qtype not in K_SCALES and qtype not in (T.IQ2_XXS,):
        return gg.quants.quantize(w, qtype)
    block, size = gg.GGML_QUANT_SIZES[qtype]
    out = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)  # (out, in/256, size)
    d_at, m_at, d, m = K_SCALES.get(qtype, (0, None, WEIGHT_SCALE / 8, None))
    out[..., d_at:d_at + 2] = np.full(out.shape[:2], d, np.float16)[..., None].view(np.uint8)
    if m_at is not None:
        out[..., m_at:m_at + 2] = np.full(out.shape[:2], m, np.float16)[..., None].view(np.uint8)
    return out.reshape(w.shape[0], -1)


def write(path: Path, qtype: T, fields: dict, family: str = "llama", seed: int = 0,
          rope_freqs: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """A tiny random `family` model (hidden 256, 2 layers, heads of 64; Qwen3's of 128) as a GGUF file,
    matrices in `qtype`, vectors in F32 (as llama.cpp writes norms and biases), and `rope_freqs` as its
    rope_freqs.weight (Llama 3's rope scaling); returns the weights a reader must find, dequantized, by
    transformers name."""
    ids = dict(vocab=VOCAB, pad_token_id=2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    heads = dict(heads=2, kv_heads=1) if family == "qwen3" else {}  # transformers takes Qwen3's head_dim as 128
    model = build("llama" if family == "mistral" else family, hidden=256, init=WEIGHT_SCALE, **heads, **ids)
    rng = np.random.default_rng(seed)
    # llama.cpp writes Mistral as llama, named as one (transformers reads it as Llama)
    return gguf_file.write_gguf(model, path, qtype, fields, arch="llama" if family == "mistral" else family,
                                name="Mistral 7B Instruct v0.3" if family == "mistral" else None, rope_freqs=rope_freqs,
                                encode=lambda x: encode(x, qtype, rng), expect=True)


def engine(monkeypatch, path: Path) -> Engine:
    monkeypatch.setenv("CAG_MODEL", str(path))
    return Engine(get_settings())


def answers_as_full(engine: Engine, corpus: Path) -> None:
    engine.ingest(str(corpus))
    for q in QUESTIONS[:2]:
        cached = engine.answer(Query("corpus", q, max_tokens=12)).token_ids
        assert len(cached) == 12 and cached == engine.answer(Query("corpus", q, max_tokens=12, mode="full")).token_ids


def same_weights(folder: Path, expect: dict[str, torch.Tensor]) -> None:
    """The folder holds the file's weights exactly as gguf.quants dequantizes them, in transformers' layout."""
    got = load_file(folder / "model.safetensors")
    assert set(expect) - set(got) <= {"lm_head.weight"} and set(got) <= set(expect)  # the head: tied
    for name, t in got.items():
        assert torch.equal(t, expect[name]), name


# -- every type read -------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", gguf_checks.TYPES)
def test_each_type_is_read_and_answers(tokenizer_fields, small_corpus, tmp_path, monkeypatch, qtype):
    path = tmp_path / f"tiny.{qtype}.gguf"
    expect = write(path, T[qtype], tokenizer_fields)
    eng = engine(monkeypatch, path)
    same_weights(gguf.materialize(path, get_settings().models_dir), expect)
    answers_as_full(eng, small_corpus)


@pytest.mark.parametrize(("qtype", "head"), [("Q4_0", "int4"), ("Q8_0", "q8")])
def test_a_head_on_int4s_grid_stays_int4(tokenizer_fields, small_corpus, tmp_path, monkeypatch, qtype, head):
    """A tied token embedding stored in 4 bits (Q4_0) is held as it is in int4 with cag's kernels, no
    bigger q8 copy read each step; one in 8 bits keeps q8, and the int4 head's bytes are int4's."""
    if why := native.why_not():
        pytest.skip(f"cag's kernels cannot run here: {why}")
    path = tmp_path / f"tiny.{qtype}.gguf"
    expect = write(path, T[qtype], tokenizer_fields)
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    monkeypatch.setenv("CAG_DECODE_KERNELS", "avx512")
    eng = engine(monkeypatch, path)
    lm_head = eng.lm.model.lm_head
    assert lm_head.fmt == head and (lm_head.packs.questions is None)
    if qtype == "Q4_0":  # every int4 copy in Q4_0's layout, its steps alone: 18 bytes a group of 32
        assert all(
            m.packs.packed[1].shape[0] == 1 for m in eng.lm.model.modules() if getattr(m, "fmt", None) == "int4"
        )
    if head == "int4":  # the head's logits: the file's weights exactly, times the rows' 8-bit codes
        from tests.test_products import q8_reference

        x = torch.randn(3, lm_head.in_features)
        want = q8_reference(x.bfloat16(), expect["lm_head.weight"]).float()
        assert torch.allclose(lm_head.decode(x), want, rtol=1e-4, atol=1e-3)
    answers_as_full(eng, small_corpus)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3", "mistral"])
def test_each_family_is_read_and_answers(tokenizer_fields, small_corpus, tmp_path, monkeypatch, family):
    """Qwen3's head width comes from the file (attention.key_length), which transformers' reader leaves
    at its config class's default; a Mistral file is Llama's layer, as llama.cpp writes it."""
    path = tmp_path / f"tiny-{family}.gguf"
    expect = write(path, T.Q8_0, tokenizer_fields, family)
    eng = engine(monkeypatch, path)
    assert type(eng.lm.model).__name__.lower().startswith("llama" if family == "mistral" else family)
    same_weights(gguf.materialize(path, get_settings().models_dir), expect)
    answers_as_full(eng, small_corpus)


# -- Llama 3.1+'s rope scaling ---------------------------------------------------------------------------
# Tiny-model Llama 3 parameters (heads of 64, rope_theta 10000): wavelengths 2 pi 10000^(i / 32) put
# frequencies 0-3 below original / high_freq_factor = 16 (factor 1), 4-8 in the blend up to 64, 9-31 scaled
LLAMA3 = [dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
          dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)]


def rope_freqs(base: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float,
               original_max_position_embeddings: int) -> np.ndarray:
    """llama.cpp's converter's rope_freqs.weight for Llama 3 rope scaling, its loop as it writes it:
    per frequency, the factor dividing it -> (dim / 2,) float32."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old = original_max_position_embeddings
    low_wave, high_wave = old / low_freq_factor, old / high_freq_factor
    out = []
    for f in freqs.tolist():
        wave = 2 * math.pi / f
        if wave < high_wave:
            out.append(1.0)
        elif wave > low_wave:
            out.append(factor)
        else:
            smooth = (old / wave - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


@pytest.mark.parametrize("rope", LLAMA3, ids=["factor8", "factor32"])
def test_llama3_rope_scaling_is_read_and_answers(tokenizer_fields, small_corpus, tmp_path, monkeypatch, rope):
    import transformers

    factors = rope_freqs(10000.0, 64, **rope)
    assert (
        (factors == 1).sum() >= 2
        and (factors == rope["factor"]).sum() >= 2
        and ((factors > 1) & (factors < rope["factor"])).sum() >= 2
    )
    path = tmp_path / "tiny-llama3.gguf"
    expect = write(path, T.Q8_0, tokenizer_fields, rope_freqs=factors)
    eng = engine(monkeypatch, path)
    folder = gguf.materialize(path, get_settings().models_dir)
    same_weights(folder, expect)  # rope_freqs.weight among none of them
    got = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert got == {"rope_type": "llama3", "rope_theta": 10000.0, **rope}
    c = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096,
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, **rope})
    direct = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(c).inv_freq  # (32,)
    assert torch.equal(eng.lm.model.model.rotary_emb.inv_freq, direct)
    assert not torch.equal(direct, transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        transformers.LlamaConfig(hidden_size=256, num_attention_heads=4)).inv_freq)  # scaled, not plain
    answers_as_full(eng, small_corpus)


@pytest.mark.parametrize(("base", "dim", "rope"), [
    (500000.0, 128, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)),
    (500000.0, 64, dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)),
    (10000.0, 64, dict(factor=16.0, low_freq_factor=1.0, high_freq_factor=2.5, original_max_position_embeddings=100)),
], ids=["llama3.1-8b", "llama3.2-1b", "other"])
def test_llama3_rope_parameters_are_recovered_from_the_tensor(base, dim, rope):
    """At Llama 3.1 8B's and 3.2 1B's own head widths and bases, and at parameters of no Llama."""
    assert gguf_rope.llama3_rope(rope_freqs(base, dim, **rope), base, dim, 131072) == {"rope_type": "llama3", **rope}


@pytest.mark.parametrize(("dim", "original", "blended"), [(16, 3000, 1), (8, 1000, 0), (8, 20000, 0)])
def test_llama3_rope_with_few_blended_frequencies_is_recovered(dim, original, blended):
    """Heads so narrow (base 500000) that one blended factor, or none, leaves the boundaries open: Llama 3's
    ratio high_freq_factor / low_freq_factor = 4 closes them, and the tensor is still made exactly."""
    rope = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=original)
    factors = rope_freqs(500000.0, dim, **rope)
    assert ((factors > 1) & (factors < 8)).sum() == blended
    got = gguf_rope.llama3_rope(factors, 500000.0, dim, 131072)
    assert got and got["factor"] == 8 and got["low_freq_factor"] == 1 and got["high_freq_factor"] == 4
    assert rope_freqs(500000.0, dim, **{k: v for k, v in got.items() if k != "rope_type"}).tolist() == factors.tolist()


def test_llama3_original_context_from_metadata_is_kept():
    """Boundaries 64 and 16 are low/high_freq_factor 1/4 of 64 or 2/8 of 128: metadata's context decides."""
    rope = dict(factor=8.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=128)
    got = gguf_rope.llama3_rope(rope_freqs(10000.0, 64, **rope), 10000.0, 64, 4096, original=128)
    assert got == {"rope_type": "llama3", **rope}
    assert gguf_rope.llama3_rope(np.ones(32, np.float32), 10000.0, 64) is None  # all 1: no scaling at all


def test_a_rope_freqs_tensor_no_llama3_parameters_make_is_refused(tokenizer_fields, small_corpus, tmp_path):
    factors = rope_freqs(10000.0, 64, **LLAMA3[0])
    factors[6] *= 1.01  # one blended factor off the line the others lie on
    path = tmp_path / "odd-rope.gguf"
    write(path, T.Q8_0, tokenizer_fields, rope_freqs=factors)
    _fails(["ingest", str(small_corpus), "--model", str(path)],
           "GGUF file odd-rope.gguf: its rope scaling (tensor rope_freqs.weight) is not Llama 3's")
    for odd in (np.linspace(1, 3, 32), np.ones(31), np.full(32, 0.5)):  # no plateaus; a wrong length; below 1
        assert gguf_rope.llama3_rope(odd.astype(np.float32), 10000.0, 64) is False


# -- refused in one line ---------------------------------------------------------------------------------
def _fails(args: list[str], message: str) -> None:
    r = CliRunner().invoke(app, args, catch_exceptions=False)
    assert r.exit_code == 1, r.output
    assert message in r.stderr and "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_type_not_read_is_refused_in_one_line(tokenizer_fields, small_corpus, tmp_path):
    path = tmp_path / "tiny.IQ2_XXS.gguf"
    write(path, T.IQ2_XXS, tokenizer_fields)
    _fails(["ingest", str(small_corpus), "--model", str(path)],
           "tensor token_embd.weight is IQ2_XXS, a type cag does not read (it reads F32, F16, BF16, Q4_0")


def test_a_missing_or_corrupt_file_is_refused_in_one_line(tokenizer_fields, small_corpus, tmp_path):
    _fails(["ingest", str(small_corpus), "--model", str(tmp_path / "none.gguf")], "model not found")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 100)
    _fails(["ingest", str(small_corpus), "--model", str(junk)], "cannot read GGUF file junk.gguf")
    good = tmp_path / "good.gguf"
    write(good, T.Q8_0, tokenizer_fields)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    _fails(["ingest", str(small_corpus), "--model", str(cut)], "cannot read GGUF file cut.gguf")


def test_an_architecture_not_served_is_refused(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gg.GGUFWriter(path, "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="architecture 'mamba' is not one cag reads"):
        gguf_checks.check(path)


def test_a_phi3_long_rope_file_is_refused_not_read_with_the_wrong_rope(tmp_path):
    """Phi-3 128k keeps its long-context rope as rope_factors_long/short tensors, which transformers'
    reader drops: refused in one line rather than answered with the wrong frequencies."""
    path = tmp_path / "phi3-128k.gguf"
    w = gg.GGUFWriter(path, "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.add_tensor("rope_factors_long.weight", np.ones(8, np.float32))
    w.add_tensor("rope_factors_short.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ModelError, match="long-context rope scaling .rope_factors_long.weight, rope_factors_short.weight."
    ) as e:
        gguf_checks.check(path)
    assert "\n" not in str(e.value)


# -- read once --------------------------------------------------------------------------------------------
def test_the_folder_is_written_once_and_found_by_the_files_bytes(tokenizer_fields, tmp_path, monkeypatch):
    models = tmp_path / "models"
    path = tmp_path / "a.gguf"
    write(path, T.Q4_0, tokenizer_fields)
    monkeypatch.setattr(stamps, "SETTLE_S", 0.0)  # written just now, yet remembered (the race is not tested here)
    folder = gguf.materialize(path, models)
    assert json.loads((models / "gguf" / gguf.DIGESTS).read_text())[str(path)]["digest"].startswith("blake3:")

    def never(*_):
        raise AssertionError("done twice")

    with monkeypatch.context() as m:
        m.setattr(gguf, "_dequantized", never)
        m.setattr(gguf.blake3, "blake3", never)  # a remembered digest is not computed again
        assert gguf.materialize(path, models) == folder
    renamed = path.rename(tmp_path / "b.gguf")
    with monkeypatch.context() as m:
        m.setattr(gguf, "_dequantized", never)
        assert gguf.materialize(renamed, models) == folder  # same bytes, same folder
    write(renamed, T.Q8_0, tokenizer_fields)  # other bytes: a folder of their own
    assert gguf.materialize(renamed, models) != folder


# -- int4's grid ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("qtype", "on_grid"), [("Q4_1", True), ("Q4_0", True), ("Q4_K", False)])
def test_which_types_lie_on_int4s_grid(tokenizer_fields, tmp_path, qtype, on_grid):
    """on_4bit_grid (what `auto` picks int4 by) finds each group's grid (layouts.grid4): Q4_1's groups
    span theirs min to max, Q4_0's (d * (q - 8)) are found by their value of largest magnitude (-8 d);
    Q4_K's groups of 32 need not use both q = 0 and 15, so it falls back to bf16 under `auto`. On the
    grid, int4's packed copy (cag's kernels' layout: w = m + q * d, d and m float16) holds every weight
    exactly."""
    from transformers import AutoModelForCausalLM

    from cag.model.layouts import pack_int4

    path = tmp_path / f"grid.{qtype}.gguf"
    write(path, T[qtype], tokenizer_fields)
    model = AutoModelForCausalLM.from_pretrained(gguf.materialize(path, tmp_path / "models"))
    if on_grid:
        for lin in (model.model.layers[0].self_attn.q_proj, model.model.layers[1].mlp.down_proj):
            w = lin.weight.detach()
            qw, dm = pack_int4(w)  # (out, in/2) uint8, (out, 2, in/32) float16
            q = torch.cat([qw.view(-1, w.shape[1] // 32, 16) & 15, qw.view(-1, w.shape[1] // 32, 16) >> 4], -1).float()
            d, m = dm[:, 0, :, None].float(), dm[:, 1, :, None].float()
            assert torch.equal((m + q * d).reshape(w.shape), w), qtype
    assert on_4bit_grid(model) == on_grid


@pytest.mark.parametrize("kernels", ["avx512", "avx2"])
def test_q4_0_layers_in_one_call_are_the_separate_ops(tokenizer_fields, tmp_path, monkeypatch, kernels):
    """decode_layers (AVX-512's and AVX2's) over Q4_0's layout (steps alone) gives the separate products' logits and
    K/V bit for bit."""
    from tests.test_native import fused_is_separate

    if why := native.avx2_why_not() if kernels == "avx2" else native.why_not():
        pytest.skip(f"cag's {kernels} kernels cannot run here: {why}")
    path = tmp_path / "tiny.Q4_0.gguf"
    write(path, T.Q4_0, tokenizer_fields)
    fused_is_separate(path, monkeypatch, 300, [0, 3, 6], [0, 1, 0], "int4", "llama", kernels)
