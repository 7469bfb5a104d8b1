"""The byte layouts of packed weight matrices: how each format lays out an (out, in) matrix for the
kernels that multiply it (cag.model.packed), and the 4-bit grid an int4 group lies on.

  int4 (cag's)   GGUF Q4_1's layout: a float16 step and min per group of 32 inputs, two 4-bit codes a
                 byte (pack_int4); for cag's products (AVX-512 and AVX2) the same codes in blocks of 16
                 outputs, 4 inputs of each output a 32-bit lane, and on a GGUF Q4_0 grid the steps alone
                 (pack_int4_native)
  q8             GGUF Q8_0's: int8 codes and a float16 scale per group of 32 (pack_q8; int4's LM head)
  int8, int4     torch's weight-only layouts (_pack_int8, _pack_int4); bf16: oneDNN's (_pack_bf16)
A vocabulary-sized matrix is packed in blocks of CHUNK rows (_by_rows): every value depends on its own
row alone, so the bytes are those of one pass, without all the float32 working copies at once.
"""

from __future__ import annotations

import contextvars
import functools

import torch

from cag.model import file_pages

GROUP = 32  # int4 group size along the input dimension


def _pack_bf16(w: torch.Tensor, rows: int):
    return torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16).contiguous(), rows)


@functools.cache
def bf16_packs() -> bool:
    """Whether oneDNN packs bf16 weights on this CPU: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT,
    so an AVX2-only CPU has no bf16 format (and int8 / int4 keep their own products for a question's
    rows and an int8 LM head)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        _pack_bf16(torch.zeros(16, 32), 1)
    except RuntimeError:
        return False
    return True


def _pack_int8(w: torch.Tensor):
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (out,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # (out, in)
    return q, scale.to(torch.bfloat16)


def grid4(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's 4-bit affine grid: groups (..., 32) -> lo, step (..., 1), the points lo + q * step,
    q = 0..15. Where a group lies exactly on GGUF Q4_0's grid (d * (q - 8), its value of largest
    magnitude at q = 0: lo = that value = -8 d, step = d, negative where that value is positive), that
    grid, which holds it exactly (lo and step are the file's d times a power of two); else the grid
    from the group's min to its max (as GGUF Q4_1 writes it)."""
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    big = torch.where(hi.abs() > lo.abs(), hi, lo)  # (..., 1)
    d = -big / 8
    q = torch.round((g - big) / torch.where(d == 0, 1.0, d))
    q4_0 = (d != 0) & ((q >= 0) & (q <= 15) & (big + q * d == g)).all(-1, keepdim=True)
    return torch.where(q4_0, big, lo), torch.where(q4_0, d, ((hi - lo) / 15).clamp(min=1e-12))


