"""Packed decode weights: each format's single-row product approximates the model's own, and
`auto` only ever picks a format that runs here."""

from __future__ import annotations

import pytest
import torch

from cag.answering.query import Query
from cag.model import auto_weights, layouts, packed, stacked_products, weights
from tests.cpu import formats

TOLERANCE = {"bf16": 0.01, "int8": 0.02, "int4": 0.12}  # relative error of one product, random weights


@pytest.mark.parametrize("fmt", formats("bf16", "int8", "int4"))
def test_packed_product_approximates_the_linear(fmt):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64, bias=True)
    fast = weights.FastLinear(lin, fmt)
    x = torch.randn(1, 1, 128)  # one decode row
    with weights.decoding():
        ref, got = lin(x), fast(x)
        rows = torch.randn(1, 5, 128)  # several rows (prefill) use the model's own weight, exactly
        assert torch.equal(fast(rows), lin(rows))
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = ((got - ref).norm() / ref.norm()).item()
    assert 0 < err < TOLERANCE[fmt]  # > 0: the packed kernel ran, not the model's own weight
    assert torch.equal(fast(x), lin(x))  # outside a decode step even one row is exact: prefill


@pytest.mark.parametrize("fmt", formats("bf16", "int8", "int4"))
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_siblings_give_the_columns_of_separate_products(fmt, bias):
    """q/k/v (and gate/up) share one packed matrix: the step's one call gives each module the very
    bits its own matrix would, for any number of rows, and the members still work one by one."""
    torch.manual_seed(2)
    attn = torch.nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (torch.nn.Linear(64, o, bias=bias) for o in (96, 32, 32))
    alone = {n: weights.FastLinear(getattr(attn, n), fmt) for n in ("q_proj", "k_proj", "v_proj")}
    weights.apply(attn, fmt)
    mods = [attn.q_proj, attn.k_proj, attn.v_proj]
    packs = stacked_products.group_of(*mods)
    assert packs is not None and packs.out_features == 160 and stacked_products.group_of(*mods[::-1]) is None
    with torch.inference_mode():
        for rows in (1, 3, 17, 40, 130):
            x = torch.randn(rows, 64)
            for got, m, name in zip(packs(x).split([96, 32, 32], -1), mods, ("q_proj", "k_proj", "v_proj")):
                assert torch.equal(got, alone[name].decode(x)) and torch.equal(m.decode(x), got), (rows, name)


def test_stacked_fp32_weights_are_views_and_the_step_multiplies_them_once():
    """fp32 keeps the model's own weights: stacking makes q/k/v views of one matrix (same values,
    no copy kept), whose one product gives each module's bits; a parameter replaced later (.to())
    is noticed and the members are multiplied one by one again."""
    from cag.model.stacked_products import together

    torch.manual_seed(3)
    attn = torch.nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (torch.nn.Linear(64, o, bias=True) for o in (96, 32, 32))
    mods = [attn.q_proj, attn.k_proj, attn.v_proj]
    before = [(m.weight.clone(), m.bias.clone()) for m in mods]
    weights.apply(attn, "fp32")
    w, b = stacked_products.stacked(*mods)
    assert w.shape == (160, 64) and all(
        m.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for m in mods
    )
    assert all(torch.equal(m.weight, wb[0]) and torch.equal(m.bias, wb[1]) for m, wb in zip(mods, before))
    with torch.inference_mode():
        for rows in (1, 5, 18):
            x = torch.randn(rows, 64)
            assert all(torch.equal(got, m(x)) for got, m in zip(together(*mods)(x), mods))
    attn.to(torch.float64)  # new parameter tensors: no longer views of the stack
    assert stacked_products.stacked(*mods) is None
    x = torch.randn(2, 64, dtype=torch.float64)
    assert all(torch.equal(got, m(x)) for got, m in zip(together(*mods)(x), mods))


