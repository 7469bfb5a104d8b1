"""The fast step (cag.runtime.step) for each family it covers: Llama, Mistral, Qwen2 (Llama's layer), Qwen3 (q/k
norms per head), Phi-3 (fused q/k/v and gate/up), Granite (multipliers), OLMo-2 (post-norms, q/k norms over
the projection), on tiny random-weight models built from their transformers configs.

* the step's logits and K/V equal the transformers forward's bit for bit, in float32 and bfloat16, when its
  attention is the forward's own call over the same keys (the step reads a shared prefix and a request's own
  suffix apart, merged by log-sum-exp: through that, within float tolerance, as for every family);
* `cag` == `full` token for token, alone and asked together, through torch's kernels (fp32) and cag's
  (bf16 and int4 weights: all layers in one native call, each family's pieces in it, the same bits as the
  separate native calls);
* what the step does not compute is refused with the reason (partial rotary, longrope)."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
import transformers

from bench.common import family_config
from cag.config import get_settings
from cag.engine import Engine
from cag.kernels import native
from cag.model import prefill_attention
from cag.runtime import attention, describe
from cag.runtime import step as lean
from cag.runtime.slots import PrefixKV, Slots
from tests import test_step as ts
from tests.conftest import HANDBOOK, _train_tokenizer
from tests.cpu import formats
from tests.test_batch import cached_is_full_alone_and_together
from tests.test_exactness import QUESTIONS

NEW = ["qwen3", "phi3", "granite", "olmo2"]
FAMILIES = ["llama", "mistral", "qwen2", *NEW]
CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
           "granite": "Granite", "olmo2": "Olmo2"}


def config(
    name: str, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 300, init: float = 0.3, **extra
):
    """A 2-layer config of family `name` (heads of hidden / heads), without sliding windows."""
    c = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
             num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
             initializer_range=init, pad_token_id=0, bos_token_id=1, eos_token_id=2) | extra
    # multipliers far from 1 (Granite-3's are 12, 0.22, 1/128 and 8 at their sizes)
    granite = dict(
        embedding_multiplier=2.5,
        residual_multiplier=0.6,
        attention_multiplier=0.7 / math.sqrt(hidden // heads),
        logits_scaling=0.4,
    )
    return family_config(name, granite, **c)


def build(name: str, dtype=torch.float32, **kw) -> torch.nn.Module:
    """A tiny random model of family `name`; norm weights random too (a norm applied in the wrong place,
    or not at all, changes the logits)."""
    torch.manual_seed(1)
    model = getattr(transformers, CLASSES[name] + "ForCausalLM")(config(name, **kw))
    for n, p in model.named_parameters():
        if n.endswith("norm.weight"):
            torch.nn.init.normal_(p, 1.0, 0.3)
    if name == "qwen2":
        torch.nn.init.normal_(model.model.layers[0].self_attn.q_proj.bias, std=0.5)  # biases that matter
    model = model.to(dtype).eval()
    prefill_attention.install(model)
    return model


def same_attention(r, q, K, V, i, scale, up, kernel=None, few=False, paired=False, window=None, softcap=None):
    """In place of attention.attend, for one request: the forward's own attention call (cag.model.prefill_attention's
    packed GQA over transformers' causal mask) over its prefix's keys followed by its suffix's."""
    ((prefix, _),) = r.groups
    slot, seen, m = int(r.slots_cpu[0]), int(r.lens[0]), r.m
    Kp, Vp = prefix.kv[i]
    keys, values = torch.cat([Kp, K[slot : slot + 1, :, :seen]], 2), torch.cat([Vp, V[slot : slot + 1, :, :seen]], 2)
    n, (H, D) = keys.shape[2], q.shape[1:]
    mask = torch.ones(m, n, dtype=torch.bool).tril(n - m)[None, None]  # (1, 1, m, n): row t sees keys up to n - m + t
    out, _ = prefill_attention.packed_gqa_sdpa(
        None, q.view(1, m, H, D).transpose(1, 2), keys, values, mask, scaling=scale
    )
    return out.reshape(m, H * D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_step_is_the_forward_bit_for_bit(name, dtype, monkeypatch):
    """A question over a shared prefix, then 8 decode steps: logits and the K/V written equal the
    transformers forward's over one contiguous cache, bit for bit, with the attention call made the same."""
    model = build(name, dtype)
    assert type(model).__name__ == CLASSES[name] + "ForCausalLM" and lean.why_not(model) is None
    monkeypatch.setattr(attention, "attend", same_attention)
    monkeypatch.setitem(ts.TOLERANCE, dtype, 0.0)
    ts.assert_steps_match(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", NEW)
def test_the_step_is_the_forward_within_tolerance(name, dtype, monkeypatch):
    """Through the step's own attention (prefix and suffix apart, merged): within float tolerance (Granite's
    logits are divided by its logits_scaling, and their differences with them)."""
    model = build(name, dtype)
    if name == "granite":
        monkeypatch.setitem(ts.TOLERANCE, dtype, ts.TOLERANCE[dtype] / model.config.logits_scaling)
    ts.assert_steps_match(model)


def test_what_the_step_does_not_compute_is_refused():
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 256}
    assert "partial rotary" in lean.why_not(build("phi3", partial_rotary_factor=0.5))
    assert "longrope" in lean.why_not(build("phi3", rope_parameters=rope, original_max_position_embeddings=256))
    model = build("qwen3")
    model.model.layers[1].self_attn.k_norm = torch.nn.LayerNorm(16)
    assert lean.why_not(model) == "q/k norms of another kind" and lean.for_model(model) is None


# -- through the engine: tiny models with the tokenizer of the tiny fixture, heads of 64 ---------------
@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    """Each new family as a Hugging Face folder (hidden 256, 4 heads of 64, 2 K/V heads), built once."""
    return {name: model_dir(tmp_path_factory.mktemp(f"tiny-{name}"), name, hidden=256) for name in NEW}


@functools.cache
def _tokenizer():
    return _train_tokenizer(
        [p.read_text() for p in sorted(HANDBOOK.glob("*.md"))] + ["What is the answer? The answer is 42."]
    )


def model_dir(folder: Path, name: str, **shape) -> Path:
    """A tiny random model of family `name` (`shape`: build's hidden, heads, kv_heads) saved with the handbook's
    tokenizer in `folder`."""
    tok = _tokenizer()
    ids = dict(
        vocab=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
    )
    build(name, init=0.15, tie_word_embeddings=True, **shape, **ids).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _engine(monkeypatch, folder: Path, weights: str, kernels: str) -> Engine:
    if kernels != "torch" and (why := native.why_not()):
        pytest.skip(f"cag's kernels cannot run here: {why}")
    monkeypatch.setenv("CAG_MODEL", str(folder))
    monkeypatch.setenv("CAG_WEIGHTS", weights)
    monkeypatch.setenv("CAG_DECODE_KERNELS", kernels)
    return Engine(get_settings())


@pytest.mark.parametrize(("weights", "kernels"), formats(("fp32", "torch"), ("bf16", "avx512"), ("int4", "avx512")))
@pytest.mark.parametrize("name", NEW)
def test_cag_equals_full_alone_and_together(family_dirs, small_corpus, monkeypatch, name, weights, kernels):
    engine = _engine(monkeypatch, family_dirs[name], weights, kernels)
    step = lean.for_model(engine.lm.model)
    native_path = "none" if kernels == "torch" else "layers"
    assert describe.decode_path(engine.lm) == {
        "weights": weights,
        "arithmetic": "int4-q8" if weights == "int4" else weights,  # int4 multiplies 8-bit activations on avx512
        "kernels": kernels,
        "kernels_reason": engine.lm.kernels_why,
        "step": "fast",
        "step_reason": None,
        "native": native_path,
    }
    assert (step.glue is not None) == (kernels != "torch") and (step.fused is not None) == (native_path == "layers")
    engine.ingest(str(small_corpus))
    cached_is_full_alone_and_together(engine, QUESTIONS[:3], 16)


@pytest.mark.parametrize("name", NEW)
@torch.inference_mode()
def test_the_native_glue_computes_the_family(family_dirs, monkeypatch, name):
    """cag's kernels around a family's own pieces (bf16 weights, the separate native calls): the step's logits
    stay within bf16's rounding of the same step through torch's kernels, while leaving out a q/k norm or the
    residual multiplier moves them far more (measured: 14-160x; so each piece is computed on the native path
    too). The one-call layers give these separate calls' bits (test_layers_in_one_native_call_are_the_separate_ops)."""
    glue_is_near_torch(_engine(monkeypatch, family_dirs[name], "bf16", "avx512").lm.model, name)


def glue_is_near_torch(model, name: str) -> None:
    """The step's logits through its native glue and attention against the same step through torch's (the same
    products), and the same with a family's piece left out (test_the_native_glue_computes_the_family)."""
    step = lean.for_model(model)
    assert step.glue is not None
    prefix = PrefixKV.of(ts.prefix_of(model).kv, torch.bfloat16, "cpu")  # what decode reads: bf16 K/V

    def logits(glue, kernel=step.kernel, fused=None):
        saved = step.glue, step.kernel, step.fused
        step.glue, step.kernel, step.fused = glue, kernel, fused
        try:
            slots = Slots(*ts.shapes(model), 32, 1, torch.bfloat16)
            slots.take()
            ts.one_part(step, torch.tensor([ts.QUESTION]), [prefix], torch.tensor([0]), torch.tensor([0]), slots)
            return torch.cat(
                [
                    ts.one_part(
                        step,
                        torch.tensor([[t]]),
                        [prefix],
                        torch.tensor([0]),
                        torch.tensor([len(ts.QUESTION) + i]),
                        slots,
                    )
                    for i, t in enumerate((5, 9, 11))
                ]
            )
        finally:
            step.glue, step.kernel, step.fused = saved

    native_ = logits(step.glue)
    torch_ = logits(None, None, None)
    # measured: 0.5-0.8% of the scale over bf16 activations; 3.2-3.4% where int4 multiplies 8-bit codes (AVX2 and
    # AVX-512 alike): a last-bit change of a product's bf16 input can move its code, and these random 4-layer models
    # carry it to the logits
    scale, kernels_apart = torch_.abs().mean(), (native_ - torch_).abs().mean()
    assert kernels_apart < 0.05 * scale
    if name in ("qwen3", "olmo2"):  # the q/k norms left out
        saved = [f.qk for f in step.fns]
        step.fns = [f._replace(qk=None) for f in step.fns]
        try:
            assert (logits(step.glue) - native_).abs().mean() > max(3 * kernels_apart, 0.1 * scale)
        finally:
            step.fns = [f._replace(qk=q) for f, q in zip(step.fns, saved)]
    if name == "granite":
        saved = step.residual
        step.residual = None
        try:
            assert (logits(step.glue) - native_).abs().mean() > max(3 * kernels_apart, 0.1 * scale)
        finally:
            step.residual = saved


@pytest.mark.parametrize(("weights", "kernels"), formats(("int4", "avx512"), ("bf16", "avx512"), ("int4", "avx2")))
@pytest.mark.parametrize("name", NEW)
def test_layers_in_one_native_call_are_the_separate_ops(family_dirs, monkeypatch, name, weights, kernels):
    """decode_layers (the AVX-512 library's and the AVX2 one's) computes each family's layer (Phi-3's fused q/k/v
    and gate/up as its own packed copies, Qwen3's and OLMo-2's q/k norms, OLMo-2's post-norms, Granite's residual
    multiplier) and gives the separate native calls' logits and K/V bit for bit (test_native's check, on each
    family)."""
    from tests.test_native import fused_is_separate

    if why := native.avx2_why_not() if kernels == "avx2" else native.why_not():
        pytest.skip(f"cag's {kernels} kernels cannot run here: {why}")
    fused_is_separate(family_dirs[name], monkeypatch, 300, [0, 3, 6], [0, 1, 0], weights, name, kernels)


def test_heads_of_80_in_one_native_call_are_the_separate_ops(tmp_path, monkeypatch):
    """Heads of 80 (a half group of 16 dims after two of 32): decode_layers gives the separate ops' logits and
    K/V bit for bit (test_native's check, on a Llama with heads of 80)."""
    from tests.test_native import fused_is_separate

    if why := native.why_not():
        pytest.skip(f"cag's kernels cannot run here: {why}")
    fused_is_separate(model_dir(tmp_path, "llama", hidden=320, heads=4, kv_heads=2), monkeypatch,
        300,
        [0, 3, 6],
        [0, 1, 0],
        "int4",
        "llama",
    )


@pytest.mark.parametrize(("family", "hidden", "heads", "kv_heads", "kv_dtype"), [
    ("phi3", 384, 4, 2, "auto"), ("llama", 512, 2, 1, "auto"),
    ("llama", 320, 4, 2, "auto"), ("llama", 320, 4, 2, "int8"),  # heads of 80 (Phi-2's), over bf16 and int8 snapshots
])
def test_heads_of_80_96_and_256_decode_through_the_native_layers(
    tmp_path, small_corpus, monkeypatch, family, hidden, heads, kv_heads, kv_dtype
):
    """Heads of 80 (Phi-2's), 96 (Phi-3-mini's) and 256 go through cag's attention and all layers in one call:
    cag == full, alone and together, int4 weights. An int8 snapshot of heads of 80 (one block a head) is read
    as its codes by the int8 kernel."""
    monkeypatch.setenv("CAG_KV_DTYPE", kv_dtype)
    engine = _engine(
        monkeypatch, model_dir(tmp_path, family, hidden=hidden, heads=heads, kv_heads=kv_heads), "int4", "avx512"
    )
    assert engine.lm.head_dim == hidden // heads and describe.decode_path(engine.lm)["native"] == "layers"
    engine.ingest(str(small_corpus))
    cached_is_full_alone_and_together(engine, QUESTIONS[:3], 12)
    (res,) = engine.resident._items.values()
    pairs = res.prefix.made["pairs"]  # pair_kv8's (uint8) over an int8 snapshot: its codes are read; else pair_kv's
    assert pairs and all(p[0].dtype == (torch.uint8 if kv_dtype == "int8" else torch.int32) for p in pairs.values())


# heads of 64; of 80
@pytest.mark.parametrize(("family", "hidden"), [(name, 256) for name in ["qwen2", *NEW]] + [("llama", 320)])
def test_each_family_decodes_through_the_avx2_kernels(tmp_path, small_corpus, monkeypatch, family, hidden):
    """Below the AVX-512 floor, the AVX2 library: int4 products, the attention and the glue, all layers in one call
    (a family's q/k norms and post-norms, Granite's residual multiplier inside it): cag == full, alone and
    together."""
    if why := native.avx2_why_not():
        pytest.skip(f"cag's AVX2 kernels cannot run here: {why}")
    monkeypatch.setenv("CAG_MODEL", str(model_dir(tmp_path, family, hidden=hidden, heads=4, kv_heads=2)))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    monkeypatch.setenv("CAG_DECODE_KERNELS", "avx2")
    engine = Engine(get_settings())
    assert engine.lm.kernels == "avx2" and describe.decode_path(engine.lm)["native"] == "layers"
    with torch.inference_mode():
        glue_is_near_torch(engine.lm.model, family)
    engine.ingest(str(small_corpus))
    cached_is_full_alone_and_together(engine, QUESTIONS[:3], 12)


def test_a_wide_product_decodes_as_the_separate_ops_and_cag_equals_full(tmp_path, small_corpus, monkeypatch):
    """A down projection of 6,400 inputs (200 groups of 32, 8 blocks of 16 outputs) is multiplied alike by the one
    call and by the separate native calls: the same logits and K/V bit for bit, and cag == full, alone and
    together."""
    from tests.test_native import fused_is_separate

    folder = model_dir(tmp_path, "llama", hidden=128, heads=2, kv_heads=1, intermediate_size=6400)
    engine = _engine(monkeypatch, folder, "int4", "avx512")
    down = engine.lm.model.model.layers[0].mlp.down_proj.packs.packed
    assert down[0].shape == (8, 200, 256) and describe.decode_path(engine.lm)["native"] == "layers"
    engine.ingest(str(small_corpus))
    cached_is_full_alone_and_together(engine, QUESTIONS[:3], 12)
    fused_is_separate(folder, monkeypatch, 300, [0, 3, 6], [0, 1, 0], "int4", "llama")
