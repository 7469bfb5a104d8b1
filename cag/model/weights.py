"""The format decoding computes its matrix-vector products in (CAG_WEIGHTS): fp32, bf16, int8, int4.

A decode step multiplies one token's activations by every weight once, so its time is the time
to read the weights: fewer bytes per weight is the lever, as long as the kernel runs near memory
speed. Each nn.Linear is replaced by a `FastLinear` that keeps the model's own weight (used by
the transformers forward: prefill of the knowledge) and adds a packed copy used by the batched step
(`decode`: a question's tokens and every decode row, one per request):

  bf16  oneDNN-packed bf16 weight (`mkldnn._linear_pointwise`; AMX / AVX512-BF16 where present)
  int8  per-output-channel symmetric int8 (`aten._weight_int8pack_mm`)
  int4  groups of 32 along the input, asymmetric: w = (q - 8) * scale + zero, q in 0..15
        (`aten._weight_int4pack_mm_for_cpu`); the embedded model's GGUF Q4_1 has this exact shape
  (int8 and int4 keep the LM head in bf16: _head_format)
With cag's own kernels (the AVX-512 or AMX backend: cag.kernels.backends), decode rows multiply int4 and bf16
weights through cag.kernels.native instead, at the speed of reading them: int4 as GGUF Q4_1 holds it (a
float16 step and min per group of 32: w = m + q * d), int4's LM head as GGUF Q8_0 does ("q8"), bf16
as a plain matrix, and a question's rows (int8, int4) through the bf16 product; all return float32.
With its AVX2 products (CAG_DECODE_KERNELS=avx2, CPUs below the AVX512-BF16 floor) int4 and its q8
head take the same layouts, a question's rows the same copy as decode rows (Avx2Packed).

With cag's kernels (native or AVX2) every row of a pass is a decode row (cag.runtime.rows.flat), so a
question's rows take the decode rows' copy and no question copy is made. Otherwise
a question's rows (a question part: cag.runtime.rows.Part.asks) take the decode rows' copy where
the model's weights view their checkpoint file: those stay in the file (pages released once packed)
and a bf16 copy would be the biggest thing in memory. A model held in memory of its own keeps a
bf16 copy for them in int8 and int4 (FEW layout with torch's kernels, calls of <= FEW rows; under
bf16 compute cag's kernels take the model's own weights, stacked): the integer kernels dequantize per
row (their cost grows with the rows, bf16's hardly: bench/bench_decode.py). The role, not the row
count, picks the copy, so a row's bits never depend on what else shares its pass.

Activations enter the packed kernels as bf16 (the kernels' input dtype) and leave as float32, the
lean step's dtype on the CPU whatever the compute dtype (cag.runtime.step; a transformers forward
decoding through them casts back to its own); decode attention reads resident
prefixes and request buffers held in bf16 (LoadedModel.attn_dtype: half the cache bytes a step reads). Prefill
(and so every snapshot) never touches the packed copy: snapshots do not depend on this setting.
Both `cag` and `full` decode through the same modules, so cag == full holds in every format.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
import threading

import torch
import torch.nn.functional as F

from cag.kernels import backends
from cag.kernels.backends import Backend
from cag.model import file_pages, packed_cache, stacked_products

FORMATS = ("fp32", "bf16", "int8", "int4")
NATIVE_MM = {"int4": "int4_mm", "q8": "q8_mm", "bf16": "bf16_mm"}  # cag.kernels.native's product per packed format
GROUP = 32  # int4 group size along the input dimension
# Rows per packed product call. Up to 128 rows, each row's result is bit-identical whatever the
# other rows (the kernels block the rows, never the sum); oneDNN's bf16 kernel for a 1536-wide
# input changes its summation for some larger row counts (measured at 160-256), so a pass with more
# rows (questions admitted together) is multiplied in calls of at most this many.
ROWS = 128
# bf16 holds two oneDNN layouts of each weight. The one for batches of FEW rows multiplies 1-16 rows
# faster than the 1-row layout (bench/bench_decode.py) but re-blocks its sum above 32 rows; the 1-row layout serves calls of more rows (a
# question admitted), row-invariant up to ROWS. Up to 32 rows the two give identical bits, so a row's
# result never depends on which one ran (tests/test_batch.py). A vocabulary-sized output (the LM head:
# one row per request) keeps the FEW layout alone, in calls of at most FEW rows.
FEW, WIDE = 32, 16384
ALIGN = 16  # bytes: the alignment from which a float32 product's bits no longer depend on it (FastLinear.forward)
_mode = threading.local()


@contextlib.contextmanager
def decoding():
    """Within it (a decode step through the transformers forward, for models cag.runtime.step does not
    cover), FastLinear.forward multiplies one-row calls through the packed copy. Everywhere else,
    prefill above all, the model's own weights: a snapshot's key leaves CAG_WEIGHTS out, so a
    last prefill chunk of one token must not take the packed path."""
    before = getattr(_mode, "decoding", False)
    _mode.decoding = True
    try:
        yield
    finally:
        _mode.decoding = before


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


PANEL = 4096  # the most inputs a panel of an int4 matrix holds (pack_int4_native), where it has more than WHOLE
WHOLE = 6144


def panels(in_f: int) -> int:
    """How many panels of in_f / P inputs each cag.kernels.native reads an int4 matrix of in_f inputs in: 1 up
    to WHOLE inputs, else the fewest of at most PANEL inputs, each a multiple of 64 (1 where none is).
    Why: a product reads a row's x (2 bytes an input) once per output, and beside the weights streaming
    through, more than ~12 KiB of it does not stay in L1 (bench/JOURNAL.md, 2026-12-04). A panel's rows
    are read one after another as one stream."""
    if in_f <= WHOLE:
        return 1
    return next((p for p in range(-(-in_f // PANEL), in_f // 64 + 1) if in_f % (64 * p) == 0 and in_f // p <= PANEL), 1)


def pack_int4_native(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_int4's copy for cag.kernels.native's AVX-512 products: where every group's min is -8 times its
    step (a matrix on GGUF Q4_0's grid), dm (out, 1, in/32), the steps alone (18 bytes a group, not 20:
    the kernel takes each min as -8 d, the very value it would have read, so the same bits). A group of
    zeros (a padding token's embedding) is step 0, min 0 there: zeros exactly. A matrix of more than WHOLE
    inputs is stored as P = panels(in) panels of in/P inputs: qw (P, out, in/2P), dm (P, out, S, in/32P),
    the same bytes reordered; where in/P is a multiple of 512 (16 groups) the product's bits are the
    whole rows' (the sums run over the same groups in the same order)."""
    qw, dm, zero = _int4_zeros(w)
    d = torch.where(zero, 0.0, dm[:, 0].float()).half()
    if torch.equal(dm[:, 1], d * -8):
        dm = d[:, None].contiguous()
    return to_panels(qw, dm, panels(w.shape[1]))