def test_int4_holds_a_4bit_grid_almost_exactly():
    """Weights already on a 4-bit grid per group of 32 (GGUF Q4_1: m + d * q, q = 0..15) come back
    on the right grid point: off only by the bf16 rounding of scale, zero and output, under half
    a grid step everywhere and a small fraction of it on average."""
    torch.manual_seed(1)
    d = torch.rand(64, 4, 1) * 0.01 + 0.001  # (out, groups, 1)
    m = torch.randn(64, 4, 1) * 0.05
    q = torch.randint(0, 16, (64, 4, 32))
    q[..., 0], q[..., 1] = 0, 15  # the quantizer's min and max sit on the grid's ends, as in Q4_1
    w = (m + d * q).reshape(64, 128)
    lin = torch.nn.Linear(128, 64, bias=False)
    lin.weight.data = w
    eye = torch.eye(128)
    recovered = torch.cat([weights.FastLinear(lin, "int4")(eye[i : i + 1]) for i in range(128)]).t()  # (64, 128)
    step = d.expand(64, 4, 32).reshape(64, 128)
    off = (recovered - w).abs() / step
    assert off.max() < 0.5 and off.mean() < 0.1


def test_auto_picks_a_runnable_format(tmp_path, monkeypatch):
    lin = torch.nn.Sequential(torch.nn.Linear(64, 64))
    assert auto_weights.choose(lin, "auto") in ("fp32", "bf16")
    assert auto_weights.choose(lin, "int8") == "int8"
    fmts = ("fp32", "bf16") if layouts.bf16_packs() else ("fp32", "int8")
    assert set(auto_weights.probe(fmts)) == set(fmts)
    # what follows asks what `auto` would pick with bf16 products
    monkeypatch.setattr(layouts, "bf16_packs", lambda: True)
    # bf16 hardware decides by the CPU's flags, whatever a timing probe would say or had said
    monkeypatch.setattr(auto_weights, "probe", lambda fmts, rows=1: {"fp32": 1.0, "bf16": 9.0})
    (tmp_path / "weights-auto.json").write_text("{}")
    monkeypatch.setattr(auto_weights, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    assert auto_weights.choose(lin, "auto", tmp_path) == "bf16"
    monkeypatch.setattr(auto_weights, "cpu_flags", lambda: {"avx2", "fma"})  # no bf16 hardware: the probe's verdict
    assert auto_weights.choose(lin, "auto", tmp_path) == "fp32"
    assert "fp32" in (tmp_path / "weights-auto.json").read_text()


def test_snapshots_do_not_depend_on_the_weights_format(tiny_model_dir, small_corpus, monkeypatch, tmp_path):
    """The snapshot key leaves CAG_WEIGHTS out, so prefill must never multiply through the packed
    copies, not even a last prefill chunk of a single token (a one-row product, which the packed
    kernels serve for decode)."""
    from pathlib import Path

    from cag.config import get_settings
    from cag.engine import Engine
    from cag.store import snapshots

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_KV_DTYPE", "float32")  # one storage dtype for every format
    n = Engine(get_settings(home=tmp_path / "probe")).ingest(str(small_corpus)).n_tokens
    monkeypatch.setenv("CAG_CHUNK_TOKENS", str(n - 1))  # the last prefill chunk is one token
    kv = {}
    fmts = ("fp32", "bf16", "int8") if layouts.bf16_packs() else ("fp32", "int8", "int4")
    for fmt in fmts:
        monkeypatch.setenv("CAG_WEIGHTS", fmt)
        e = Engine(get_settings(home=tmp_path / fmt))
        e.ingest(str(small_corpus))
        kv[fmt] = snapshots.load(Path(e.index.snapshot(e.index.corpus("corpus")["current_snapshot"])["path"])).kv
    for fmt in fmts[1:]:
        assert all(torch.equal(a, b) for pa, pb in zip(kv["fp32"], kv[fmt]) for a, b in zip(pa, pb)), fmt


def test_auto_takes_int4_only_where_the_weights_already_lie_on_its_grid(tmp_path, monkeypatch):
    """On bf16 hardware `auto` is int4 when every matrix int4 packs is on a 4-bit grid per group of 32
    (a GGUF Q4_1 model: int4 keeps its weights as they are), else bf16; below it, int4 for such a model
    where cag's AVX2 library runs; elsewhere never int4."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 48))
    monkeypatch.setattr(layouts, "bf16_packs", lambda: True)  # what `auto` picks where oneDNN packs bf16
    monkeypatch.setattr(auto_weights, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    assert not auto_weights.on_4bit_grid(model) and auto_weights.choose(model, "auto", tmp_path) == "bf16"
    for lin in model:
        d = torch.rand(lin.out_features, 2, 1) * 0.01 + 0.001  # (out, groups, 1)
        q = torch.randint(0, 16, (lin.out_features, 2, 32)).float()
        q[..., 0], q[..., 1] = 0, 15  # the grid's ends, as the Q4_1 quantizer writes them
        lin.weight.data = (torch.randn(lin.out_features, 2, 1) * 0.05 + d * q).reshape(lin.out_features, 64)
    assert auto_weights.on_4bit_grid(model) and auto_weights.choose(model, "auto", tmp_path) == "int4"
    monkeypatch.setattr(auto_weights, "cpu_flags", lambda: {"avx2", "fma"})  # no bf16 hardware
    monkeypatch.setattr(auto_weights.native, "cpu_why_not", lambda *a: "this CPU lacks avx512_bf16")
    monkeypatch.setattr(auto_weights.native, "load_avx2", lambda: True)  # cag's AVX2 library runs: int4
    assert auto_weights.choose(model, "auto", tmp_path) == "int4"
    monkeypatch.setattr(auto_weights.native, "load_avx2", lambda: False)  # it does not: fp32 or bf16 only
    monkeypatch.setattr(auto_weights, "probe", lambda fmts, rows=1: {"fp32": 1.0, "bf16": 9.0})
    assert auto_weights.choose(model, "auto", tmp_path) == "fp32"
    model[1].weight.data[3, 5] += 0.3 * 0.001  # one weight off its grid point
    monkeypatch.setattr(auto_weights, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    assert not auto_weights.on_4bit_grid(model) and auto_weights.choose(model, "auto", tmp_path) == "bf16"


def test_a_cpu_without_bf16_products_gets_a_clear_error_and_int8_heads(tiny_model_dir, tmp_path, monkeypatch):
    """An AVX2-only CPU (oneDNN packs no bf16 there): CAG_WEIGHTS=bf16 is refused in one line naming
    what to use, `auto` picks fp32 without probing bf16, and int8 / int4 keep an int8 LM head and
    their own products for a question's rows, so they still load and answer."""
    from cag.config import get_settings
    from cag.engine import Engine
    from cag.errors import ModelError

    monkeypatch.setattr(layouts, "bf16_packs", lambda: False)
    monkeypatch.setattr(auto_weights, "probe", lambda *a, **k: pytest.fail("probed bf16 where it cannot run"))
    lin = torch.nn.Sequential(torch.nn.Linear(64, 64))
    assert "CAG_WEIGHTS=fp32" in weights.supported("bf16", lin) and auto_weights.choose(lin, "auto") == "fp32"
    assert weights._head_format("int4") == weights._head_format("int8") == "int8"
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "bf16")
    with pytest.raises(ModelError, match="this CPU lacks") as e:
        _ = Engine(get_settings(home=tmp_path / "bf16")).lm
    assert "\n" not in str(e.value)
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    monkeypatch.setenv("CAG_DECODE_KERNELS", "torch")  # with cag's kernels int4's head is their q8
    model = Engine(get_settings(home=tmp_path / "int4")).lm.model
    head = model.get_output_embeddings()
    assert head.fmt == "int8" and type(head.packs) is packed.TorchPacked and head.packs.questions is None
    x = torch.randn(3, head.in_features)
    with torch.inference_mode():
        ref = torch.nn.functional.linear(x, head.weight)
        assert ((head.decode(x) - ref).abs().max() / ref.abs().max()) < 0.02


