"""cag.kernels.native's AVX-512 attention over an int8 prefix (CAG_KV_DTYPE=int8: the snapshot's codes, laid
out once by pair_kv8): the attention it computes against the dequantized prefix, rows that never depend
on the batch or the thread count, and its bad inputs. cag == full over int8 snapshots through the
kernels is in tests/test_native.py (heads of 64) and tests/test_families.py (heads of 80)."""

from __future__ import annotations

import pytest
import torch

from cag.kernels import backends, native
from cag.store import kv_int8
from tests.test_native import case, library  # noqa: F401 (the fixture, used by every test here)

pytestmark = pytest.mark.usefixtures("library")


def op(*args, **kw):
    return backends.AVX512.attention_kernel(*args, **kw)


def int8_case(B, R, n, lens, D=64, seed=0):
    """case() with its prefix quantized as an int8 snapshot stores it: the codes paired for the kernel,
    and the dequantized prefix (what the codes mean) in bf16 for kp, vp, which the kernel reads for shapes."""
    q, kp, vp, ks, vs, slots, lens = case(B, R, n, lens, D, seed=seed)
    codes = [kv_int8.quantize(t.float()[None], kv_int8.block_for(D)) for t in (kp, vp)]  # one block a head of 80
    kq, kscale, vq, vscale = (x[0].contiguous() for pair in codes for x in pair)
    kt, vt = torch.ops.cag.pair_kv8(kq, kscale, vq, vscale)
    kd, vd = (kv_int8.dequantize(c, s, torch.float32)[0] for c, s in codes)  # (H, n, D) what the codes mean
    return (q, kd.bfloat16(), vd.bfloat16(), ks, vs, slots, lens, kt, vt), kd, vd


def q8(q: torch.Tensor) -> torch.Tensor:
    """q as the kernel multiplies it with the prefix's codes: int8 codes per block of 32 (a head of 80: 32, 32
    and 16), step max|q| / 127."""
    blocks = []
    for x in q.double().split(32, -1):
        step = x.abs().amax(-1, keepdim=True) / 127
        blocks.append(torch.where(step > 0, (x / step).round(), 0) * step)
    return torch.cat(blocks, -1)


