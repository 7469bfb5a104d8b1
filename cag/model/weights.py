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
import ctypes
import functools
import os
import threading
from typing import Any

import torch
import torch.nn.functional as F

from cag.kernels import backends
from cag.kernels.backends import Backend
from cag.model import file_pages, layouts, packed_cache, stacked_products
from cag.model.layouts import GROUP, on_grid4
from cag.model.packed import Packed, pack

FORMATS = ("fp32", "bf16", "int8", "int4")
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


class FastLinear(torch.nn.Module):
    """nn.Linear with a packed copy of its weight for decode rows (one per request in a batch).

    Sibling products that read the same input (a layer's q/k/v, its gate/up) share one packed copy of
    their weights stacked (`packs`, this module's output columns `cols` of it): the lean step makes one
    call for the group. Columns come out bit for bit as from separate matrices (the kernels block the
    output columns, never a column's sum: tests/test_batch.py)."""

    def __init__(
        self,
        linear: torch.nn.Linear,
        fmt: str,
        packs: Packed | None = None,
        cols: tuple[int, int] | None = None,
        backend: Backend = backends.TORCH,
        out_dtype: torch.dtype | None = None,
        questions: bool = True,
    ):
        super().__init__()
        self.in_features, self.out_features, self.fmt = linear.in_features, linear.out_features, fmt
        self.weight, self.bias = linear.weight, linear.bias  # the model's own (shared if tied)
        self.packs = packs or pack(linear.weight, linear.bias, fmt, backend, out_dtype, questions)
        self.cols = cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(_mode, "decoding", False) and x.numel() == self.in_features:  # one decode row
            return self.decode(x).to(x.dtype)  # the packed products give float32 (apply)
        # a narrowed weight: its exact values
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        if (
            self.cols is not None
            and w.dtype == torch.float32
            and x.numel() == self.in_features
            and w.data_ptr() % ALIGN
        ):
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
        return (
            f"weights format {fmt} is a CPU kernel; on {next(model.parameters()).device.type} use fp32 "
            "(CAG_DTYPE sets the dtype)"
        )
    if fmt == "bf16" and not layouts.bf16_packs():
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
    head = _call(model, "get_output_embeddings")
    kernels = backend.own_products
    # the head's format; whether it lies on int4's grid is read only where it decides (int4 on cag's products)
    head_fmt = (
        None
        if head is None
        else _head_format(
            fmt,
            kernels and head.in_features % GROUP == 0,
            fmt == "int4" and kernels and packable(head, "int4") and on_grid4(head.weight),
        )
    )
    own = lambda m: (head_fmt or fmt) if m is head else fmt  # noqa: E731 (head_fmt is None only without a head)
    groups = [g for g in stacked_products.groups(model) if all(packable(m, fmt) for m in g[2])]
    grouped = {id(m) for _, _, lins in groups for m in lins}
    singles = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and id(m) not in grouped and packable(m, own(m))
    ]
    emb = _call(model, "get_input_embeddings")
    tied = {id(emb.weight)} if emb is not None else set()  # the token embedding (and a head tied to it): widened
    keep = {id(m.weight) for _, _, lins in groups for m in lins} | {id(m.weight) for _, m in singles} - tied
    maps = file_pages.mappings()
    _widen(model, compute, keep, maps)
    packs: dict[int, Packed] = {}
    qualified = {id(m): n for n, m in model.named_modules()}
    scope = (lambda m: cache.matrix(qualified[id(m)])) if cache is not None else (lambda m: contextlib.nullcontext())  # noqa: E731
    token = layouts._file_maps.set(maps)  # _by_rows releases a file-backed matrix's pages as it packs it
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
        layouts._file_maps.reset(token)
    stacked_products.stack(model)  # groups not packed (int4's odd shapes): one product each, in the compute dtype
    return sum(p.nbytes for p in packs.values())


def _call(model: torch.nn.Module, name: str) -> Any:
    """model.name() where the model has that method (transformers' get_input_embeddings ...), else None."""
    fn = getattr(model, name, None)
    return fn() if callable(fn) else None


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
        return "bf16" if layouts.bf16_packs() else "int8"
    return fmt