def to_panels(qw: torch.Tensor, dm: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """qw (out, in/2), dm (out, S, in/32) as p panels: (p, out, in/2p), (p, out, S, in/32p); as they are for p = 1."""
    if p == 1:
        return qw, dm
    out_f, s = qw.shape[0], dm.shape[1]
    return (qw.reshape(out_f, p, -1).transpose(0, 1).contiguous(),
            dm.reshape(out_f, s, p, -1).permute(2, 0, 1, 3).contiguous())


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


class Packed:
    """Packed copies of one (out, in) weight for a pass's rows: `packed(x, roles)` (..., in) -> (..., out).
    One subclass per kernel path; `pack` picks it. `packed` is the decode rows' copy (a tensor, or a
    tuple for the integer formats), `questions` the copy a question's rows use where it is another one."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, fmt: str, out_dtype: torch.dtype | None = None):
        self.out_features, self.in_features = w.shape
        self.fmt, self.bias = fmt, bias
        # the compute dtype, whatever the input's (the step may hand over bf16 rows) or the weight's own
        # storage (a bf16 checkpoint's weight kept in bf16 under float32 compute: `narrowed`)
        self.out_dtype = out_dtype or w.dtype
        self.packed = self.questions = None
        # a copy "made" in the weight's own dtype and layout is the weight itself (bf16 compute): no bytes of its own
        self._source = w.untyped_storage().data_ptr()

    @property
    def nbytes(self) -> int:
        """Bytes the packed copies add to the model's own weights."""
        return sum(packed_bytes(c) for c in (self.packed, self.questions) if not self._shares(c))

    def holds_source(self) -> bool:
        """Whether a copy is the weight it was made from, as it is (bf16 from bf16)."""
        return any(self._shares(c) for c in (self.packed, self.questions))

    def _shares(self, copy) -> bool:
        # an oneDNN-packed copy (layout torch._mkldnn, bf16 on AVX-512 CPUs without AMX) has no storage to share
        return isinstance(copy, torch.Tensor) and copy.layout == torch.strided and copy.untyped_storage().data_ptr() == self._source

    def __call__(self, x: torch.Tensor, roles: list[tuple[int, bool]] | None = None) -> torch.Tensor:
        """The packed product of a pass's rows (..., in) -> (..., out). `roles`: (rows, question?) runs
        in row order; None: all decode rows (one per request of a batch)."""
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (rows, in)
        if roles is None or len(roles) == 1 or self.questions is None:  # one copy, one kernel for every row
            y = self._rows(x2, roles is not None and roles[0][1])
        else:
            y = torch.cat([self._rows(c, q) for c, (_, q) in zip(x2.split([n for n, _ in roles]), roles)])
        y = y.to(self.out_dtype).reshape(*x.shape[:-1], self.out_features)  # (..., out)
        return y if self.bias is None else y + self.bias

    def _rows(self, x2: torch.Tensor, question: bool) -> torch.Tensor:
        """(rows, in) bf16 -> (rows, out): a question's rows or decode rows, each row's bits its own."""
        raise NotImplementedError


class NativePacked(Packed):
    """cag.kernels.native's products: decode rows in int4 (GGUF Q4_1's layout), q8 (Q8_0's) or bf16,
    any number of rows in one call, float32 out; a question's rows through its bf16 product, over a
    plain bf16 copy (int4) or the format's own product (bf16, q8)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, fmt: str, out_dtype: torch.dtype | None = None,
                 questions: bool = True):
        super().__init__(w, bias, fmt, out_dtype)
        w = w.detach()
        self.packed = (w.to(torch.bfloat16).contiguous() if fmt == "bf16" else
                       packed_cache.packed(f"native-{fmt}", {"int4": pack_int4_native, "q8": pack_q8}[fmt], w))
        self.mm = getattr(torch.ops.cag, NATIVE_MM[fmt])
        # called as the step hands rows over (no bias, float32 out): nothing to convert
        self._direct = bias is None and self.out_dtype == torch.float32 and fmt in ("int4", "q8")
        self.questions = w.to(torch.bfloat16).contiguous() if fmt == "int4" and questions else None

    def __call__(self, x: torch.Tensor, roles: list[tuple[int, bool]] | None = None) -> torch.Tensor:
        if roles is None and self._direct and x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous():
            return self.mm(x, *self.packed)
        return super().__call__(x, roles)

    def _rows(self, x2: torch.Tensor, question: bool) -> torch.Tensor:
        if question and self.questions is not None:
            return torch.ops.cag.bf16_mm(x2.contiguous(), self.questions)
        return self.mm(x2.contiguous(), *(self.packed if isinstance(self.packed, tuple) else (self.packed,)))


class TorchPacked(Packed):
    """torch's packed CPU products: oneDNN bf16, weight-only int8 / int4, in calls of at most ROWS rows
    (FEW in bf16's few-rows layout), row-invariant there. bf16 keeps two layouts (`many`: the 1-row
    layout for calls of more than FEW rows); int8 / int4 multiply a question's rows by a bf16 copy in
    the few-rows layout (`questions`)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, fmt: str, out_dtype: torch.dtype | None = None,
                 questions: bool = True):
        super().__init__(w, bias, fmt, out_dtype)
        w = w.detach()
        self.packed = (_pack_bf16(w, FEW) if fmt == "bf16" else  # oneDNN's layout: no storage to keep
                       packed_cache.packed(f"torch-{fmt}", {"int8": _pack_int8, "int4": _pack_int4}[fmt], w))
        if fmt == "bf16":
            self.many = _pack_bf16(w, 1) if self.out_features < WIDE else None
        else:
            self.many = None
            self.questions = self._question_copy(w) if questions else None

    @property
    def nbytes(self) -> int:
        return super().nbytes + packed_bytes(self.many)

    def _question_copy(self, w: torch.Tensor):
        return _pack_bf16(w, FEW) if bf16_packs() else None

    def _rows(self, x2: torch.Tensor, question: bool) -> torch.Tensor:
        if self.fmt == "bf16":  # both layouts give the same bits up to FEW rows: the count picks
            many = x2.shape[0] > FEW and self.many is not None
            fmt, w, most = ("bf16", self.many, ROWS) if many else ("bf16", self.packed, FEW)
        elif question and self.questions is not None:  # calls of <= FEW rows: row-invariant
            fmt, w, most = "bf16", self.questions, FEW
        else:
            fmt, w, most = self.fmt, self.packed, ROWS
        if x2.shape[0] <= most:
            return _torch_mm(x2, w, fmt)
        return torch.cat([_torch_mm(c, w, fmt) for c in x2.split(most)])


