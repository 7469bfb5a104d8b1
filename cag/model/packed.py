"""A packed copy of one weight matrix and its product for a pass's rows, one class per kernel path:
cag's AVX-512 products (NativePacked), its AVX2 ones (Avx2Packed), torch's (TorchPacked, and with a
question's rows through cag's bf16 product: TorchPackedNativeQuestions). `pack` picks the class from the
backend (cag.kernels.backends) and the shapes; the byte layouts are cag.model.layouts', and a layout
already made on an earlier load is read from cag.model.packed_cache.
"""

from __future__ import annotations

from typing import Any

import torch

from cag.kernels import backends
from cag.kernels.backends import Backend
from cag.model import layouts, packed_cache
from cag.model.layouts import GROUP, _pack_bf16, _pack_int4, _pack_int8, pack_int4_native, pack_q8

NATIVE_MM = {"int4": "int4_mm", "q8": "q8_mm", "bf16": "bf16_mm"}  # cag.kernels.native's product per packed format
# Rows per packed product call. Up to 128 rows, each row's result is bit-identical whatever the
# other rows (the kernels block the rows, never the sum); oneDNN's bf16 kernel for a 1536-wide
# input changes its summation for some larger row counts (measured at 160-256), so a pass with more
# rows (questions admitted together) is multiplied in calls of at most this many.
ROWS = 128
# bf16 holds two oneDNN layouts of each weight. The one for batches of FEW rows multiplies 1-16 rows
# faster than the 1-row layout (bench/bench_decode.py) but re-blocks its sum above 32 rows; the 1-row
# layout serves calls of more rows (a question admitted), row-invariant up to ROWS. Up to 32 rows the two
# give identical bits, so a row's result never depends on which one ran (tests/test_batch.py). A
# vocabulary-sized output (the LM head: one row per request) keeps the FEW layout alone, in calls of at
# most FEW rows.
FEW, WIDE = 32, 16384


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
        self.packed: Any = None  # a tensor, a tuple of them, or oneDNN's opaque layout
        self.questions: Any = None
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
        return (
            isinstance(copy, torch.Tensor)
            and copy.layout == torch.strided
            and copy.untyped_storage().data_ptr() == self._source
        )

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
    """cag.kernels.native's products: decode rows in int4 (GGUF Q4_1's or Q4_0's codes in blocks of 16 outputs, times
    8-bit activations), q8 (Q8_0's) or bf16,
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
        return _pack_bf16(w, FEW) if layouts.bf16_packs() else None

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
    """cag.kernels.native's AVX2 products (CAG_DECODE_KERNELS=avx2): int4 in the AVX-512 products' layout (times 8-bit
    activations), q8 in Q8_0's (int4's LM head), float32 out. Any number of rows in one call, a row's bits its own, so a
    question's rows take the same copy as decode rows: no second copy."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, fmt: str, out_dtype: torch.dtype | None = None):
        super().__init__(w, bias, fmt, out_dtype)
        self.packed = packed_cache.packed(f"avx2-{fmt}", {"int4": pack_int4_native, "q8": pack_q8}[fmt], w.detach())
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


def packed_bytes(packed) -> int:
    """Bytes of a packed copy (a tensor, or a tuple of them for int8/int4; None: no copy)."""
    if packed is None:
        return 0
    return sum(t.nbytes for t in (packed if isinstance(packed, tuple) else (packed,)))
