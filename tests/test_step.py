"""The batched step (cag.runtime.step) computes what the transformers forward computes: same logits within
float tolerance, same K/V; a batch gives each request what it gets alone; models it does not handle
answer through the transformers forward."""

from __future__ import annotations

import pytest
import torch

from cag.answering.query import Query
from cag.model import prefill_attention, stacked_products, weights
from cag.runtime import kv_cache
from cag.runtime import step as lean
from cag.runtime.rows import Part
from cag.runtime.slots import PrefixKV, Slots
from tests.cpu import formats, needs_bf16

PROMPT = list(range(3, 43))  # 40 token ids, any will do on a random model
QUESTION = list(range(50, 62))  # a question's 12 tokens
# logits, absolute (bf16: roundings compound over the steps of the chaotic tiny model)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2.5e-1}


def one_part(step, toks, prefixes, slots, starts, buffers, all_logits=False):
    """m new tokens for each of B requests as one part of a pass: logits (B, V) of each request's last
    token (step.run's first output)."""
    return step.run([Part(toks, prefixes, slots, starts)], buffers, all_logits)[0]


def forward_step(model, cache, tok: int, pos: int) -> torch.Tensor:
    """One token through transformers, exactly as decode's fallback runs it."""
    p = torch.tensor([pos])
    out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, cache_position=p,
                position_ids=p.unsqueeze(0), use_cache=True)
    return out.logits[0, -1]


def shapes(model) -> tuple[int, int, int]:
    c = model.config
    return (
        c.num_hidden_layers,
        c.num_key_value_heads,
        getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
    )


def prefix_of(model, ids=PROMPT) -> PrefixKV:
    """A prefix prefilled by transformers, as ingest builds a snapshot."""
    cache = kv_cache.new_cache(model, len(ids))
    kv_cache.prefill(model, cache, ids, 0)
    return PrefixKV(kv_cache.views(cache, len(ids)), len(ids))


def new_slots(model, room: int = 32, capacity: int = 4) -> Slots:
    slots = Slots(*shapes(model), room, capacity, model.dtype)
    for _ in range(capacity):  # taken, as the scheduler takes them: zeroed (a batch reads past short suffixes, masked)
        slots.take()
    return slots


@torch.inference_mode()
def assert_steps_match(model, n_steps: int = 8) -> None:
    """The question prefilled in a slot over a shared prefix, then several decode steps, each fed
    the reference's greedy token: logits within tolerance of transformers' forward over one
    contiguous cache, and the K/V written in the slot equal to what transformers caches."""
    built = lean.for_model(model)
    assert built is not None, lean.why_not(model)
    n = len(PROMPT)
    ref = kv_cache.new_cache(model, n + 32)
    kv_cache.prefill(model, ref, PROMPT, 0)
    want = kv_cache.prefill(model, ref, QUESTION, n)
    prefix, slots = prefix_of(model), new_slots(model)
    got = one_part(built, torch.tensor([QUESTION]), [prefix], torch.tensor([2]), torch.tensor([0]), slots)[0]
    atol = TOLERANCE[model.dtype]
    length = len(QUESTION)
    for _ in range(n_steps):
        assert got.shape == want.shape == (model.config.vocab_size,) and got.dtype == want.dtype
        assert torch.allclose(got, want, atol=atol, rtol=0), (got - want).abs().max()
        tok = int(want.argmax())
        want = forward_step(model, ref, tok, n + length)
        got = one_part(built, torch.tensor([[tok]]), [prefix], torch.tensor([2]), torch.tensor([length]), slots)[0]
        length += 1
    for layer, k, v in zip(ref.layers, slots.k, slots.v, strict=True):
        assert torch.allclose(layer.keys[0, :, n : n + length], k[2, :, :length], atol=atol, rtol=0)
        assert torch.allclose(layer.values[0, :, n : n + length], v[2, :, :length], atol=atol, rtol=0)