def reference(q, kd, vd, ks, vs, slots, lens, scale, softcap=None):
    """float64 attention of each request over the dequantized prefix (q as q8 gives it) ++ its own
    suffix keys (q rounded to bf16, as the bf16 kernel reads them); `softcap`: scores capped (Gemma 2)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        sp = q8(q[b]) @ kd.double().transpose(-1, -2)
        ss = q[b].bfloat16().double() @ ks[slots[b], :, : lens[b]].double().transpose(-1, -2)
        V = torch.cat([vd.double(), vs[slots[b], :, : lens[b]].double()], 1)
        s = torch.cat([sp, ss], -1) * scale
        out[b] = torch.softmax(s if softcap is None else torch.tanh(s / softcap) * softcap, -1) @ V
    return out


@pytest.mark.parametrize(("B", "R", "n", "lens", "D"), [
    (1, 3, 4096, [1], 64),           # SmolLM2's shapes: a 4K prefix, the first answer token
    (3, 3, 1000, [5, 300, 17], 64),   # a prefix ending mid-chunk; a suffix over one chunk
    (2, 5, 257, [1, 2], 128),         # heads of 128; a prefix one key past a chunk
    (1, 3, 9, [2], 64),               # fewer keys than a block of 16
    (6, 3, 300, [7] * 6, 64),         # 18 rows on one prefix: more than one block of 16 rows
    (2, 2, 0, [3, 40], 64),           # no prefix
    (2, 4, 300, [3, 20], 96),         # heads of 96 (Phi-3)
    (1, 2, 270, [9], 256),            # heads of 256
    (1, 3, 4096, [1], 80),            # heads of 80 (Phi-2): one block a head, three query blocks (32, 32, 16)
    (3, 3, 1000, [5, 300, 17], 80),
    (6, 3, 300, [7] * 6, 80),
    (1, 3, 9, [2], 80),
])
def test_int8_prefix_computes_attention(B, R, n, lens, D):
    args, kd, vd = int8_case(B, R, n, lens, D)
    got = op(*args[:7], D ** -0.5, *args[7:])
    assert got.shape == args[0].shape and got.dtype == torch.float32
    want = reference(args[0], kd, vd, *args[3:7], D ** -0.5)
    err = (got.double() - want).abs().max()
    assert err < 1e-2  # the probabilities rounded to bf16
    if n:  # the codes are read, not the bf16 K/V beside them: zeroing those changes nothing
        zeros = (torch.zeros_like(args[1]), torch.zeros_like(args[2]))
        assert torch.equal(op(args[0], *zeros, *args[3:7], D ** -0.5, *args[7:]), got)


@pytest.mark.parametrize("D", [64, 256])
def test_int8_prefix_takes_soft_capped_scores(D):
    """Gemma 2's soft cap over an int8 snapshot's codes: the float64 formula's result, a row's bits its own."""
    (q, kp, vp, ks, vs, slots, lens, kt, vt), kd, vd = int8_case(3, 3, 700, [1, 9, 260], D)
    q = q * 4  # scores of several units: a cap of 5 bends them
    got = op(q, kp, vp, ks, vs, slots, lens, D ** -0.5, kt, vt, softcap=5.0)
    want = reference(q, kd, vd, ks, vs, slots, lens, D ** -0.5, softcap=5.0)
    assert (got.double() - want).abs().max() < 2e-2
    assert (op(q, kp, vp, ks, vs, slots, lens, D ** -0.5, kt, vt).double() - want).abs().max() > 0.1
    for b in range(3):
        alone = op(q[b : b + 1].contiguous(), kp, vp, ks, vs, slots[b : b + 1], lens[b : b + 1], D ** -0.5, kt, vt,
                   softcap=5.0)
        assert torch.equal(alone, got[b : b + 1])


@pytest.mark.parametrize("D", [64, 80])
def test_int8_rows_never_depend_on_the_batch_or_the_threads(D):
    (q, kp, vp, ks, vs, slots, lens, kt, vt), _, _ = int8_case(5, 3, 700, [1, 9, 260, 4, 33], D)
    together = op(q, kp, vp, ks, vs, slots, lens, 0.125, kt, vt)
    for b in range(5):
        alone = op(q[b : b + 1].contiguous(), kp, vp, ks, vs, slots[b : b + 1], lens[b : b + 1], 0.125, kt, vt)
        assert torch.equal(alone, together[b : b + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(op(q, kp, vp, ks, vs, slots, lens, 0.125, kt, vt), together)
    finally:
        torch.set_num_threads(threads)


def test_pair_kv8_layout():
    """Per chunk of 256 keys: K's codes + 128 in dwords of 4 dims per key, then its fp16 scales per block;
    V's codes as stored, then its scales; zeros past the prefix."""
    (_, _, _, _, _, _, _, kt, vt), _, _ = int8_case(1, 3, 300, [1])
    kq, kscale = kv_int8.quantize(case(1, 3, 300, [1])[1].float()[None], 32)
    assert kt.dtype == torch.uint8 and kt.shape == (2, 2, 64 * 256 + 2 * 256 * 2) == vt.shape
    item = kt[1, 1]  # head 1, keys 256..299
    t, d = 7, 13  # key 263, dim 13: dword 3 of the key, byte 1
    assert item[(d // 4 * 256 + t) * 4 + d % 4].item() == kq[0, 1, 256 + t, d].item() + 128
    scales = item[64 * 256 :].view(torch.float16).view(2, 256)
    assert scales[1, t] == kscale[0, 1, 256 + t, 1] and (scales[:, 44:] == 0).all()
    assert (item[: 64 * 256].view(16, 256, 4)[:, 44:] == 0).all()


def test_int8_bad_inputs_are_refused():
    (q, kp, vp, ks, vs, slots, lens, kt, vt), _, _ = int8_case(1, 3, 300, [4])
    kq, kscale = kv_int8.quantize(kp.float()[None], 32)
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.cag.pair_kv8(kq[0].float(), kscale[0], kq[0], kscale[0])
    with pytest.raises(RuntimeError, match="blocks of 32"):
        torch.ops.cag.pair_kv8(kq[0], kscale[0][..., :1].contiguous(), kq[0], kscale[0])
    with pytest.raises(RuntimeError, match="pair_kv8"):
        op(q, kp[:, :200], vp[:, :200], ks, vs, slots, lens, 0.125, kt, vt)  # codes of another length


def test_heads_of_80_are_read_as_one_block_a_head():
    """An int8 snapshot keeps a head of 80 as one block (kv_int8.block_for): pair_kv8 lays out its 80 codes and
    one scale per key; codes laid out as for blocks of 32, or scales in blocks of another width, are refused."""
    (q, kp, vp, ks, vs, slots, lens, kt, vt), _, _ = int8_case(1, 3, 300, [4], 80)
    kq, kscale = kv_int8.quantize(case(1, 3, 300, [4], 80)[1].float()[None], 80)
    assert kt.dtype == torch.uint8 and kt.shape == (2, 2, 80 * 256 + 256 * 2) == vt.shape
    item = kt[1, 1]  # head 1, keys 256..299
    t, d = 7, 77  # key 263, dim 77: dword 19 of the key, byte 1
    assert item[(d // 4 * 256 + t) * 4 + d % 4].item() == kq[0, 1, 256 + t, d].item() + 128
    scales = item[80 * 256 :].view(torch.float16)
    assert scales[t] == kscale[0, 1, 256 + t, 0] and (scales[44:] == 0).all()
    fake = torch.zeros(2, 2, 80 * 256 + 2 * 256 * 2, dtype=torch.uint8)  # codes laid out as for blocks of 32
    with pytest.raises(RuntimeError, match="pair_kv8"):
        op(q, kp, vp, ks, vs, slots, lens, 0.125, fake, fake)
    k16, s16 = kv_int8.quantize(kp.float()[None], 16)  # blocks of 16: not what a snapshot stores
    with pytest.raises(RuntimeError, match="one a head of 80"):
        torch.ops.cag.pair_kv8(k16[0], s16[0], k16[0], s16[0])
    with pytest.raises(RuntimeError, match="int8 K/V: head dim 64, 80, 96, 128 or 256"):
        torch.ops.cag.pair_kv8(
            k16[0][..., :48].contiguous(),
            s16[0][..., :3].contiguous(),
            k16[0][..., :48].contiguous(),
            s16[0][..., :3].contiguous(),
        )
    assert native.INT8_HEAD_DIMS == native.HEAD_DIMS and 80 in native.INT8_HEAD_DIMS