def test_auto_compute_dtype_is_bf16_only_for_a_bf16_model_on_bf16_hardware(monkeypatch):
    """CAG_DTYPE=auto: a model whose own weights are bf16 computes in bf16 on a CPU with bf16 dot
    products (half the memory, nothing lost); a float32 model, or a CPU without them, in float32."""
    import transformers

    bf16_model, fp32_model = transformers.LlamaConfig(dtype="bfloat16"), transformers.LlamaConfig(dtype="float32")
    monkeypatch.setattr(auto_weights, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert auto_weights.compute_dtype("auto", "cpu", bf16_model) == "bfloat16"
    assert auto_weights.compute_dtype("auto", "cpu", fp32_model) == "float32"
    assert auto_weights.compute_dtype("float32", "cpu", bf16_model) == "float32"
    assert auto_weights.compute_dtype("auto", "cuda", fp32_model) == "bfloat16"
    monkeypatch.setattr(auto_weights, "cpu_flags", lambda: {"avx2", "fma"})
    assert auto_weights.compute_dtype("auto", "cpu", bf16_model) == "float32"


def test_a_packed_copy_that_is_the_weight_itself_adds_no_bytes():
    """In bf16 compute, the plain bf16 copy a format keeps (a question's rows under int4 with cag's
    kernels, bf16's decode rows) is the model's own weight: counted once, not twice."""
    w = torch.randn(64, 128).to(torch.bfloat16)
    p = packed.Packed(w, None, "int4")
    p.packed, p.questions = (torch.zeros(64, 64, dtype=torch.uint8),), w.detach().contiguous()
    assert p.nbytes == 64 * 64
    p.questions = w.clone()
    assert p.nbytes == 64 * 64 + w.nbytes


def test_a_bf16_checkpoint_keeps_its_layers_in_bf16_under_packed_formats(
    tiny_model_dir, small_corpus, tmp_path, monkeypatch
):
    """Computed in float32, a model whose weights are all bf16 values (a bf16 checkpoint) keeps its layers'
    matrices in bf16 when decode multiplies a packed copy: the knowledge prefill widens them back exactly,
    so its snapshot is fp32's bit for bit, `cag` == `full`, and the model's own weights take half the bytes."""
    from pathlib import Path

    import transformers

    from cag.config import get_settings
    from cag.engine import Engine
    from cag.store import snapshots

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # every value a bf16 value, stored in float32
    folder = tmp_path / "bf16-exact"
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    monkeypatch.setenv("CAG_MODEL", str(folder))
    monkeypatch.setenv("CAG_KV_DTYPE", "float32")
    monkeypatch.setenv("CAG_DECODE_KERNELS", "torch")
    kv, answers, sizes = {}, {}, {}
    for fmt in ("fp32", "int8", "int4"):
        monkeypatch.setenv("CAG_WEIGHTS", fmt)
        e = Engine(get_settings(home=tmp_path / fmt))
        e.ingest(str(small_corpus))
        kv[fmt] = snapshots.load(Path(e.index.snapshot(e.index.corpus("corpus")["current_snapshot"])["path"])).kv
        answers[fmt] = [
            e.answer(Query("corpus", q, mode=m, max_tokens=12)).token_ids
            for q in ("Who keeps the lighthouse?",)
            for m in ("cag", "full")
        ]
        layer = e.lm.model.model.layers[0]
        sizes[fmt] = sum(p.nbytes for p in e.lm.model.parameters())
        if fmt != "fp32":
            assert layer.self_attn.q_proj.weight.dtype == layer.mlp.down_proj.weight.dtype == torch.bfloat16
            assert e.lm.model.get_output_embeddings().weight.dtype == torch.float32  # the (tied) head as it is
    for fmt in ("int8", "int4"):
        assert all(torch.equal(a, b) for pa, pb in zip(kv["fp32"], kv[fmt]) for a, b in zip(pa, pb)), fmt
        assert answers[fmt][0] == answers[fmt][1], fmt  # cag == full
        assert sizes[fmt] < 0.75 * sizes["fp32"], (fmt, sizes)


def test_packing_gives_the_heap_back_after_each_matrix(monkeypatch):
    """apply hands the C heap's free pages back (glibc's malloc_trim) after each matrix it packs: its
    float32 working copies, freed among the packed copies it keeps, would stay resident otherwise."""
    import os

    torch.manual_seed(4)
    attn = torch.nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = (torch.nn.Linear(64, o, bias=False) for o in (96, 32, 32))
    attn.o_proj = torch.nn.Linear(96, 64, bias=False)
    trims = []
    real = weights.trim_heap
    monkeypatch.setattr(weights, "trim_heap", lambda: trims.append(real()) or trims[-1])
    weights.apply(attn, "int8")
    assert len(trims) == 2  # the q/k/v group and o_proj
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError):
        glibc = False
    assert (weights._malloc_trim() is not None) == glibc and all(isinstance(t, bool) for t in trims)