def tiny(tiny_model_dir, models_dir, dtype="float32", fmt="fp32"):
    from cag.model.loading import load_model

    return load_model(str(tiny_model_dir), models_dir, dtype=dtype, weights=fmt, device="cpu").model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_step_equals_the_forward(tiny_model_dir, models_dir, dtype):
    assert_steps_match(tiny(tiny_model_dir, models_dir, dtype=dtype))


@needs_bf16
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_integer_formats_keep_the_lm_head_in_bf16(tiny_model_dir, models_dir, fmt):
    """The head (the tied token embedding here) is not on the layers' 4-bit grid: it stays bf16, and
    its logits stay within bf16's error of the model's own, while the layers take the format."""
    model = tiny(tiny_model_dir, models_dir, fmt=fmt)
    head, down = model.lm_head, model.model.layers[0].mlp.down_proj
    assert head.fmt == "bf16" and head.packs.fmt == "bf16" and down.fmt == fmt
    x = torch.randn(4, head.in_features)
    with torch.inference_mode():
        ref = torch.nn.functional.linear(x, head.weight)
        assert ((head.decode(x) - ref).norm() / ref.norm()) < 0.01


@pytest.mark.parametrize("fmt", formats("bf16", "int8", "int4"))
def test_lean_step_uses_the_packed_weights(tiny_model_dir, models_dir, fmt):
    """Decode rows go through the packed copies (FastLinear.decode), one row or a batch of them: the
    step differs from the fp32 products, yet stays within the format's tolerance of them."""
    model, plain = tiny(tiny_model_dir, models_dir, fmt=fmt), tiny(tiny_model_dir, models_dir)
    out = {}
    with torch.inference_mode():
        for name, m in (("packed", model), ("fp32", plain)):
            prefix, slots = prefix_of(m), new_slots(m)
            one_part(
                lean.for_model(m),
                torch.tensor([QUESTION] * 2),
                [prefix] * 2,
                torch.tensor([0, 1]),
                torch.tensor([0, 0]),
                slots,
            )
            out[name] = one_part(lean.for_model(m), torch.tensor([[7], [9]]), [prefix] * 2, torch.tensor([0, 1]),
                                                  torch.tensor([len(QUESTION)] * 2), slots)  # (2, V)
    assert not torch.equal(out["packed"], out["fp32"])
    assert (out["packed"] - out["fp32"]).abs().mean() < 0.5 * out["fp32"].abs().mean()  # the same model, rounded


@torch.inference_mode()
def test_a_batch_gives_each_request_what_it_gets_alone(tiny_model_dir, models_dir):
    """Three requests on two prefixes in one step: each request's logits and K/V are its own
    (no mixing of prefixes, slots or positions), equal to running it alone within float tolerance."""
    model = tiny(tiny_model_dir, models_dir)
    built = lean.for_model(model)
    pa, pb = prefix_of(model), prefix_of(model, PROMPT[:25])
    questions = [QUESTION, QUESTION[:7], list(range(70, 79))]
    prefixes, slot_ids = [pa, pb, pa], [3, 0, 1]
    alone, batch = new_slots(model), new_slots(model)
    want = []
    for q, p, s in zip(questions, prefixes, slot_ids):
        one_part(built, torch.tensor([q]), [p], torch.tensor([s]), torch.tensor([0]), alone)
        one_part(built, torch.tensor([q]), [p], torch.tensor([s]), torch.tensor([0]), batch)
        want.append(one_part(built, torch.tensor([[5]]), [p], torch.tensor([s]), torch.tensor([len(q)]), alone)[0])
    got = one_part(
        built,
        torch.tensor([[5]] * 3),
        prefixes,
        torch.tensor(slot_ids),
        torch.tensor([len(q) for q in questions]),
        batch,
    )
    for i, q in enumerate(questions):
        assert torch.allclose(got[i], want[i], atol=1e-4, rtol=0), (got[i] - want[i]).abs().max()
        s = slot_ids[i]
        for ka, kb in zip(alone.k, batch.k):
            assert torch.allclose(ka[s, :, : len(q) + 1], kb[s, :, : len(q) + 1], atol=1e-5, rtol=0)
    assert not torch.allclose(want[0], want[2], atol=1e-3)  # the three are really different requests


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
    # Phi-2: partial rotary, parallel attention and MLP, LayerNorm (tests/test_families.py: the families it covers)
    else:
        model = transformers.PhiForCausalLM(transformers.PhiConfig(**common))
    model.eval()
    prefill_attention.install(model)
    return model


@pytest.mark.parametrize("name", ["mistral", "qwen2", "llama3-rope"])
def test_lean_step_covers_llama_shaped_families(name):
    assert_steps_match(_family(name))


def test_an_unsupported_model_is_refused_by_the_check():
    model = _family("phi")  # not a Llama-shaped layer
    assert "'phi'" in lean.why_not(model) and lean.for_model(model) is None


def test_the_support_check_decides_the_path(tiny_engine, small_corpus, monkeypatch):
    """With the check refusing, the engine answers through the transformers forward over a copy of
    the prefix: the same tokens as the batched step's, and the step never runs."""
    tiny_engine.ingest(str(small_corpus))
    batched = [
        tiny_engine.answer(Query("corpus", q, max_tokens=12)).token_ids for q in ("Who keeps the lighthouse?", "When?")
    ]
    assert tiny_engine.decoder.batched and len(set(map(tuple, batched))) == 2
    model = tiny_engine.lm.model
    model.__dict__.pop(lean.ATTR, None)
    tiny_engine._decoder = None
    monkeypatch.setattr(lean, "why_not", lambda m: "refused for the test")
    monkeypatch.setattr(lean.LeanStep, "run", lambda *a: pytest.fail("the batched step ran"))
    fallback = [
        tiny_engine.answer(Query("corpus", q, max_tokens=12)).token_ids for q in ("Who keeps the lighthouse?", "When?")
    ]
    assert not tiny_engine.decoder.batched
    assert fallback == batched


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
    a = model.model.layers[0].self_attn
    assert (
        isinstance(a.q_proj, weights.FastLinear)
        and stacked_products.group_of(a.q_proj, a.k_proj, a.v_proj) is a.q_proj.packs
    )
    x = torch.randn(2, a.q_proj.in_features)
    with torch.inference_mode():  # the step's q/k/v: one product over the stacked packed weights, columns as apart
        assert all(
            torch.equal(got, m.decode(x)) for got, m in zip(second.fns[0].qkv(x), (a.q_proj, a.k_proj, a.v_proj))
        )


@torch.inference_mode()
def test_a_question_rides_along_a_decode_step(tiny_model_dir, models_dir):
    """run() with a decode part and a question part (one pass over the weights) gives each part what
    it gets in a pass of its own, within float tolerance."""
    from cag.runtime.rows import Part

    model = tiny(tiny_model_dir, models_dir)
    built = lean.for_model(model)
    pa, pb = prefix_of(model), prefix_of(model, PROMPT[:30])
    apart, mixed = new_slots(model), new_slots(model)
    for slots in (apart, mixed):  # two requests already decoding, in slots 0 and 1
        one_part(built, torch.tensor([QUESTION] * 2), [pa, pa], torch.tensor([0, 1]), torch.tensor([0, 0]), slots)
    decode = Part(torch.tensor([[5], [6]]), [pa, pa], torch.tensor([0, 1]), torch.tensor([len(QUESTION)] * 2))
    question = Part(torch.tensor([QUESTION[:9]]), [pb], torch.tensor([2]), torch.tensor([0]))
    want = [built.run([decode], apart)[0], built.run([question], apart)[0]]
    got = built.run([decode, question], mixed)
    for w, g in zip(want, got):
        assert g.shape == w.shape and torch.allclose(g, w, atol=1e-4, rtol=0), (g - w).abs().max()
    for ka, km in zip(apart.k, mixed.k):  # what each request wrote: 12 + 1 positions, and the question's 9
        assert torch.allclose(ka[:2, :, : len(QUESTION) + 1], km[:2, :, : len(QUESTION) + 1], atol=1e-5, rtol=0)
        assert torch.allclose(ka[2, :, :9], km[2, :, :9], atol=1e-5, rtol=0)


