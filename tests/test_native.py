"""cag.kernels.native's decode attention (AVX512-BF16, and AMX where the CPU has it; the AVX2 library's on any
CPU with AVX2): the attention it computes, rows that never depend on the batch, its bad inputs; the step's
glue in both libraries, and whole layers in one call (the same bits as the separate ops); the
CAG_DECODE_KERNELS modes; and cag == full through the kernels on a model with heads of 64. Where a library
cannot be built here (another CPU, no compiler) its tests skip with the reason; where it can, a failed build
fails them."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from cag.config import get_settings
from cag.engine import Engine
from cag.errors import ModelError
from cag.kernels import backends, native
from cag.model import packed
from cag.model import weights as weights_mod
from cag.model.stacked_products import own
from cag.runtime import all_layers
from cag.runtime import step as lean
from tests.test_batch import cached_is_full_alone_and_together
from tests.test_exactness import QUESTIONS
from tests.test_step import one_part


@pytest.fixture(scope="module")
def library():
    if why := native.why_not():
        pytest.skip(f"cag's kernels cannot run here: {why}")
    assert native.load() is not None, native.reason()  # a machine that has what it needs must build it


@pytest.fixture(scope="module")
def avx2_library():
    if why := native.avx2_why_not():
        pytest.skip(f"cag's AVX2 kernels cannot run here: {why}")
    assert native.load_avx2(), native.avx2_reason()


HERE = ["avx512", "avx2"] + (["amx"] if native.tiles() else [])  # the attention variants this CPU may run


@pytest.fixture(params=HERE)
def kernel(request):
    request.getfixturevalue("avx2_library" if request.param == "avx2" else "library")
    return backends.BY_NAME[request.param].attention_kernel


@pytest.fixture(params=["cag", "cag_avx2"])
def ops(request):
    """The step's glue (rms_bf16, rms_f32, rope_write, silu_mul_bf16) of either library: the same signatures."""
    request.getfixturevalue("avx2_library" if request.param == "cag_avx2" else "library")
    return (backends.AVX2 if request.param == "cag_avx2" else backends.AVX512).ops()


def case(B, R, n, lens, D=64, H=2, S=4, room=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, R, D, generator=g)
    kp, vp = (torch.randn(H, n, D, generator=g) * 2).bfloat16(), torch.randn(H, n, D, generator=g).bfloat16()
    ks, vs = (
        (torch.randn(S, H, room, D, generator=g) * 2).bfloat16(),
        torch.randn(S, H, room, D, generator=g).bfloat16(),
    )
    slots = torch.tensor([(3 * b + 1) % S for b in range(B)])
    return q, kp, vp, ks, vs, slots, torch.tensor(lens)