class TorchPackedNativeQuestions(TorchPacked):
    """torch's products for decode rows in a format cag.kernels.native has none for (int8, or int4 whose
    input is not a multiple of 64), a question's rows through the native bf16 product over a plain
    bf16 copy: any number of rows in one call. oneDNN's bf16 sums depend on the row count on some CPUs
    (AMD Zen 4), the native product's never do."""

    def _question_copy(self, w: torch.Tensor):
        return w.to(torch.bfloat16).contiguous()

    def _rows(self, x2: torch.Tensor, question: bool) -> torch.Tensor:
        if question and self.questions is not None:
            return torch.ops.cag.bf16_mm(x2.contiguous(), self.questions)
        return super()._rows(x2, question)


class Avx2Packed(Packed):
    """cag.kernels.native's AVX2 products (CAG_DECODE_KERNELS=avx2): int4 in GGUF Q4_1's layout, q8 in
    Q8_0's (int4's LM head), float32 out. Any number of rows in one call, a row's bits its own, so a
    question's rows take the same copy as decode rows: no second copy."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, fmt: str, out_dtype: torch.dtype | None = None):
        super().__init__(w, bias, fmt, out_dtype)
        self.packed = packed_cache.packed(f"avx2-{fmt}", {"int4": pack_int4, "q8": pack_q8}[fmt], w.detach())
        self.mm = getattr(torch.ops.cag_avx2, NATIVE_MM[fmt])

    def _rows(self, x2: torch.Tensor, question: bool) -> torch.Tensor:
        return self.mm(x2.contiguous(), *self.packed)


def pack(w: torch.Tensor, bias: torch.Tensor | None, fmt: str, backend: Backend = backends.TORCH,
         out_dtype: torch.dtype | None = None, questions: bool = True) -> Packed:
    """The packed copy of an (out, in) weight for `fmt` on `backend`'s products (cag.kernels.backends):
    cag's own (AVX-512, or AVX2: int4 and q8) where the shapes allow (the input a multiple of 32, of 64
    for int4), else torch's. `questions`: int8 / int4 may keep a bf16 copy for a question's rows (else
    they take the decode rows' copy)."""
    if (backend.avx2_products and (fmt == "q8" and w.shape[1] % 32 == 0 or fmt == "int4" and w.shape[1] % 64 == 0)
            and backend.loaded()):
        return Avx2Packed(w, bias, fmt, out_dtype)
    native = backend.cag_products and w.shape[1] % 32 == 0 and backend.loaded()
    if native and (fmt in ("bf16", "q8") or fmt == "int4" and w.shape[1] % 64 == 0):
        return NativePacked(w, bias, fmt, out_dtype, questions)
    if native and fmt in ("int8", "int4"):
        return TorchPackedNativeQuestions(w, bias, fmt, out_dtype, questions)
    return TorchPacked(w, bias, fmt, out_dtype, questions)


def _torch_mm(x2: torch.Tensor, w, fmt: str) -> torch.Tensor:
    if fmt == "bf16":
        return torch.ops.mkldnn._linear_pointwise(x2, w, None, "none", [], "")
    if fmt == "int8":
        return torch.ops.aten._weight_int8pack_mm(x2, *w)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w[0], GROUP, w[1])