@needs_bf16
@torch.inference_mode()
@pytest.mark.parametrize("in_file", [False, True])
def test_a_questions_rows_multiply_in_bf16_under_the_integer_formats_unless_the_weights_are_in_their_file(
        tiny_model_dir, models_dir, monkeypatch, in_file):
    """int4 decode rows read the 4-bit copy. A model held in memory of its own multiplies a question's
    rows (a part of more than one token per request) by a bf16 copy, so a question's pass under int4
    gives bf16's bits exactly (the two bf16 layouts agree up to 32 rows), alone or riding along a decode
    step; a decode row does not. A model whose weights view their file keeps no bf16 copy: a question's
    rows read the 4-bit one, and still get the same bits alone or riding along."""
    from cag.model import file_pages
    from cag.runtime.rows import Part

    if not in_file:  # as if the weights were the process's own memory (a model built or converted in it)
        monkeypatch.setattr(file_pages, "file_backed", lambda t, maps=None: False)
    int4, bf16 = (tiny(tiny_model_dir, models_dir, fmt=f) for f in ("int4", "bf16"))
    copies = [m.packs.questions for m in int4.modules() if hasattr(m, "packs") and m.fmt == "int4"]
    assert copies and all((c is None) == in_file for c in copies)
    prefix = prefix_of(int4)
    assert all(torch.equal(a, b) for pa, pb in zip(prefix.kv, prefix_of(bf16).kv) for a, b in zip(pa, pb))
    q4, qb = lean.for_model(int4), lean.for_model(bf16)
    question = Part(torch.tensor([QUESTION[:9]]), [prefix], torch.tensor([1]), torch.tensor([0]))
    decode = Part(torch.tensor([[5]]), [prefix], torch.tensor([0]), torch.tensor([0]))
    s4, s4_mixed, sb = new_slots(int4), new_slots(int4), new_slots(bf16)
    want, alone = qb.run([question], sb)[0], q4.run([question], s4)[0]
    assert torch.equal(alone, want) != in_file
    mixed = q4.run([decode, question], s4_mixed)
    assert torch.equal(mixed[1], alone)
    assert torch.equal(mixed[0], q4.run([decode], new_slots(int4))[0])  # the decode row: int4, alone or not
    assert not torch.equal(mixed[0], qb.run([decode], new_slots(bf16))[0])


def _resident_pages(t: torch.Tensor) -> int:
    """How many pages of a CPU tensor's bytes are resident (/proc/self/pagemap: bit 63 of each page's entry)."""
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    first, last = t.data_ptr() // page, (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    return sum(int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8))


def test_a_slot_holds_in_memory_the_pages_its_request_wrote():
    """Slots are zero pages until written, in pages of 4 KiB, never huge ones: a request's first keys make a
    page per head resident in each layer (with transparent huge pages, as numpy's zeros ask for, 2 MiB of
    each layer's K and of its V for one short question), and a slot given back reads zeros again."""
    import os

    if not os.path.exists("/proc/self/pagemap"):
        pytest.skip("resident pages are read from Linux's /proc")
    slots = Slots(4, 2, 64, 8192, 4, torch.bfloat16)  # 4 layers, 2 K/V heads of 64, room 8192, 4 requests
    for t in (*slots.k, *slots.v):
        t[1, :, :3] = 1.0  # request in slot 1 wrote 3 positions
        assert t.data_ptr() % 64 == 0
    assert [_resident_pages(t) for t in (*slots.k, *slots.v)] == [2] * 8  # one page per head
    slots.give(1, 3)
    assert all(not t.any() for t in (*slots.k, *slots.v))