def reference(q, kp, vp, ks, vs, slots, lens, scale, rounded=True, window=None, softcap=None):
    """float64 softmax attention of each request over prefix ++ its own suffix keys, q rounded to bf16 (`rounded`);
    with a `window`, request b's row (at position n + lens[b] - 1) over its last `window` keys only; with a
    `softcap`, each scaled score s as softcap * tanh(s / softcap) (Gemma 2's eager attention)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    last = slice(-window, None) if window else slice(None)
    for b in range(q.shape[0]):
        K = torch.cat([kp, ks[slots[b], :, : lens[b]]], 1).double()[:, last]  # (H, n + len, D), or its last W
        V = torch.cat([vp, vs[slots[b], :, : lens[b]]], 1).double()[:, last]
        s = (q[b].bfloat16() if rounded else q[b]).double() @ K.transpose(-1, -2) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out[b] = torch.softmax(s, -1) @ V
    return out


@pytest.mark.parametrize(("B", "R", "n", "lens", "D"), [
    (1, 3, 4096, [1], 64),          # one request, SmolLM2's shapes: a 4K prefix, the first answer token
    (3, 3, 1000, [5, 300, 17], 64),  # prefix and suffixes that end mid-chunk; a suffix over one chunk
    (2, 2, 0, [3, 40], 64),         # no prefix
    (2, 5, 257, [1, 2], 128),        # heads of 128; a prefix one key past a chunk
    (6, 3, 300, [7] * 6, 64),        # 18 rows on one prefix: more than one block of 16 rows
    (2, 4, 300, [3, 260], 96),       # heads of 96 (Phi-3): three 32-dim groups a key
    (2, 4, 300, [3, 260], 80),       # heads of 80 (Phi-2): two 32-dim groups and a half group of 16
    (6, 3, 9, [1, 2, 17, 3, 40, 5], 80),  # and 18 rows, fewer prefix keys than a block, suffixes over blocks
    (2, 2, 270, [1, 9], 256),        # heads of 256, the widest
])
def test_kernel_computes_attention(request, kernel, B, R, n, lens, D):
    args, mode = case(B, R, n, lens, D), request.node.callspec.params["kernel"]
    if mode == "amx" and D % 64:  # AMX sums values 64 dims at a time: the step takes avx512's
        with pytest.raises(RuntimeError, match="AMX attention takes heads of 64, 128 or 256"):
            kernel(*args, D ** -0.5)
        return
    got = kernel(*args, D ** -0.5)
    assert got.shape == args[0].shape and got.dtype == torch.float32
    if mode == "avx2":  # all in float32: q and the probabilities are not rounded to bf16
        assert (got.double() - reference(*args, D ** -0.5, rounded=False)).abs().max() < 1e-5
        return
    want = reference(*args, D ** -0.5)
    assert (got.double() - want).abs().max() < 2e-2  # probabilities rounded to bf16, as torch's flash kernel does


# R 1: no GQA; a request alone is one row an item
@pytest.mark.parametrize("R,D", [(3, 64), (1, 64), (1, 80), (3, 96), (1, 128)])
def test_rows_never_depend_on_the_batch(request, kernel, R, D):
    """Each request alone, and in another order, gets the bits it gets in the batch (the AVX2 kernel takes
    an item's rows two at a time: a row alone, paired and last are all the same bits)."""
    if request.node.callspec.params["kernel"] == "amx" and D % 64:
        pytest.skip("the AMX attention takes heads of 64, 128 or 256")
    q, kp, vp, ks, vs, slots, lens = case(5, R, 700, [1, 9, 260, 4, 33], D)
    together = kernel(q, kp, vp, ks, vs, slots, lens, 0.125)
    for b in range(5):
        alone = kernel(q[b : b + 1].contiguous(), kp, vp, ks, vs, slots[b : b + 1], lens[b : b + 1], 0.125)
        assert torch.equal(alone, together[b : b + 1])
    order = torch.tensor([4, 2, 0, 3, 1])
    shuffled = kernel(q[order].contiguous(), kp, vp, ks, vs, slots[order].contiguous(), lens[order].contiguous(), 0.125)
    assert torch.equal(shuffled, together[order])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the items spread over one thread, not two
    try:
        assert torch.equal(kernel(q, kp, vp, ks, vs, slots, lens, 0.125), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("R,D", [(2, 64), (3, 80)])
@pytest.mark.parametrize("lens,n,window", [
    ([250 + 7 * b for b in range(70)] + [600, 3, 256, 512], 0, None),  # chunks of 256: full, partial, exactly full
    (list(range(1, 301)) + list(range(500, 530)), 100, None),  # a prefill's diagonal: row t reads t + 1 keys
    (list(range(1, 301)), 40, 100),  # and under a sliding window
])
def test_rows_on_one_slot_read_chunks_together_with_their_own_bits(request, kernel, R, D, lens, n, window):
    """A knowledge prefill's decode rows are requests on one slot: their items take up to GROUP rows that read keys
    of a chunk together (the rows share its K/V reads), the item as long as its longest row, each row's keys past
    its own count masked. Each row still gets the bits it gets alone, over runs of the slot longer than a group,
    rows whose last chunk is partial (the diagonal), a window, and a run broken by another slot."""
    if request.node.callspec.params["kernel"] == "amx" and D % 64:
        pytest.skip("the AMX attention takes heads of 64, 128 or 256")
    B = len(lens)
    q, kp, vp, ks, vs, _, _ = case(B, R, n, lens, D, room=760)
    slots = torch.tensor([0] * 40 + [2] + [0] * (B - 41))
    lens = torch.tensor(lens)
    win = {} if window is None else {"window": window}
    together = kernel(q, kp, vp, ks, vs, slots, lens, 0.125, **win)
    for b in range(B):
        alone = kernel(q[b : b + 1].contiguous(), kp, vp, ks, vs, slots[b : b + 1], lens[b : b + 1], 0.125, **win)
        assert torch.equal(alone, together[b : b + 1]), b
    mode = request.node.callspec.params["kernel"]
    want = reference(q, kp, vp, ks, vs, slots, lens, 0.125, rounded=mode != "avx2", window=window)
    assert (together.double() - want).abs().max() < (1e-5 if mode == "avx2" else 2e-2)


@pytest.mark.parametrize(("n", "lens", "window"), [
    (1000, [1, 300, 17, 260, 5], 300),   # windows from inside the prefix, across chunks, inside the suffix
    (700, [1, 9, 260, 4, 33], 8),        # Gemma-like narrow windows: one chunk, the prefix's last keys
    (0, [3, 600, 257, 256, 1], 256),     # no prefix: each row's window starts inside its own suffix
    (513, [2, 40, 512, 700, 1], 4096),   # a window wider than every row's keys: plain attention
])
def test_a_window_reads_each_rows_last_keys(request, kernel, n, lens, window):
    """A window layer's row reads only its last W keys (cag.model.windows); its bits are its own: alone, in the
    batch, shuffled, and one thread; keys outside every window (zeros where a snapshot dropped them) are never
    read; W past every row's keys is plain attention, bit for bit."""
    mode = request.node.callspec.params["kernel"]
    q, kp, vp, ks, vs, slots, lens = case(len(lens), 3, n, lens, 64, room=760)
    got = kernel(q, kp, vp, ks, vs, slots, lens, 0.125, window=window)
    want = reference(q, kp, vp, ks, vs, slots, lens, 0.125, rounded=mode != "avx2", window=window)
    assert (got.double() - want).abs().max() < (1e-5 if mode == "avx2" else 2e-2)
    for b in range(len(lens)):
        one = slice(b, b + 1)
        alone = kernel(q[one].contiguous(), kp, vp, ks, vs, slots[one], lens[one], 0.125, window=window)
        assert torch.equal(alone, got[b : b + 1]), b
    order = torch.arange(len(lens)).flip(0)
    shuffled = kernel(q[order].contiguous(), kp, vp, ks, vs, slots[order].contiguous(), lens[order].contiguous(), 0.125,
                      window=window)
    assert torch.equal(shuffled, got[order])
    hidden = kp.clone()  # the prefix keys no row's window reaches, as a snapshot's window layer leaves them: zeros
    first = min(n + int(length) - window for length in lens)
    if first > 0:
        hidden[:, :first] = 0
        vz = vp.clone()
        vz[:, :first] = 0
        assert torch.equal(kernel(q, hidden, vz, ks, vs, slots, lens, 0.125, window=window), got)
    if window >= n + max(lens):
        assert torch.equal(got, kernel(q, kp, vp, ks, vs, slots, lens, 0.125))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernel(q, kp, vp, ks, vs, slots, lens, 0.125, window=window), got)
    finally:
        torch.set_num_threads(threads)


def test_a_window_over_a_pre_paired_prefix_gives_the_same_bits(library):
    """The AVX-512 kernel's pre-paired prefix under a window: the bits of K/V as given."""
    q, kp, vp, ks, vs, slots, lens = case(3, 3, 900, [1, 40, 300], 64, room=400)
    op = backends.AVX512.attention_kernel
    plain = op(q, kp, vp, ks, vs, slots, lens, 0.125, window=333)
    kt, vt = torch.ops.cag.pair_kv(kp, vp)
    assert torch.equal(op(q, kp, vp, ks, vs, slots, lens, 0.125, kt, vt, window=333), plain)
    assert not torch.equal(plain, op(q, kp, vp, ks, vs, slots, lens, 0.125))  # the window changed what was read


@pytest.mark.parametrize(("n", "lens", "window", "D"), [
    (700, [1, 9, 260, 4, 33], None, 64),  # prefix and suffixes across chunks
    (1000, [1, 300, 17], 300, 64),        # under a sliding window, as Gemma 2's window layers read
    (270, [1, 9], None, 256),             # Gemma 2's heads of 256
])
def test_soft_capped_scores(request, kernel, n, lens, window, D):
    """Gemma 2's attention logit soft-capping (scores cap * tanh(score / cap)): the float64 formula's result, a row's
    bits its own (alone, batched, shuffled), and not the uncapped attention."""
    mode = request.node.callspec.params["kernel"]
    if mode == "amx" and D % 64:
        pytest.skip("the AMX attention takes heads of 64, 128 or 256")
    q, kp, vp, ks, vs, slots, lens = case(len(lens), 3, n, lens, D, room=760)
    q = q * 4  # scores of several units: a cap of 5 bends them
    args, win = (q, kp, vp, ks, vs, slots, lens, D ** -0.5), ({} if window is None else {"window": window})
    got = kernel(*args, softcap=5.0, **win)
    want = reference(*args, rounded=mode != "avx2", window=window, softcap=5.0)
    assert (got.double() - want).abs().max() < (1e-4 if mode == "avx2" else 2e-2)
    assert (kernel(*args, **win).double() - want).abs().max() > 0.1  # the cap moved the answer
    for b in range(len(lens)):
        one = slice(b, b + 1)
        alone = kernel(q[one].contiguous(), kp, vp, ks, vs, slots[one], lens[one], D ** -0.5, softcap=5.0, **win)
        assert torch.equal(alone, got[one]), b
    order = torch.arange(len(lens)).flip(0)
    shuffled = kernel(q[order].contiguous(), kp, vp, ks, vs, slots[order].contiguous(), lens[order].contiguous(),
                      D ** -0.5, softcap=5.0, **win)
    assert torch.equal(shuffled, got[order])
    if mode == "avx512":  # over a pre-paired prefix: the same bits
        kt, vt = torch.ops.cag.pair_kv(kp, vp)
        assert torch.equal(kernel(*args, kt, vt, softcap=5.0, **win), got)
    with pytest.raises(RuntimeError, match="softcap"):
        kernel(*args, softcap=-1.0)


def test_bad_inputs_are_refused(kernel):
    q, kp, vp, ks, vs, slots, lens = case(1, 3, 64, [4])
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(q, kp.float(), vp, ks, vs, slots, lens, 0.125)
    with pytest.raises(RuntimeError, match="suffix outside"):
        kernel(q, kp, vp, ks, vs, slots, torch.tensor([301]), 0.125)
    with pytest.raises(RuntimeError, match="head dim"):
        kernel(q[..., :32].contiguous(), kp[..., :32], vp[..., :32], ks[..., :32], vs[..., :32], slots, lens, 0.125)


@pytest.mark.parametrize(("B", "R", "n", "lens", "D"), [
    (1, 3, 4096, [1], 64), (3, 3, 1000, [5, 300, 17], 64), (2, 2, 0, [3, 40], 64), (2, 5, 257, [1, 2], 128),
    (1, 3, 9, [2], 64),  # fewer keys than a block of 16, an odd count: pairs padded with zeros
    (2, 4, 301, [3, 7], 96), (1, 2, 259, [5], 256),  # heads of 96 and 256
    (2, 4, 301, [3, 7], 80), (1, 3, 9, [2], 80),  # heads of 80: the last 16 dims a half group
])
def test_a_pre_paired_prefix_gives_the_same_bits(library, B, R, n, lens, D):
    """pair_kv lays a resident prefix out once as the AVX-512 kernel reads it (K's dim pairs per 16
    keys, V's key pairs per dim); the kernel over that layout computes the same products in the same
    order: the bits of the kernel rearranging the prefix itself."""
    q, kp, vp, ks, vs, slots, lens = case(B, R, n, lens, D)
    kt, vt = torch.ops.cag.pair_kv(kp, vp)
    assert kt.shape == (2, -(-n // 256), D // 2, 256) and vt.shape == (2, (n + 1) // 2, D) and kt.dtype == torch.int32
    if n:  # pair i of key t holds dims 2i, 2i + 1; pair u of dim d holds keys 2u, 2u + 1
        pair = kt[1, 0, 3, 5].item() & 0xFFFFFFFF
        kbits = kp[1, 5, 6:8].view(torch.int16).int() & 0xFFFF
        assert pair == int(kbits[0]) | int(kbits[1]) << 16
        vbits = vp[1, 0:2, 7].view(torch.int16).int() & 0xFFFF if n > 1 else None
        if vbits is not None:
            assert vt[1, 0, 7].item() & 0xFFFFFFFF == int(vbits[0]) | int(vbits[1]) << 16
    op = torch.ops.cag.decode_attention_avx512
    assert torch.equal(op(q, kp, vp, ks, vs, slots, lens, D**-0.5, kt, vt), op(q, kp, vp, ks, vs, slots, lens, D**-0.5))
    with pytest.raises(RuntimeError, match="pair_kv"):
        op(q, kp, vp, ks, vs, slots, lens, D ** -0.5, kt[:, :, :1].contiguous(), vt)
    with pytest.raises(RuntimeError, match="both or neither"):
        op(q, kp, vp, ks, vs, slots, lens, D ** -0.5, kt, None)


@pytest.mark.parametrize("D", [64, 80])  # 80: half a head (40) is not a whole number of 16-lane steps
def test_rope_write_is_the_formula_bit_for_bit(ops, D):
    """The step's rope and K/V write in one call: q, and the bf16 K and V it writes, equal torch's
    `x * cos + roll(x, D/2) * sin` (then `.to(bf16)`) bit for bit; other slots and positions untouched."""
    R, H, Hk = 5, 6, 2
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(R, (H + 2 * Hk) * D, generator=g)
    cos, sin = torch.randn(R, D, generator=g), torch.randn(R, D, generator=g)
    slots, pos = torch.tensor([0, 2, 2, 1, 0]), torch.tensor([3, 0, 1, 7, 4])
    K, V = torch.zeros(3, Hk, 8, D, dtype=torch.bfloat16), torch.zeros(3, Hk, 8, D, dtype=torch.bfloat16)
    q = ops.rope_write(qkv, cos, sin, K, V, slots, pos, H)
    rope = lambda x: x * cos[:, None] + x.roll(D // 2, -1) * sin[:, None]  # noqa: E731
    want_q, k, v = qkv.split([H * D, Hk * D, Hk * D], -1)
    assert torch.equal(q, rope(want_q.reshape(R, H, D)))
    wk, wv = torch.zeros_like(K), torch.zeros_like(V)
    wk[slots, :, pos] = rope(k.reshape(R, Hk, D)).bfloat16()
    wv[slots, :, pos] = v.reshape(R, Hk, D).bfloat16()
    assert torch.equal(K, wk) and torch.equal(V, wv)
    with pytest.raises(RuntimeError, match="outside the buffers"):
        ops.rope_write(qkv, cos, sin, K, V, slots, torch.tensor([3, 0, 1, 8, 4]), H)


def test_rms_bf16_is_the_norm_rounded_once(ops):
    """RMSNorm straight to bf16: within one bf16 rounding of torch's float32 formula, a row's bits its own."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 576, generator=g) * 3, torch.rand(576, generator=g) + 0.5
    got = ops.rms_bf16(x, w, 1e-5)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert got.dtype == torch.bfloat16 and ((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-6).all()
    assert torch.equal(torch.cat([ops.rms_bf16(x[i : i + 1], w, 1e-5) for i in range(7)]), got)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_bf16(x.double(), w, 1e-5)


def test_rms_f32_is_the_same_norm_unrounded(ops):
    """The q/k norms' and post-norms' RMSNorm: rms_bf16's values before their rounding, within float32
    rounding of torch's formula, over any leading shape (Qwen3's (R, H, D) heads) and a view's rows."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 4, 80, generator=g) * 3, torch.rand(80, generator=g) + 0.5
    got = ops.rms_f32(x, w, 1e-6)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert ((got - want).abs() <= want.abs() * 2**-20 + 1e-6).all()
    assert torch.equal(got.bfloat16().view(12, 80), ops.rms_bf16(x.view(12, 80), w, 1e-6))
    wide = torch.randn(12, 200, generator=g)
    assert torch.equal(ops.rms_f32(wide[:, 40:120], w, 1e-6), ops.rms_f32(wide[:, 40:120].contiguous(), w, 1e-6))
    with pytest.raises(RuntimeError, match=r"w: \(N,\) float32"):
        ops.rms_f32(x, w[:64], 1e-6)


def test_the_amx_op_refuses_on_a_library_built_without_it(library):
    if native.tiles():
        pytest.skip("this CPU has AMX: the library holds the AMX attention")
    with pytest.raises(RuntimeError, match="without AMX"):
        backends.AMX.attention_kernel(*case(1, 3, 64, [4]), 0.125)


def test_modes(library):
    assert native.resolve("torch") == "torch" and native.resolve("avx512") == "avx512"
    assert native.resolve("auto") == "avx512"  # the faster of the two on AMX CPUs as well (bench_decode)
    if native.tiles():
        assert native.resolve("amx") == "amx"
    else:
        with pytest.raises(ModelError, match="lacks amx_tile"):
            native.resolve("amx")
    with pytest.raises(ModelError, match="unknown decode kernels"):
        native.resolve("fast")
    with pytest.raises(ModelError, match="for the CPU"):
        native.resolve("avx512", "cuda")
    assert native.resolve("auto", "cuda") == "torch"


def test_a_failed_build_falls_back_or_refuses(monkeypatch, tmp_path, caplog):
    """A machine that should build the library but cannot (here: a compiler that fails): `auto` decodes
    with torch's kernels after one warning, `amx` and `avx512` refuse with the reason."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "why_not", lambda: None)
    monkeypatch.setattr(native, "cpu_why_not", lambda: None)  # a CPU that could run it, whatever this one is
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="cag.kernels.native"):
        assert native.resolve("auto") == "torch"
    assert "falls back to torch" in caplog.text and "did not build" in caplog.text
    for mode in ("amx", "avx512"):
        with pytest.raises(ModelError, match="cannot run here: it did not build"):
            native.resolve(mode)
    assert not list(tmp_path.rglob("*.so*"))  # no half-written library left behind


def test_native_kernels_are_refused_where_decode_attends_in_float32(tiny64_model_dir, monkeypatch):
    monkeypatch.setenv("CAG_MODEL", str(tiny64_model_dir))
    monkeypatch.setenv("CAG_DECODE_KERNELS", "avx512")
    with pytest.raises(ModelError, match="needs bf16 K/V"):
        Engine(get_settings()).lm  # noqa: B018 (loads the model)


@pytest.mark.parametrize("mode", HERE)
@pytest.mark.parametrize("weights,kv_dtype", [("bf16", "auto"), ("int4", "auto"), ("int4", "int8")])
def test_cag_equals_full_through_the_kernels(
    request, tiny64_model_dir, small_corpus, monkeypatch, weights, kv_dtype, mode
):
    """Decode rows run on cag's kernels (attention over bf16 K/V with heads of 64, or with the AVX-512
    kernel over an int8 snapshot's codes; the fused norm and rope, the products; the AVX2 library's
    attention, glue and int4 products): cached and uncached answers agree token for token, alone and asked together."""
    request.getfixturevalue("avx2_library" if mode == "avx2" else "library")
    if mode == "avx2" and weights != "int4":
        pytest.skip("the AVX2 products are int4's (and its head's q8)")
    monkeypatch.setenv("CAG_MODEL", str(tiny64_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", weights)
    monkeypatch.setenv("CAG_DECODE_KERNELS", mode)
    monkeypatch.setenv("CAG_KV_DTYPE", kv_dtype)
    engine = Engine(get_settings())
    step = lean.for_model(engine.lm.model)
    assert engine.lm.kernels == mode and step.kernel is not None and step.glue is not None
    assert (step.fused is not None) == (mode != "amx")  # all layers in one call (not AMX's attention)
    packs = [m.packs for m in engine.lm.model.modules() if isinstance(m, weights_mod.FastLinear)]
    own = packed.Avx2Packed if mode == "avx2" else packed.NativePacked
    assert packs and all(isinstance(p, own) for p in packs)  # every product through cag's own kernel
    assert step.native == ("glue" if mode == "amx" else "layers")
    engine.ingest(str(small_corpus))
    cached_is_full_alone_and_together(engine, QUESTIONS[:3], 16, distinct=False)
    (res,) = engine.resident._items.values()
    pairs = res.prefix.made.get("pairs", {})  # the AMX attention reads the K/V as stored: no pairs
    int8 = kv_dtype == "int8" and mode == "avx512"  # the AVX-512 kernel reads the codes; AMX the dequantized K/V
    assert all((p[0].dtype == torch.uint8) == int8 for p in pairs.values()) if pairs else mode in ("amx", "avx2")


def test_the_resident_budget_counts_the_pairs(library):
    """A prefix's pairs (as many bytes again) count in its size, and the pool evicts for them at the next
    request, not only at the next load."""
    from cag.answering.resident import Resident, ResidentPool
    from cag.runtime import attention
    from cag.runtime.slots import PrefixKV

    def resident(n):
        return Resident(None, PrefixKV([(torch.zeros(1, 3, n, 64, dtype=torch.bfloat16),) * 2], n))

    a, b = resident(256), resident(256)
    pool = ResidentPool(budget_bytes=a.nbytes * 2 + 1)
    pool.get("a", lambda: a)
    pool.get("b", lambda: b)
    assert "a" in pool and "b" in pool
    before = b.nbytes
    attention._pairs(b.prefix, 0, *b.prefix.kv[0])  # what b's first decode step makes
    assert b.nbytes == 2 * before
    pool.get("b", lambda: b)  # a hit
    assert "a" not in pool and "b" in pool


def test_the_resident_pool_lets_snapshots_go_before_kept_rows(library):
    """Past the budget, snapshots other than the one asked for are evicted before kept K/V (a warmed quote
    costs a prefill to make again, a snapshot a read of its file); the kept rows go only when the one
    snapshot asked for and they do not fit together."""
    from cag.answering.resident import Resident, ResidentPool
    from cag.runtime.kept_conversations import KeptConversations
    from cag.runtime.slots import PrefixKV

    def resident(n):
        return Resident(None, PrefixKV([(torch.zeros(1, 3, n, 64, dtype=torch.bfloat16),) * 2], n))

    a, b = resident(256), resident(256)
    quotes = KeptConversations(10**9, "quote")
    quotes.keep("a", list(range(32)), [(torch.zeros(3, 32, 64, dtype=torch.bfloat16),) * 2])
    assert quotes.nbytes > 0
    pool = ResidentPool(a.nbytes + b.nbytes, [KeptConversations(10**9), quotes])
    pool.get("a", lambda: a)
    pool.get("b", lambda: b)  # a and b and the quote exceed the budget: a goes, the quote stays
    assert "a" not in pool and "b" in pool and quotes.nbytes > 0
    pool.budget_bytes = b.nbytes  # the snapshot asked for alone fills it: the quote goes
    pool.get("b", lambda: b)
    assert "b" in pool and quotes.nbytes == 0


def test_silu_mul_bf16_is_silu_times_up(ops):
    """silu(gate) x up in one call, rounded once to bf16: within one bf16 step of torch's formula, each
    row's bits its own."""
    g = torch.Generator().manual_seed(5)
    gu = torch.randn(5, 2 * 200, generator=g) * 6
    got = ops.silu_mul_bf16(gu)
    want = torch.nn.functional.silu(gu[:, :200]) * gu[:, 200:]
    assert got.dtype == torch.bfloat16 and got.shape == (5, 200)
    assert ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-30).all()
    assert torch.equal(torch.cat([ops.silu_mul_bf16(gu[i : i + 1]) for i in range(5)]), got)
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_mul_bf16(gu.double())


@pytest.fixture(scope="module")
def qwen2_64_dir(tiny64_model_dir, tmp_path_factory) -> Path:
    """A Qwen2 model of the tiny64 model's shape and tokenizer: q/k/v with biases (random, not zero)."""
    import transformers

    c = transformers.AutoConfig.from_pretrained(tiny64_model_dir)
    config = transformers.Qwen2Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=4096,
        initializer_range=0.15,
        tie_word_embeddings=True,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
    )
    torch.manual_seed(2)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.5)
    out = tmp_path_factory.mktemp("qwen2-64")
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(tiny64_model_dir).save_pretrained(out)
    return out