class FastLinear(torch.nn.Module):
    """nn.Linear with a packed copy of its weight for decode rows (one per request in a batch).

    Sibling products that read the same input (a layer's q/k/v, its gate/up) share one packed copy of
    their weights stacked (`packs`, this module's output columns `cols` of it): the lean step makes one
    call for the group. Columns come out bit for bit as from separate matrices (the kernels block the
    output columns, never a column's sum: tests/test_batch.py)."""

    def __init__(self, linear: torch.nn.Linear, fmt: str, packs: Packed | None = None, cols: tuple[int, int] | None = None,
                 backend: Backend = backends.TORCH, out_dtype: torch.dtype | None = None, questions: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        self.weight, self.bias = linear.weight, linear.bias  # the model's own (shared if tied)
        self.packs = packs or pack(linear.weight, linear.bias, fmt, backend, out_dtype, questions)
        self.cols = cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(_mode, "decoding", False) and x.numel() == self.in_features:  # one decode row
            return self.decode(x).to(x.dtype)  # the packed products give float32 (apply)
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)  # a narrowed weight: its exact values
        if self.cols is not None and w.dtype == torch.float32 and x.numel() == self.in_features and w.data_ptr() % ALIGN:
            # A group member left in its checkpoint file lies where the file put it (safetensors: 8-byte
            # aligned), where the fp32 format makes it a view of its stack (16-byte aligned or more). A
            # float32 product of one row (a last prefill chunk of one token) sums differently over a weight
            # aligned to less than 16 bytes, so it multiplies a fresh copy: the same snapshot in every
            # format. Products of more rows never depend on it: they multiply the weight in place
            w = w.clone()
        return F.linear(x, w, self.bias)

    def decode(self, x: torch.Tensor, roles: list[tuple[int, bool]] | None = None) -> torch.Tensor:
        """This module's product for a pass's rows (R, in) -> (R, out) (roles: Packed.__call__). In a
        shared group it computes the group's whole product and keeps its columns: only the
        transformers forward (models the lean step does not cover) calls members one by one."""
        y = self.packs(x, roles)
        return y if self.cols is None else y[..., self.cols[0] : self.cols[1]]