def on_grid4(w: torch.Tensor, rows: int = 16) -> bool:
    """Whether a matrix (out, in) lies on a 4-bit affine grid per group of 32 (grid4: a GGUF's Q4_1 or
    Q4_0 values), as its first `rows` rows tell: a matrix is stored in one quantization type."""
    if w.dim() != 2 or w.shape[1] % GROUP:
        return False
    with torch.no_grad():
        g = w.detach()[:rows].float().reshape(-1, w.shape[1] // GROUP, GROUP)  # (rows, in/32, 32)
        lo, step = grid4(g)
        return not ((torch.round((g - lo) / step) * step + lo - g).abs() > 1e-3 * step.abs()).any()


CHUNK = 2048  # rows a packing converts to float32 at a time (_by_rows)
# within `apply`: this process's file mappings (cag.model.file_pages), for _by_rows to release a
# file-backed matrix's pages block by block as it packs
_file_maps: contextvars.ContextVar[list | None] = contextvars.ContextVar("cag_pack_file_maps", default=None)


def _by_rows(pack):
    """`pack` over blocks of CHUNK rows, each block's outputs written into the whole matrix's: every value
    depends on its own row alone, so the result is the same, and the float32 working copies of a
    vocabulary-sized matrix (several times its bytes) never all exist at once: they were most of a large
    model's peak memory. Inside `apply`, a matrix viewing its checkpoint file has each block's pages released
    once it is packed (cag.model.file_pages), so the whole matrix is not resident beside its packed copy."""

    @functools.wraps(pack)
    def by_rows(w: torch.Tensor):
        if w.shape[0] <= CHUNK:
            return pack(w)
        maps = _file_maps.get()
        mapped = maps is not None and file_pages.file_backed(w, maps)
        out = None
        for a in range(0, w.shape[0], CHUNK):
            block = w[a : a + CHUNK]
            part = pack(block)
            if out is None:  # every output has a row per row of the matrix
                out = tuple(torch.empty((w.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device) for t in part)
            for o, t in zip(out, part):
                o[a : a + t.shape[0]] = t
            if mapped:
                file_pages.release([block], maps)
        return out

    return by_rows


@_by_rows
def pack_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cag.kernels.native's int4 layout of an (out, in) weight, in % 64 == 0: qw (out, in/2) uint8, byte j of a
    group's 16 holding its input j (low nibble) and j + 16 (high); dm (out, 2, in/32) float16, each
    group's step d and min m (as GGUF Q4_1 stores them), the points m + q * d, q = 0..15."""
    out_f, in_f = w.shape
    g = w.detach().float().reshape(out_f, in_f // GROUP, GROUP)  # (out, in/32, 32)
    lo, step = grid4(g)
    d = torch.where(step.abs() < 2 ** -24, 2 ** -24, step).half()  # (out, in/32, 1); 2^-24: float16's least step
    m = lo.half()  # (out, in/32, 1)
    q = torch.round((g - m.float()) / d.float()).clamp(0, 15).to(torch.uint8)  # (out, in/32, 32)
    qw = (q[..., :16] | (q[..., 16:] << 4)).reshape(out_f, in_f // 2).contiguous()
    return qw, torch.stack([d[..., 0], m[..., 0]], 1).contiguous()


def pack_int4_native(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_int4's codes for cag.kernels.native's products, whose integer dot products (AVX-512's VPDPBUSD, AVX2's
    VPMADDUBSW on each half) take 4 inputs of each of 16 outputs in one vector: qw (N16, in/32, 256) uint8,
    N16 = ceil(out / 16), block b's group g holding 4 runs of 64 bytes, run k's byte 4 o + j = output 16 b + o's
    code of input 4 k + j (low nibble) and 16 + 4 k + j (high), outputs past `out` zero; dm (S, in/32, out)
    float16, the steps (then the mins where S = 2). Where every min is -8 times its step (a matrix on GGUF Q4_0's
    grid) S = 1: the steps alone, 18 bytes a group, the kernel computing d (q - 8), the very value m + q d would
    give. A group of zeros (a padding token's embedding) is step 0, min 0 there: zeros exactly."""
    qw, dm, zero = _int4_zeros(w)
    d = torch.where(zero, 0.0, dm[:, 0].float()).half()
    if torch.equal(dm[:, 1], d * -8):
        dm = d[:, None]
    out_f, groups = qw.shape[0], qw.shape[1] // 16
    n16 = -(-out_f // 16)
    codes = torch.zeros(n16 * 16, groups, 16, dtype=torch.uint8)  # (out, in/32, 16): byte j = inputs j, j + 16
    codes[:out_f] = qw.view(out_f, groups, 16)
    lo, hi = codes & 15, codes >> 4  # (out16, in/32, 16): inputs 0-15 and 16-31
    # (N16, 16 outputs, in/32, 4 runs, 4 inputs) -> (N16, in/32, 4 runs, 16 outputs, 4 inputs)
    lo = lo.view(n16, 16, groups, 4, 4).permute(0, 2, 3, 1, 4)
    hi = hi.view(n16, 16, groups, 4, 4).permute(0, 2, 3, 1, 4)
    return (lo | (hi << 4)).reshape(n16, groups, 256).contiguous(), dm.permute(1, 2, 0).contiguous()


@_by_rows
def _int4_zeros(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_int4's copy and where a group is all zeros (out, in/32), one block of rows read once for both."""
    return (*pack_int4.__wrapped__(w), (w.detach().reshape(w.shape[0], -1, GROUP) == 0).all(-1))


@_by_rows
def pack_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cag.kernels.native's int8 layout (GGUF Q8_0's) of an (out, in) weight, in % 32 == 0: qw (out, in) int8,
    d (out, in/32) float16, w = d * q per group of 32, q in -127..127."""
    out_f, in_f = w.shape
    g = w.detach().float().reshape(out_f, in_f // GROUP, GROUP)
    d = (g.abs().amax(-1, keepdim=True) / 127).clamp(min=2 ** -24).half()  # (out, in/32, 1)
    q = torch.round(g / d.float()).clamp(-127, 127).to(torch.int8).reshape(out_f, in_f).contiguous()
    return q, d[..., 0].contiguous()


def _pack_int4(w: torch.Tensor):
    w = w.float()
    out_f, in_f = w.shape
    g = w.reshape(out_f, in_f // GROUP, GROUP)  # (out, in/32, 32)
    lo, scale = grid4(g)  # (out, in/32, 1) each
    q = torch.round((g - lo) / scale).clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
    lo, scale = lo[..., 0], scale[..., 0]  # (out, in/32)
    zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # (in/32, out, 2)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros
