"""Saying what ran: `cag info` (a model's shape and how it decodes, without asking anything), the `decode`
object of `cag ask --json`, of /v1/ask, of the chat completion's `cag` extension and of /health; a model
the fast step does not cover says `forward` and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from cag.kernels import native
from cag.runtime import describe
from tests.conftest import HANDBOOK, _train_tokenizer
from tests.test_cli import cag


@pytest.fixture(scope="module")
def phi2_dir(tmp_path_factory) -> Path:
    """A tiny random Phi-2 (partial rotary, parallel attention and MLP, LayerNorm): not a layer the fast
    step computes, so it decodes through transformers' forward."""
    tok = _train_tokenizer([p.read_text() for p in sorted(HANDBOOK.glob("*.md"))])
    config = transformers.PhiConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
                                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    out = tmp_path_factory.mktemp("tiny-phi2")
    transformers.PhiForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def info(*args: str) -> dict:
    r = cag("info", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


DECODE = ("weights", "arithmetic", "kernels", "kernels_reason", "step", "step_reason", "native")


def test_info_names_the_shape_and_the_decode_path(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(native, "cpu_why_not", lambda: None)  # why not here is the model's heads, whatever this CPU is
    d = info("--model", str(tiny_model_dir))
    assert d == d | {"model": str(tiny_model_dir), "model_type": "llama", "class": "LlamaForCausalLM", "layers": 2,
                     "heads": 4, "kv_heads": 2, "head_dim": 16, "context": 4096, "dtype": "float32", "device": "cpu",
                     "weights": "fp32", "arithmetic": "fp32", "kernels": "torch", "step": "fast", "step_reason": None,
                     "native": "none",
                     # K and V x layers x K/V heads x D x 2 bytes
                     "kv_dtype": "float16", "kv_bytes_per_token": 2 * 2 * 2 * 16 * 2, "prefill": "blocks 16"}
    assert "heads of 16" in d["kernels_reason"] and d["parameters"] > 0
    r = cag("info", "--model", str(tiny_model_dir))
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("model:") and any(
        line.startswith("decode:   fast step, torch's kernels") for line in lines
    )
    assert any("256 B per token (float16 K/V)" in line for line in lines)
    assert "prefill:  through the transformers forward in blocks 16" in lines


def test_info_names_cags_kernels_and_the_one_call_layers(tiny64_model_dir, monkeypatch):
    if why := native.why_not():
        pytest.skip(f"cag's kernels cannot run here: {why}")
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    d = info("--model", str(tiny64_model_dir))
    assert (d["weights"], d["kernels"], d["step"], d["native"], d["kv_dtype"], d["prefill"]) == (
        "int4",
        "avx512",
        "fast",
        "layers",
        "bfloat16",
        "rows int4-q8/avx512",  # the knowledge prefilled as decode rows (cag.runtime.knowledge_kv)
    )
    assert d["arithmetic"] == "int4-q8"  # int4 weights meet 8-bit activations in the AVX-512 products
    out = cag("info", "--model", str(tiny64_model_dir)).stdout
    assert "compute:  float32 on cpu, weights int4, products on 8-bit activations" in out.splitlines()


def test_info_says_where_knowledge_stops_going_as_rows(tiny64_model_dir, monkeypatch):
    """A context longer than a decoder's slot (knowledge_kv.MAX_SUFFIX, made short here): knowledge up to it goes as
    rows, longer in blocks, and `cag info` says both."""
    if why := native.why_not():
        pytest.skip(f"cag's kernels cannot run here: {why}")
    from cag.runtime import knowledge_kv

    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    monkeypatch.setattr(knowledge_kv, "MAX_SUFFIX", 1024)
    d = info("--model", str(tiny64_model_dir))
    assert (d["prefill"], d["prefill_rows_max"], d["prefill_beyond"]) == ("rows int4-q8/avx512", 1024, "blocks 16")
    out = cag("info", "--model", str(tiny64_model_dir)).stdout
    assert ("prefill:  as decode rows, rows int4-q8/avx512 up to 1,024 tokens of knowledge, longer: through the "
            "transformers forward in blocks 16") in out.splitlines()


def test_a_model_the_step_does_not_cover_says_forward_and_why(phi2_dir, small_corpus):
    d = info("--model", str(phi2_dir))
    assert d["class"] == "PhiForCausalLM" and d["step"] == "forward" and d["native"] == "none"
    assert d["step_reason"].startswith("model type 'phi'") and "qwen3" in d["step_reason"]
    assert "transformers forward (model type 'phi'" in cag("info", "--model", str(phi2_dir)).stdout
    assert cag("ingest", str(small_corpus), "--name", "town", "--model", str(phi2_dir)).exit_code == 0
    r = cag("ask", "town", "Who keeps the lighthouse?", "--max-tokens", "4", "--model", str(phi2_dir), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["decode"] == {k: d[k] for k in DECODE}


def test_ask_json_names_the_decode_path(tiny_model_dir, small_corpus, monkeypatch):
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    assert cag("ingest", str(small_corpus), "--name", "town").exit_code == 0
    for mode in ("cag", "full"):
        r = cag("ask", "town", "When does the ferry leave?", "--mode", mode, "--max-tokens", "4", "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["decode"] == {k: v for k, v in info().items() if k in DECODE}


def test_the_api_names_the_decode_path(tiny_model_dir, small_corpus, monkeypatch):
    """/health, /v1/ask (and its streamed answer event) and the chat completion's `cag` extension."""
    from cag.config import get_settings
    from cag.engine import Engine
    from tests.test_api import app_client, sse_events

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    engine = Engine(get_settings())
    engine.ingest(str(small_corpus), name="notes")
    want = {k: v for k, v in describe.decode_path(engine.lm).items() if v is not None}
    assert want["step"] == "fast" and want["weights"] == "fp32"
    with app_client(engine) as c:
        assert c.get("/health").json()["decode"] == want
        asked = c.post(
            "/v1/ask", json={"corpus": "notes", "question": "Who keeps the lighthouse?", "max_tokens": 4}
        ).json()
        assert {k: v for k, v in asked["decode"].items() if v is not None} == want
        with c.stream(
            "POST", "/v1/ask", json={"corpus": "notes", "question": "Who?", "max_tokens": 3, "stream": True}
        ) as r:
            (answer,) = [json.loads(data) for name, data in sse_events(r) if name == "answer"]
        assert answer["decode"]["step"] == "fast"
        chat = c.post(
            "/v1/chat/completions",
            json={
                "model": "notes",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Who keeps the lighthouse?"}],
            },
        ).json()
        assert {k: v for k, v in chat["cag"]["decode"].items() if v is not None} == want