def supported(fmt: str, model: torch.nn.Module) -> str | None:
    """None if `fmt` can run for this model here, else why not."""
    if fmt == "fp32":
        return None
    if next(model.parameters()).device.type != "cpu":
        return f"weights format {fmt} is a CPU kernel; on {next(model.parameters()).device.type} use fp32 (CAG_DTYPE sets the dtype)"
    if fmt == "bf16" and not bf16_packs():
        return ("weights format bf16 needs oneDNN's bf16 products, which this CPU lacks (they need AVX-512 or "
                "AVX-NE-CONVERT); use CAG_WEIGHTS=fp32, int8 or int4 (auto picks fp32 here)")
    return None


def packable(lin: torch.nn.Linear, fmt: str) -> bool:
    """int4 packs (out, in) matrices with in % 32 == 0 and out % 16 == 0; others stay as they are."""
    return fmt != "int4" or (lin.in_features % GROUP == 0 and lin.out_features % 16 == 0)


def apply(model: torch.nn.Module, fmt: str, backend: Backend = backends.TORCH, compute: torch.dtype | None = None,
          cache: packed_cache.PackedCache | None = None) -> int:
    """Widen the model to the `compute` dtype (None: its own) but for the layer matrices a packed copy is
    made from, then swap every nn.Linear of `model` for a FastLinear in `fmt` (fp32: none) and stack
    each group left as it is (cag.model.stacked_products); decode rows through `backend`'s products where
    it has them (cag.kernels.backends: cag's AVX-512 or AVX2 ones, else torch's). `cache`: packed copies
    kept on disk, read instead of packed where it holds them (cag.model.packed_cache). Returns the bytes
    the packed copies take.

    The model's own layer matrices then serve the knowledge prefill alone: they stay in their
    checkpoint's dtype (a bf16 checkpoint loaded as bf16, or `narrowed`), which FastLinear.forward
    widens exactly per product, and where they view the checkpoint file their pages leave the resident
    set once packed (cag.model.file_pages): a packed format holds its packed copy, not the originals."""
    compute = compute or next(model.parameters()).dtype
    if fmt == "fp32":
        _widen(model, compute, set(), file_pages.mappings())
        stacked_products.stack(model)
        return 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kernels = backend.own_products
    # the head's format; whether it lies on int4's grid is read only where it decides (int4 on cag's products)
    head_fmt = None if head is None else _head_format(fmt, kernels and head.in_features % GROUP == 0,
                                                      fmt == "int4" and kernels and packable(head, "int4") and on_grid4(head.weight))
    own = lambda m: head_fmt if m is head else fmt  # noqa: E731
    groups = [g for g in stacked_products.groups(model) if all(packable(m, fmt) for m in g[2])]
    grouped = {id(m) for _, _, lins in groups for m in lins}
    singles = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) not in grouped and packable(m, own(m))]
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = {id(emb.weight)} if emb is not None else set()  # the token embedding (and a head tied to it): widened
    keep = {id(m.weight) for _, _, lins in groups for m in lins} | {id(m.weight) for _, m in singles} - tied
    maps = file_pages.mappings()
    _widen(model, compute, keep, maps)
    packs: dict[int, Packed] = {}
    qualified = {id(m): n for n, m in model.named_modules()}
    scope = (lambda m: cache.matrix(qualified[id(m)])) if cache is not None else (lambda m: contextlib.nullcontext())  # noqa: E731
    token = _file_maps.set(maps)  # _by_rows releases a file-backed matrix's pages as it packs it
    try:
        for parent, names, lins in groups:  # one packed copy of each group, made from its members stacked
            for m in lins:
                m.weight.data = narrowed(m.weight.data)
            w = torch.cat([m.weight.detach() for m in lins])  # (sum of outs, in)
            b = None if lins[0].bias is None else torch.cat([m.bias.detach() for m in lins])
            # Members that view their checkpoint file stay there, their pages released: the stack is a passing
            # copy, and a question's rows take the packed copy, not a bf16 one beside it (FastLinear.forward
            # multiplies a float32 view at an odd address as a fresh copy). Members in memory of their own that
            # the prefill multiplies as they are (the compute dtype), or whose question copy is the stack itself
            # (bf16), become views of the stack, their old bytes freed, as in the fp32 format: a product's last
            # bits can depend on where its weight lies, and a snapshot must not depend on the format
            mapped = any(file_pages.file_backed(m.weight, maps) for m in lins)
            # with cag's kernels a question's rows take the decode rows' copy (cag.runtime.rows.flat): no second copy
            with scope(lins[0]):
                group = pack(w, b, fmt, backend, torch.float32, questions=not mapped and not kernels)
            packs[id(group)], lo = group, 0
            file_pages.release((m.weight for m in lins), maps)
            trim_heap()
            views = not mapped and (w.dtype == compute or group.holds_source())
            for n, m in zip(names, lins):
                if views:
                    m.weight.data = w[lo : lo + m.out_features]
                setattr(parent, n, FastLinear(m, fmt, group, (lo, lo + m.out_features)))
                lo += m.out_features
        for name, lin in singles:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            if id(lin.weight) not in tied:
                lin.weight.data = narrowed(lin.weight.data)
            mapped = file_pages.file_backed(lin.weight, maps)
            # an int4 head (on its grid) multiplies a question's rows as its decode rows: a bf16 copy of a
            # vocabulary-sized matrix would cost more memory than the product saves time (one row a question)
            copy = not mapped and not kernels and not (lin is head and own(lin) == "int4")
            with scope(lin):
                fast = FastLinear(lin, own(lin), backend=backend, out_dtype=torch.float32, questions=copy)
            setattr(parent, name.rsplit(".", 1)[-1], fast)
            packs[id(fast.packs)] = fast.packs
            if not fast.packs.holds_source():
                file_pages.release([lin.weight], maps)
            trim_heap()
    finally:
        _file_maps.reset(token)
    stacked_products.stack(model)  # groups not packed (int4's odd shapes): one product each, in the compute dtype
    return sum(p.nbytes for p in packs.values())


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the operating system (glibc's malloc_trim(0)): whether any
    were; False without glibc. Packing frees its working copies (several times a block's packed bytes)
    among the packed copies it keeps, and glibc gives back only a heap's top by itself: the pages in between
    stayed resident, more than the process's own imports at 0.5B (bench/JOURNAL.md, 2026-12-04). `apply`
    trims after each matrix, so they never pile up."""
    fn = _malloc_trim()
    return fn is not None and bool(fn(0))


@functools.cache
def _malloc_trim():
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
        fn = ctypes.CDLL(None).malloc_trim
    except (ValueError, OSError, AttributeError):  # no such name (not glibc), no symbol
        return None
    fn.argtypes, fn.restype = (ctypes.c_size_t,), ctypes.c_int
    return fn


def _widen(model: torch.nn.Module, compute: torch.dtype, keep: set[int], maps: list[file_pages.Mapping]) -> None:
    """Every floating parameter and buffer narrower than the `compute` dtype and not in `keep` (ids)
    widened to it (the same values; a wider one, e.g. rope's float32 frequencies under bf16 compute,
    stays), the pages of a checkpoint-file view (`maps`) it was released as it goes."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point() and t.element_size() < compute.itemsize and id(t) not in keep:
            old = t.data
            t.data = old.to(compute)
            file_pages.release([old], maps)


def narrowed(w: torch.Tensor) -> torch.Tensor:
    """A float32 weight whose every value is a bf16 value (a bf16 checkpoint computed in float32) as
    bf16: the same values in half the memory, which the packed copies are made from and the knowledge
    prefill widens back, exactly, per product (FastLinear.forward); any other weight as it is."""
    if w.dtype != torch.float32 or w.device.type != "cpu" or not torch.equal(w[:1].to(torch.bfloat16).float(), w[:1]):
        return w  # the first row tells most float32 models at no cost (a load narrows every layer matrix)
    b = w.to(torch.bfloat16)
    return b if torch.equal(b.float(), w) else w


def _head_format(fmt: str, native: bool = False, four_bit: bool = False) -> str:
    """The LM head keeps 8 bits or more in the integer formats. It is often the token embedding (tied),
    which a GGUF stores at 6-8 bits while its layers are 4-bit: int4 groups of 32 off that grid move
    most of the embedded model's answers (bench/bench_weights_quality.py measures each format). With
    cag.kernels.native, int4's head is int8 in groups of 32 with a float16 scale ("q8", GGUF Q8_0's
    layout, in which the embedded model ships it: held exactly, half bf16's bytes); elsewhere bf16,
    or int8 per output channel on a CPU without oneDNN's bf16 products. A head that lies on int4's grid
    already (`four_bit`: a GGUF's Q4_0 or Q4_1 token embedding, tied) stays int4 there: held exactly, in
    the bytes the file gave it, where q8 would read 1.7x as many each step."""
    if fmt == "int4" and native:
        return "int4" if four_bit else "q8"
    if fmt in ("int8", "int4"):
        return "bf16" if bf16_packs() else "int8"
    return fmt


def packed_bytes(packed) -> int:
    """Bytes of a packed copy (a tensor, or a tuple of them for int8/int4; None: no copy)."""
    if packed is None:
        return 0
    return sum(t.nbytes for t in (packed if isinstance(packed, tuple) else (packed,)))
