"""The lean decode step computes what the transformers forward computes: same logits, same cache
contents, consistent cache bookkeeping; models or caches it does not handle fall back to the forward."""

from __future__ import annotations

import pytest
import torch

from cag import attention, kv, weights
from cag import step as lean
from cag.generate import DecodeConfig, decode

PROMPT = list(range(3, 43))  # 40 token ids, any will do on a random model
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}  # logits, absolute


def forward_step(model, cache, tok: int, pos: int) -> torch.Tensor:
    """One token through transformers, exactly as decode's fallback runs it."""
    p = torch.tensor([pos])
    out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, cache_position=p,
                position_ids=p.unsqueeze(0), use_cache=True)
    return out.logits[0, -1]


def two_caches(model, n: int = 64):
    """Two caches holding the same prefilled prompt; returns them with the prompt's last logits."""
    caches = [kv.new_cache(model, n), kv.new_cache(model, n)]
    logits = [kv.prefill(model, c, PROMPT, 0) for c in caches]
    assert torch.equal(logits[0], logits[1])
    return caches, logits[0]


@torch.inference_mode()
def assert_steps_match(model, n_steps: int = 8) -> None:
    """Several consecutive steps, each fed the reference's greedy token: logits within tolerance,
    the K/V written at each position the same, the cache's own length at pos+1."""
    built = lean.for_model(model)
    assert built is not None, lean.why_not(model)
    (ref, mine), logits = two_caches(model)
    run = built.bind(mine)
    assert run is not None
    atol = TOLERANCE[model.dtype]
    pos, tok = len(PROMPT), int(logits.argmax())
    for _ in range(n_steps):
        want, got = forward_step(model, ref, tok, pos), run(tok, pos)
        assert got.shape == want.shape == (model.config.vocab_size,) and got.dtype == want.dtype
        assert torch.allclose(got, want, atol=atol, rtol=0), (got - want).abs().max()
        for a, b in zip(ref.layers, mine.layers, strict=True):
            assert torch.allclose(a.keys[:, :, : pos + 1], b.keys[:, :, : pos + 1], atol=atol / 10, rtol=0)
            assert torch.allclose(a.values[:, :, : pos + 1], b.values[:, :, : pos + 1], atol=atol / 10, rtol=0)
            assert int(b.cumulative_length) == int(a.cumulative_length) == pos + 1
        tok, pos = int(want.argmax()), pos + 1
    # The bookkeeping is the cache's own: a transformers forward right after the lean steps writes
    # at the next position, with no set_length in between.
    want, got = forward_step(model, ref, tok, pos), forward_step(model, mine, tok, pos)
    assert torch.allclose(got, want, atol=atol, rtol=0)


def tiny(tiny_model_dir, models_dir, dtype="float32", fmt="fp32"):
    from cag.model import load_model

    return load_model(str(tiny_model_dir), models_dir, dtype=dtype, weights=fmt, device="cpu").model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_step_equals_the_forward(tiny_model_dir, models_dir, dtype):
    assert_steps_match(tiny(tiny_model_dir, models_dir, dtype=dtype))


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_lean_step_uses_the_packed_weights(tiny_model_dir, models_dir, fmt):
    """The step calls the model's own FastLinear modules: it matches the forward in each format,
    and differs from the fp32 products (the packed kernels really ran)."""
    model = tiny(tiny_model_dir, models_dir, fmt=fmt)
    assert_steps_match(model)
    plain = tiny(tiny_model_dir, models_dir)
    with torch.inference_mode():
        (a, _), logits = two_caches(model)
        (b, _), _ = two_caches(plain)
        tok = int(logits.argmax())
        packed = lean.for_model(model).bind(a)(tok, len(PROMPT))
        fp32 = lean.for_model(plain).bind(b)(tok, len(PROMPT))
    assert not torch.equal(packed, fp32)


