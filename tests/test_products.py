"""cag.kernels.native's weight products for decode rows (int4 as GGUF Q4_1 / Q4_0 hold it, multiplied with 8-bit
activations; int8 groups as Q8_0 holds it for int4's LM head; bf16): the products they compute, rows whose bits never
depend on the other rows of a call or on the threads, the int4 layouts, and bad inputs. Skipped with the reason where
the library cannot be built here."""

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


def q8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The int4 product as the AVX-512 kernel defines it, in float64: each row's bf16 input in groups of 32 to codes
    round(x * (127 / max|x|)) (float32, to nearest even) with scale max|x| / 127, times the codes and steps / mins
    of pack_int4(w): sum over groups of d dx sum(q qx) + m dx sum(qx)."""
    qw, dm = layouts.pack_int4(w)
    out_f, g = qw.shape[0], qw.shape[1] // 16
    q = torch.cat([qw.view(out_f, g, 16) & 15, qw.view(out_f, g, 16) >> 4], -1).double()  # (out, G, 32)
    xg = x.float().view(x.shape[0], g, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    # 127 / max|x| correctly rounded to float32 (as the kernel divides; torch's float32 division may differ in the last
    # bit), then x times it in float32: exact ties (63.5) round to even in both
    factor = torch.where(amax > 0, (127 / amax.double()).float(), torch.zeros_like(amax))
    codes = torch.round(xg * factor).clamp(-127, 127).double()
    dx = (amax / 127).double()  # (rows, G, 1)
    d, m = dm[:, 0].double(), dm[:, 1].double()  # (out, G)
    dots = torch.einsum("rgi,ogi->rog", codes, q)  # (rows, out, G)
    return (dots * d * dx[:, None, :, 0] + m * (dx[..., 0] * codes.sum(-1))[:, None]).sum(-1)


@pytest.mark.parametrize("rows", [1, 3, 8, 11, 17])
@pytest.mark.parametrize("grid", ["q4_1", "q4_0"])
def test_int4_product_multiplies_8_bit_activations(rows, grid):
    """The product is the int4 weights times each row's 8-bit codes (q8_reference) to float32's precision, and
    within ~1% of the exact product of the bf16 input (the codes' rounding)."""
    w = weight(330) if grid == "q4_1" else q4_0_weight(330)  # 330 outputs: the last block of 16 partly empty
    qw, dm = layouts.pack_int4_native(w)
    assert dm.shape[0] == (1 if grid == "q4_0" else 2)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = torch.ops.cag.int4_mm(x, qw, dm)
    assert got.dtype == torch.float32 and got.shape == (rows, 330)
    want = q8_reference(x, w)
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()
    exact = x.double() @ dequantized(*layouts.pack_int4(w)).t()
    assert (got.double() - exact).norm() < 0.01 * exact.norm()


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
    of = {"int4": lambda w: lambda x, p=layouts.pack_int4_native(w): torch.ops.cag.int4_mm(x, *p),
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
    a, b = weight(200, 576, 1), weight(56, 576, 2)  # a's last block of 16 outputs partly b's in the stack
    x = torch.randn(3, 576).bfloat16()
    stacked = torch.ops.cag.int4_mm(x, *layouts.pack_int4_native(torch.cat([a, b])))
    assert torch.equal(stacked, torch.cat([torch.ops.cag.int4_mm(x, *layouts.pack_int4_native(m)) for m in (a, b)], 1))


def q4_0_weight(out_f=320, in_f=576, seed=0) -> torch.Tensor:
    """A matrix on GGUF Q4_0's grid: d (q - 8) per group of 32, d a float16, some group's q = 0."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_f, in_f // 32, 32), generator=g)
    q[..., 0] = 0  # the value of largest magnitude, -8 d, as a Q4_0 quantizer makes it
    d = (torch.rand(out_f, in_f // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    return (d * (q - 8)).reshape(out_f, in_f)


def test_the_native_layout_holds_the_codes_in_blocks_of_16_outputs():
    """pack_int4_native holds pack_int4's codes, 4 inputs of 16 outputs a 64-byte run (low nibbles inputs 4k..4k+3,
    high 16+4k..), outputs past the matrix zero; a matrix on Q4_0's grid keeps its steps alone (18 bytes a group),
    any other steps and mins."""
    w = q4_0_weight(40, 576)
    qw, dm = layouts.pack_int4_native(w)
    assert qw.shape == (3, 18, 256) and dm.shape == (1, 18, 40) and qw.dtype == torch.uint8
    two, dm2 = layouts.pack_int4(w)
    codes = torch.cat([two.view(40, 18, 16) & 15, two.view(40, 18, 16) >> 4], -1)  # (out, G, 32)
    runs = qw.view(3, 18, 4, 16, 4)  # (block, group, run, output, input)
    for o, g, k, j in ((0, 0, 0, 0), (17, 5, 3, 2), (39, 17, 1, 3)):
        byte = runs[o // 16, g, k, o % 16, j]
        assert byte & 15 == codes[o, g, 4 * k + j] and byte >> 4 == codes[o, g, 16 + 4 * k + j]
    assert not runs[2, :, :, 8:].any()  # outputs 40..47: none
    assert torch.equal(dm[0], dm2[:, 0].t())
    assert layouts.pack_int4_native(weight())[1].shape == (2, 18, 320)  # off Q4_0's grid: mins kept


def test_a_wide_matrix_is_the_reference():
    """14,336 inputs (Llama 3 8B's down projection: 448 groups) and 100 outputs (a partial last block)."""
    w = q4_0_weight(100, 14336, 9)
    x = torch.randn(5, 14336, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = torch.ops.cag.int4_mm(x, *layouts.pack_int4_native(w))
    want = q8_reference(x, w)
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()


def test_bad_inputs_are_refused():
    qw, dm = layouts.pack_int4_native(weight())
    x = torch.randn(2, 576).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.cag.int4_mm(x.float(), qw, dm)
    with pytest.raises(RuntimeError, match="input width"):
        torch.ops.cag.int4_mm(x[:, :512].contiguous(), qw, dm)
    with pytest.raises(RuntimeError, match="float16"):
        torch.ops.cag.int4_mm(x, qw, dm.float())
    with pytest.raises(RuntimeError, match="256"):
        torch.ops.cag.int4_mm(x, *layouts.pack_int4(weight()))  # the AVX2 products' layout
    with pytest.raises(RuntimeError, match="blocks of 16"):
        torch.ops.cag.int4_mm(x, qw, dm[..., :100].contiguous())
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
