"""cag.kernels.native's weight products for decode rows (int4 as GGUF Q4_1 holds it, int8 groups as Q8_0 holds it for
int4's LM head, bf16): the products they compute, rows whose bits never depend on the other rows of a call or on the
threads, the int4 layout, and bad inputs. Skipped with the reason where the library cannot be built here."""

from __future__ import annotations

import pytest
import torch

from cag.kernels import backends, native
from cag.model import layouts, packed, weights


@pytest.fixture(scope="module", autouse=True)
def library():
    if why := native.why_not():
        pytest.skip(f"cag's kernels cannot run here: {why}")
    assert native.load() is not None, native.reason()


def dequantized(qw: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The (out, in) float64 weight an int4 pack stands for: m + q * d per group of 32."""
    out_f = qw.shape[0]
    q = torch.cat([qw.view(out_f, -1, 16) & 15, qw.view(out_f, -1, 16) >> 4], -1).double()  # (out, in/32, 32)
    d, m = dm[:, 0, :, None].double(), dm[:, 1, :, None].double()
    return (m + q * d).reshape(out_f, -1)


def weight(out_f=320, in_f=576, seed=0) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int4_pack_holds_the_weight_within_half_a_step():
    w = weight()
    qw, dm = layouts.pack_int4(w)
    assert qw.dtype == torch.uint8 and qw.shape == (320, 288) and dm.dtype == torch.float16 and dm.shape == (320, 2, 18)
    step = dm[:, 0].double().repeat_interleave(32, 1)  # (out, in)
    assert ((dequantized(qw, dm) - w.double()).abs() <= step / 2 + 1e-3 * step + 2e-4).all()


@pytest.mark.parametrize("pack", [layouts.pack_int4, layouts.pack_q8, layouts.pack_int4_native])
def test_packing_by_blocks_of_rows_gives_the_whole_matrix_packing(pack, monkeypatch):
    """Packing goes CHUNK rows at a time (its float32 working copies stay small): the same copy as
    packing the matrix at once, blocks ending mid-matrix and a short last block included (with a group
    of zeros in a late block: pack_int4_native reads them block by block too)."""
    w = weight(out_f=200).bfloat16()
    w[150, 32:64] = 0
    whole = pack(w)
    monkeypatch.setattr(layouts, "CHUNK", 64)  # 200 rows: blocks of 64, 64, 64 and 8
    assert all(torch.equal(a, b) for a, b in zip(pack(w), whole))


def test_int4_pack_holds_a_q4_1_weight_exactly():
    """A weight already on a Q4_1 grid (float16 step and min, codes 0..15 with both ends used), as the
    embedded model's GGUF stores its layers, comes back bit for bit."""
    g = torch.Generator().manual_seed(3)
    d = (torch.rand(64, 18, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (torch.randn(64, 18, 1, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (64, 18, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    w = (m + q * d).reshape(64, 576)
    assert torch.equal(dequantized(*layouts.pack_int4(w)).float(), w)


@pytest.mark.parametrize("rows", [1, 3, 8, 11, 17])
def test_int4_product_is_the_dequantized_product(rows):
    qw, dm = layouts.pack_int4(weight())
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = torch.ops.cag.int4_mm(x, qw, dm)
    want = x.double() @ dequantized(qw, dm).t()
    assert got.dtype == torch.float32 and got.shape == (rows, 320)
    assert (got.double() - want).abs().max() < 1e-4 * want.abs().max()


def test_q8_pack_holds_a_q8_0_weight_exactly():
    """int4's LM head: a weight on a Q8_0 grid (a float16 scale per 32, codes -127..127 with the end
    used), as the embedded model's GGUF stores its token embedding, comes back bit for bit."""
    g = torch.Generator().manual_seed(4)
    d = (torch.rand(64, 18, 1, generator=g) * 0.01 + 1e-3).half().float()
    q = torch.randint(-127, 128, (64, 18, 32), generator=g)
    q[..., 3] = -127
    w = (d * q).reshape(64, 576)
    qw, dh = layouts.pack_q8(w)
    assert qw.dtype == torch.int8 and dh.dtype == torch.float16 and dh.shape == (64, 18)
    assert torch.equal((qw.float().view(64, 18, 32) * dh.float()[..., None]).view(64, 576), w)


@pytest.mark.parametrize("rows", [1, 8, 13])
def test_q8_product_is_the_dequantized_product(rows):
    qw, d = layouts.pack_q8(weight(1000, 576))
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    want = x.double() @ (qw.double().view(1000, 18, 32) * d.double()[..., None]).view(1000, 576).t()
    assert (torch.ops.cag.q8_mm(x, qw, d).double() - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize("rows", [1, 5, 8, 19])
def test_bf16_product_is_the_product(rows):
    w = weight(1000, 320).bfloat16()
    x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows)).bfloat16()
    want = x.double() @ w.double().t()
    assert (torch.ops.cag.bf16_mm(x, w).double() - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize("kind", ["int4", "q8", "bf16"])
def test_rows_never_depend_on_the_call_or_the_threads(kind):
    """Each row alone, in another order, among 8 or 19 rows, and on one thread; and each output among
    others at another place in the call (a block of 16 summed at once, or not): the same bits."""
    w = weight(768 if kind == "int4" else 777, 1536)
    of = {"int4": lambda w: lambda x, p=layouts.pack_int4(w): torch.ops.cag.int4_mm(x, *p),
          "q8": lambda w: lambda x, p=layouts.pack_q8(w): torch.ops.cag.q8_mm(x, *p),
          "bf16": lambda w: lambda x, p=w.bfloat16(): torch.ops.cag.bf16_mm(x, p)}[kind]
    mm = of(w)
    x = torch.randn(19, 1536, generator=torch.Generator().manual_seed(7)).bfloat16()
    together = mm(x)
    assert torch.equal(of(w[5:45].contiguous())(x), together[:, 5:45])
    assert torch.equal(torch.cat([mm(x[i : i + 1]) for i in range(19)]), together)
    assert torch.equal(mm(x[:8]), together[:8])
    order = torch.randperm(19, generator=torch.Generator().manual_seed(1))
    assert torch.equal(mm(x[order].contiguous()), together[order])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(mm(x), together)
    finally:
        torch.set_num_threads(threads)


def test_stacked_columns_equal_separate_matrices():
    """A layer's q/k/v share one packed stack (cag.model.stacked_products): each column comes out as from its own
    matrix."""
    a, b = weight(192, 576, 1), weight(64, 576, 2)
    x = torch.randn(3, 576).bfloat16()
    stacked = torch.ops.cag.int4_mm(x, *layouts.pack_int4(torch.cat([a, b])))
    assert torch.equal(stacked, torch.cat([torch.ops.cag.int4_mm(x, *layouts.pack_int4(m)) for m in (a, b)], 1))


def q4_0_weight(out_f=320, in_f=576, seed=0) -> torch.Tensor:
    """A matrix on GGUF Q4_0's grid: d (q - 8) per group of 32, d a float16, some group's q = 0."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=g)
    q[..., 0] = 0  # the value of largest magnitude, -8 d, as a Q4_0 quantizer makes it
    d = (torch.rand(out_f, in_f // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    return (d * (q - 8)).reshape(out_f, in_f)


def test_the_q4_0_layout_gives_the_two_row_layouts_bits():
    """A matrix on Q4_0's grid packs its steps alone (18 bytes a group), and the product gives the
    bits the steps-and-mins layout gives, for any row count; other matrices keep both rows."""
    w, x = q4_0_weight(), torch.randn(9, 576).bfloat16()
    qw, dm = layouts.pack_int4_native(w)
    assert dm.shape == (320, 1, 18) and torch.equal(qw, layouts.pack_int4(w)[0])
    full = torch.ops.cag.int4_mm(x, *layouts.pack_int4(w))
    assert torch.equal(torch.ops.cag.int4_mm(x, qw, dm), full)
    assert torch.equal(torch.ops.cag.int4_mm(x[:1].contiguous(), qw, dm), full[:1])
    assert layouts.pack_int4_native(weight())[1].shape == (320, 2, 18)  # off Q4_0's grid: mins kept
    with pytest.raises(RuntimeError, match="K/32"):
        torch.ops.cag.int4_mm(x, qw, dm[:, :, :9].contiguous())


def test_panels_give_the_whole_rows_bits():
    """A matrix of more than WHOLE inputs is stored in panels (x's share of a panel stays in L1): where a
    panel is a multiple of 16 groups the product gives the whole rows' bits, for any row count (blocks
    of 4 rows and the rest, outputs carried from panel to panel in chunks) and both layouts; elsewhere
    (11,008 inputs: panels of 2,752) as near the float64 product as the whole rows are."""
    assert [layouts.panels(k) for k in (576, 6144, 8192, 11008, 14336)] == [1, 1, 2, 4, 4]
    g = torch.Generator().manual_seed(5)
    for w in (weight(300, 8192, 4), q4_0_weight(300, 8192, 4)):
        qw, dm = layouts.pack_int4_native(w)
        whole = layouts.to_panels(
            qw.permute(1, 0, 2).reshape(300, -1), dm.permute(1, 2, 0, 3).reshape(300, dm.shape[2], -1), 1
        )
        assert qw.shape == (2, 300, 2048) and dm.shape[:2] == (2, 300) and dm.shape[3] == 128
        assert torch.equal(whole[0], layouts.pack_int4(w)[0])
        for m in (1, 3, 8, 11, 70):
            x = torch.randn(m, 8192, generator=g).bfloat16()
            assert torch.equal(torch.ops.cag.int4_mm(x, qw, dm), torch.ops.cag.int4_mm(x, *whole)), m
    w = q4_0_weight(40, 11008, 6)
    qw, dm = layouts.pack_int4_native(w)
    assert qw.shape == (4, 40, 1376)
    x = torch.randn(5, 11008, generator=g).bfloat16()
    ref = x.double() @ w.double().t()
    whole = torch.ops.cag.int4_mm(x, layouts.pack_int4(w)[0], dm.permute(1, 2, 0, 3).reshape(40, 1, -1).contiguous())
    assert (torch.ops.cag.int4_mm(x, qw, dm).double() - ref).abs().max() <= 2 * (whole.double() - ref).abs().max()
    with pytest.raises(RuntimeError, match="in panels"):
        torch.ops.cag.int4_mm(x, qw, dm[:3].contiguous())
    with pytest.raises(RuntimeError, match="a panel's inputs"):
        torch.ops.cag.int4_mm(x[:, :64 * 43].contiguous(), qw[:, :, :1368].contiguous(), dm[..., :86].contiguous())


def test_bad_inputs_are_refused():
    qw, dm = layouts.pack_int4(weight())
    x = torch.randn(2, 576).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.cag.int4_mm(x.float(), qw, dm)
    with pytest.raises(RuntimeError, match="input width"):
        torch.ops.cag.int4_mm(x[:, :512].contiguous(), qw, dm)
    with pytest.raises(RuntimeError, match="float16"):
        torch.ops.cag.int4_mm(x, qw, dm.float())
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.cag.int4_mm(torch.randn(1, 32).bfloat16(), qw[:, :16].contiguous(), dm[..., :1].contiguous())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.cag.bf16_mm(torch.randn(1, 40).bfloat16(), torch.randn(8, 40).bfloat16())
    q8, d = layouts.pack_q8(weight(64, 576))
    with pytest.raises(RuntimeError, match="float16"):
        torch.ops.cag.q8_mm(x, q8, d.float())
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.cag.q8_mm(x, q8.to(torch.uint8), d)


def test_packed_takes_the_native_layout_only_where_it_fits():
    """int4 needs inputs in whole pairs of groups (in % 64 == 0): other widths keep torch's kernel for
    decode rows (a question's rows still take the native bf16 product)."""
    assert type(packed.pack(weight(64, 576), None, "int4", backends.AVX512)) is packed.NativePacked
    assert type(packed.pack(weight(64, 544), None, "int4", backends.AVX512)) is packed.TorchPackedNativeQuestions
    assert type(packed.pack(weight(64, 576), None, "int4")) is packed.TorchPacked
    assert type(packed.pack(weight(64, 576), None, "int8", backends.AVX512)) is packed.TorchPackedNativeQuestions
    # int4's LM head is int8 in groups of 32 with cag's kernels, bf16 with torch's
    assert weights._head_format("int4", native=True) == "q8"
    assert weights._head_format("int4", native=True, four_bit=True) == "int4"  # a head on int4's grid already
    assert weights._head_format("int4") == ("bf16" if layouts.bf16_packs() else "int8")


@pytest.mark.real
def test_int4_holds_the_embedded_models_gguf_weights_exactly(real_lm):
    """The embedded SmolLM2 ships as GGUF Q4_1 layers and a Q8_0 token embedding (its tied LM head):
    cag's int4 layout and int4's head layout hold them bit for bit, so CAG_WEIGHTS=int4 with cag's
    kernels computes with the very weights the GGUF holds."""
    model = real_lm.model
    head = model.get_output_embeddings().weight.detach()
    qw, d = layouts.pack_q8(head)
    assert torch.equal((qw.float().view(head.shape[0], -1, 32) * d.float()[..., None]).view_as(head), head)
    for layer in (model.model.layers[0], model.model.layers[-1]):
        for lin in (layer.self_attn.q_proj, layer.mlp.down_proj):
            w = lin.weight.detach()
            assert torch.equal(dequantized(*layouts.pack_int4(w)).float(), w)
