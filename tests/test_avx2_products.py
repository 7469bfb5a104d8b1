"""cag's AVX2 products (CAG_DECODE_KERNELS=avx2, `auto` on CPUs below the AVX512-BF16 floor): int4 on 8-bit
activations (the AVX-512 products' arithmetic, to the bit where both run) and q8 products equal to their references
within float32 rounding, a row's bits its own whatever the other rows and the thread count, and an engine on them
exact: `cag` == `full`, batched == alone."""

import re
import shutil
import subprocess

import pytest
import torch

from cag.answering.query import Query
from cag.kernels import backends, native
from cag.model import layouts, packed, weights
from tests.test_batch import QUESTIONS, together
from tests.test_products import q4_0_weight, q8_reference

# Skipped only where the CPU or the compiler cannot build them: a failed build fails the tests
pytestmark = pytest.mark.skipif(
    native.avx2_why_not() is not None, reason=f"cag's AVX2 products cannot run here: {native.avx2_why_not()}"
)


@pytest.fixture(autouse=True)
def _built():
    assert native.load_avx2(), native.avx2_reason()


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_the_library_holds_no_avx512_instruction():
    """Built on an AVX-512 CPU with -march=native it held AVX-512 instructions the compiler picked (142 zmm operands
    on a Zen 4), so an AVX2-only CPU given such code would die of SIGILL, and the AVX2 code measured on an AVX-512 CPU
    was not the code an AVX2 CPU runs: it is compiled for AVX2, FMA and F16C only (native.ISA)."""
    text = subprocess.run(["objdump", "-d", str(native._avx2["path"])], capture_output=True, text=True).stdout
    assert "vfmadd" in text and "ymm" in text  # the disassembly is there, and it is AVX2 code
    evex = re.findall(r"%zmm\d+|%ymm(?:1[6-9]|2\d|3[01])\b|%xmm(?:1[6-9]|2\d|3[01])\b|%k[1-7]\b", text)
    assert not evex, f"AVX-512 registers in the AVX2 library: {sorted(set(evex))[:8]}"


def _q8_reference(w: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    qw, d = layouts.pack_q8(w)
    return (qw, d), (qw.view(w.shape[0], -1, 32).double() * d[..., None].double()).reshape(w.shape)


@pytest.mark.parametrize("fmt", ["int4", "q8"])
# 192: a last block of 6 groups
@pytest.mark.parametrize(("out_f", "in_f"), [(64, 64), (48, 192), (96, 2048), (40, 4096)])
def test_products_are_the_held_weights_and_row_invariant(fmt, out_f, in_f):
    torch.manual_seed(0)
    w = torch.randn(out_f, in_f) * 0.05
    mm = getattr(torch.ops.cag_avx2, packed.NATIVE_MM[fmt])
    x = torch.randn(11, in_f).to(torch.bfloat16)
    if fmt == "int4":  # the weights' codes times each row's 8-bit codes (tests/test_products.py's model of it)
        copy = layouts.pack_int4_native(w)
        ref = q8_reference(x, w)
    else:
        copy, held = _q8_reference(w)
        ref = x.double() @ held.t()
    y = mm(x, *copy)  # (11, out) float32
    assert y.dtype == torch.float32 and ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    alone = torch.cat([mm(x[r : r + 1].contiguous(), *copy) for r in range(11)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = mm(x, *copy)
    finally:
        torch.set_num_threads(threads)
    for m in (2, 4, 5, 9, 11):  # blocks of 4 rows and the rest
        assert torch.equal(mm(x[:m].contiguous(), *copy), alone[:m]), m
    assert torch.equal(one_thread, y)


@pytest.mark.skipif(native.why_not() is not None, reason="the AVX-512 library does not run here")
@pytest.mark.parametrize("grid", ["q4_1", "q4_0"])
def test_int4_is_the_avx512_products_bit_for_bit(grid):
    """Per output the same operations in the same order (codes, an exact integer sum, one conversion, the scales'
    product, a multiply-add per group), 8 lanes at a time here and 16 there: the same bits."""
    assert native.load() is not None
    w = torch.randn(200, 1536) * 0.05 if grid == "q4_1" else q4_0_weight(200, 1536)
    copy = layouts.pack_int4_native(w)
    x = torch.randn(13, 1536).to(torch.bfloat16)
    assert torch.equal(torch.ops.cag_avx2.int4_mm(x, *copy), torch.ops.cag.int4_mm(x, *copy))


def test_int4_takes_the_avx2_products_for_every_row_and_its_head_in_q8():
    lin = torch.nn.Linear(128, 96, bias=False)
    fl = weights.FastLinear(lin, "int4", backend=backends.AVX2, out_dtype=torch.float32)
    assert type(fl.packs) is packed.Avx2Packed and weights._head_format("int4", native=True) == "q8"
    x = torch.randn(7, 128)
    with torch.inference_mode():
        decode = fl.decode(x)
        # a question's rows: the same copy, the same bits
        assert torch.equal(fl.decode(x, [(3, False), (4, True)]), decode)
    assert type(packed.pack(lin.weight, None, "int4", backends.AVX2)) is packed.Avx2Packed
    # 96 inputs: not int4's 64s
    assert type(packed.pack(torch.randn(96, 96), None, "int4", backends.AVX2)) is packed.TorchPacked


@pytest.fixture
def avx2_engine(tiny_model_dir, monkeypatch):
    from cag.config import get_settings
    from cag.engine import Engine

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    monkeypatch.setenv("CAG_DECODE_KERNELS", "avx2")
    return Engine(get_settings())


def test_an_engine_on_the_avx2_products_is_exact(avx2_engine, small_corpus):
    e = avx2_engine
    from cag.runtime import describe

    assert e.lm.kernels == "avx2" and describe.decode_path(e.lm)["kernels"] == "avx2"
    layer = e.lm.model.model.layers[0]
    assert type(layer.mlp.down_proj.packs) is packed.Avx2Packed and e.lm.model.lm_head.fmt == "q8"
    e.ingest(str(small_corpus))
    alone = [e.answer(Query("corpus", q, max_tokens=16)).token_ids for q in QUESTIONS]
    # cag == full
    assert alone == [e.answer(Query("corpus", q, max_tokens=16, mode="full")).token_ids for q in QUESTIONS]
    # batched == alone
    assert together(e, [lambda q=q: e.answer(Query("corpus", q, max_tokens=16)).token_ids for q in QUESTIONS]) == alone


def test_avx2_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    from cag.errors import ModelError

    monkeypatch.setattr(native, "_avx2", {"why": "this CPU lacks avx2"})
    with pytest.raises(
        ModelError, match="CAG_DECODE_KERNELS=avx2 cannot run here: this CPU lacks avx2; use auto or torch"
    ):
        native.resolve("avx2")