def _family(name: str):
    """A tiny random model of a family whose layers are Llama's (Mistral; Qwen2 with q/k/v biases)."""
    import transformers

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.3)
    torch.manual_seed(1)
    if name == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **common))
    elif name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(use_sliding_window=False, **common))
        torch.nn.init.normal_(model.model.layers[0].self_attn.q_proj.bias, std=0.5)  # biases that matter
    elif name == "llama3-rope":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_parameters=rope, **common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))
    model.eval()
    attention.install(model)
    return model


@pytest.mark.parametrize("name", ["mistral", "qwen2", "llama3-rope"])
def test_lean_step_covers_llama_shaped_families(name):
    assert_steps_match(_family(name))


def _decode_ids(model, n: int = 12) -> list[int]:
    with torch.inference_mode():
        cache = kv.new_cache(model, 64)
        logits = kv.prefill(model, cache, PROMPT, 0)
        return list(decode(model, cache, logits, len(PROMPT), DecodeConfig(max_tokens=n), stops=set()))


def _forward_ids(model, n: int = 12) -> list[int]:
    """Greedy tokens from the transformers forward alone."""
    with torch.inference_mode():
        cache = kv.new_cache(model, 64)
        logits = kv.prefill(model, cache, PROMPT, 0)
        out = []
        for i in range(n):
            out.append(int(logits.argmax()))
            logits = forward_step(model, cache, out[-1], len(PROMPT) + i)
        return out


def test_decode_runs_the_lean_step_and_gives_the_forwards_tokens(tiny_model_dir, models_dir):
    model = tiny(tiny_model_dir, models_dir)
    model.__dict__.pop(lean.ATTR, None)
    ids = _decode_ids(model)
    assert model.__dict__[lean.ATTR][0] is not None  # built by decode, kept on the model
    assert ids == _forward_ids(model)
    assert len(set(ids)) > 1


def test_an_unsupported_model_falls_back_to_the_forward():
    model = _family("qwen3")  # q/k norms: not Llama's layer
    assert "qwen3" in lean.why_not(model) and lean.for_model(model) is None
    assert _decode_ids(model) == _forward_ids(model)


def test_the_support_check_decides_the_path(tiny_model_dir, models_dir, monkeypatch):
    """With the check refusing, decode runs the transformers forward: same tokens, no lean step."""
    model = tiny(tiny_model_dir, models_dir)
    model.__dict__.pop(lean.ATTR, None)
    monkeypatch.setattr(lean, "why_not", lambda m: "refused for the test")
    calls = []
    monkeypatch.setattr(lean._Bound, "__call__", lambda *a: calls.append(a))
    fallback = _decode_ids(model)
    assert lean.for_model(model) is None and not calls
    monkeypatch.undo()
    model.__dict__.pop(lean.ATTR, None)
    assert _decode_ids(model) == fallback


def test_a_cache_it_does_not_write_falls_back(tiny_model_dir, models_dir):
    from transformers import DynamicCache

    model = tiny(tiny_model_dir, models_dir)
    built = lean.for_model(model)
    assert built.bind(DynamicCache(config=model.config)) is None
    fresh = kv.new_cache(model, 16)  # never prefilled: its buffers do not exist yet
    assert built.bind(fresh) is None
    with torch.inference_mode():
        kv.prefill(model, fresh, PROMPT[:4], 0)
    assert built.bind(fresh) is not None


def test_hooks_refuse_the_lean_step(tiny_model_dir, models_dir):
    """Calling forward methods directly would skip a hook: a hooked model runs the full forward."""
    model = tiny(tiny_model_dir, models_dir)
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert lean.why_not(model) == "forward hooks"
    handle.remove()
    assert lean.why_not(model) is None


def test_swapped_modules_rebuild_the_step(tiny_model_dir, models_dir):
    """weights.apply after a first decode: the kept step no longer names the model's modules, so a
    new one is built over the packed ones."""
    model = tiny(tiny_model_dir, models_dir)
    first = lean.for_model(model)
    assert lean.for_model(model) is first
    weights.apply(model, "int8")
    second = lean.for_model(model)
    assert second is not first and second.current(model)
    assert_steps_match(model, n_steps=3)