def _fused_engine(tiny64_model_dir, monkeypatch, weights="int4", kernels="avx512"):
    monkeypatch.setenv("CAG_MODEL", str(tiny64_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", weights)
    monkeypatch.setenv("CAG_DECODE_KERNELS", kernels)
    engine = Engine(get_settings())
    return engine, lean.for_model(engine.lm.model)


@pytest.mark.parametrize(("n", "starts", "which"), [
    (300, [0], [0]), (300, [0, 3, 6], [0, 0, 0]),  # one request and three on a prefix that ends mid-chunk
    (0, [2], [0]),                                  # no prefix at all
    (300, [0, 262], [0, 0]),                        # a suffix that fills more than one chunk of keys
    (300, [0, 3, 6], [0, 1, 0]),                    # requests on two prefixes (of 300 and 155 tokens)
])
@pytest.mark.parametrize(("weights", "family", "kernels"), [
    ("int4", "llama", "avx512"), ("bf16", "llama", "avx512"), ("int4", "qwen2", "avx512"), ("int4", "window", "avx512"),
    ("int4", "llama", "avx2"), ("int4", "qwen2", "avx2"), ("int4", "window", "avx2")])
def test_a_fused_layer_is_the_separate_ops_bit_for_bit(
    tiny64_model_dir, request, monkeypatch, n, starts, which, weights, family, kernels
):
    """decode_layers (all layers in one parallel region: the AVX-512 library's and the AVX2 library's) gives the
    logits and the K/V the separate ops give, bit for bit, over several steps (Qwen2: with its q/k/v biases;
    "window": Llama with a sliding window of 5 keys in its first layer, as Mistral's and Qwen2's window layers
    read)."""
    request.getfixturevalue("avx2_library" if kernels == "avx2" else "library")  # each skips where its CPU lacks it
    folder = request.getfixturevalue("qwen2_64_dir") if family == "qwen2" else tiny64_model_dir
    fused_is_separate(folder, monkeypatch, n, starts, which, weights, family, kernels)


@torch.inference_mode()
def fused_is_separate(folder, monkeypatch, n: int, starts: list[int], which: list[int], weights: str, family: str,
                      kernels: str = "avx512") -> None:
    """The check above on the model in `folder` (`family` "window": its first layer given a window of 5 keys)."""
    from cag.runtime.slots import PrefixKV, Slots

    engine, step = _fused_engine(folder, monkeypatch, weights, kernels)
    assert step.fused is not None and step.backend.name == kernels
    if family == "window":
        step.fns[0] = step.fns[0]._replace(window=5)
        step.fused = all_layers.weights(step, engine.lm.model)
    assert (step.fns[0].qkv_packed.bias is not None) == (family == "qwen2")
    cfg, D = engine.lm.model.config, engine.lm.head_dim
    g = torch.Generator().manual_seed(1)
    prefixes = [PrefixKV([tuple(torch.randn(1, cfg.num_key_value_heads, m, D, generator=g).bfloat16() for _ in "kv")
                        for _ in range(cfg.num_hidden_layers)], m) for m in (n, n // 2 + 5)]
    fused, B = step.fused, len(starts)

    def run(on: bool):
        step.fused = fused if on else None
        slots = Slots(cfg.num_hidden_layers, cfg.num_key_value_heads, D, 300, 4, torch.bfloat16)
        taken = torch.tensor([slots.take() for _ in range(B)])
        toks, at, out = torch.tensor([[7 + b] for b in range(B)]), torch.tensor(starts), []
        for _ in range(6):
            logits = one_part(step, toks, [prefixes[i] for i in which], taken, at, slots)
            toks, at = logits.argmax(-1).view(B, 1), at + 1
            out.append(logits)
        return torch.stack(out), [t[taken] for t in slots.k + slots.v]  # the slots taken (the rest: never written)

    try:
        a, b = run(True), run(False)
        if family == "window":  # and the window is read: without it the first layer sees every key
            step.fns[0] = step.fns[0]._replace(window=None)
            fused = all_layers.weights(step, engine.lm.model)
            assert not torch.equal(run(True)[0], a[0])
    finally:
        step.fused = fused
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_decode_layers_refuses_bad_inputs(library, tiny64_model_dir, monkeypatch):
    """Each layer's weights are checked by name once, when added; each call's buffers and rows on the call."""
    from cag.runtime import attention
    from cag.runtime.slots import PrefixKV, Slots

    engine, step = _fused_engine(tiny64_model_dir, monkeypatch)
    cfg = engine.lm.model.config
    L = cfg.num_hidden_layers
    prefix = PrefixKV(
        [tuple(torch.zeros(1, cfg.num_key_value_heads, 20, 64, dtype=torch.bfloat16) for _ in "kv")] * L, 20
    )
    slots = Slots(L, cfg.num_key_value_heads, 64, 8, 1, torch.bfloat16)
    flat = [t for i in range(L) for t in attention.paired(prefix, i)]
    h, cs, one = torch.zeros(1, cfg.hidden_size), torch.zeros(1, 64), torch.tensor([0])
    assert len(step.fused) == L

    def call(h=h, pos=one, k=slots.k, rows=one):
        torch.ops.cag.decode_layers(
            h, step.fused, cs, cs, k, slots.v, one, pos, flat, [rows], [one], [torch.tensor([1])]
        )

    call()
    with pytest.raises(RuntimeError, match="float32"):
        call(h=h.double())
    with pytest.raises(RuntimeError, match="per layer"):
        call(k=slots.k[:-1])
    with pytest.raises(RuntimeError, match="outside the buffers"):
        call(pos=torch.tensor([8]))
    with pytest.raises(RuntimeError, match="each row once"):
        call(rows=torch.tensor([1]))

    built = torch.classes.cag.DecodeWeights(
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=64,
        hidden=cfg.hidden_size,
        scale=0.125,
    )
    layer = engine.lm.model.model.layers[0]
    f = step.fns[0]
    qkv = all_layers._packed(f.qkv_packed, bias=True)
    o = all_layers._packed(own(layer.self_attn.o_proj))
    gu, dn = all_layers._packed(f.gu_packed), all_layers._packed(own(layer.mlp.down_proj))
    named = dict(input_norm=f.norm1, input_eps=f.eps1, qkv=qkv[0], qkv_scales=qkv[1], o=o[0], o_scales=o[1],
                 post_norm=f.norm2, post_eps=f.eps2, gate_up=gu[0], gate_up_scales=gu[1], down=dn[0], down_scales=dn[1],
                 qkv_bias=torch.empty(0), q_norm=torch.empty(0), q_eps=0.0, k_norm=torch.empty(0), k_eps=0.0,
                 post_norms=False, residual_multiplier=1.0)
    built.add_layer(**named)
    with pytest.raises(RuntimeError, match="q/k/v: int4 weights"):
        built.add_layer(**{**named, "qkv_scales": qkv[0]})  # its weights where its scales belong
    with pytest.raises(RuntimeError, match="widths disagree"):
        built.add_layer(**{**named, "qkv": o[0], "qkv_scales": o[1]})  # o where q/k/v belongs
    with pytest.raises(RuntimeError, match="norm weights"):
        built.add_layer(**{**named, "post_norm": f.norm2.double()})
    with pytest.raises(RuntimeError, match="qkv_bias"):
        built.add_layer(**{**named, "qkv_bias": torch.zeros(3)})  # not the q/k/v product's width
    with pytest.raises(RuntimeError, match="both or neither"):
        built.add_layer(**{**named, "q_norm": torch.ones(64)})
    with pytest.raises(RuntimeError, match="for each head, or"):  # neither a head's width nor all of k's
        built.add_layer(**{**named, "q_norm": torch.ones(64), "k_norm": torch.ones(40)})
    with pytest.raises(RuntimeError, match="float32 vectors"):
        built.add_layer(**{**named, "q_norm": torch.ones(64).double(), "k_norm": torch.ones(64)})
    with pytest.raises(RuntimeError, match="window"):
        built.add_layer(**{**named, "window": -1})
    with pytest.raises(RuntimeError, match="head width"):
        torch.classes.cag.DecodeWeights(heads=4, kv_heads=2, head_dim=48, hidden=64, scale=0.1)
    built.add_layer(**{**named, "window": 4})
    assert len(built) == 2  # nothing refused was added
    if not native.avx2_why_not() and native.load_avx2():  # the AVX2 library's one call: int4 products only
        avx2 = torch.classes.cag_avx2.DecodeWeights(heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                                                    head_dim=64, hidden=cfg.hidden_size, scale=0.125)
        avx2.add_layer(**named)
        bf16 = torch.zeros((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * 64,
                           cfg.hidden_size, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="bf16 weights, which this library's products do not take"):
            avx2.add_layer(**{**named, "qkv": bf16, "qkv_scales": torch.empty(0)})
        assert len(avx2) == 1
