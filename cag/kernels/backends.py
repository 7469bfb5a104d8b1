"""What a model's decode rows run on: one `Backend` per kind (AVX-512, AMX, AVX2, torch's CPU kernels,
CUDA), resolved once when the model loads (cag.model.loading.resolve_backend, from CAG_DECODE_KERNELS)
and handed to packing (cag.model.weights), the step (cag.runtime.step) and attention (cag.runtime.attention).

A backend names its packed products (whose layout `packed.pack` makes), its decode attention and the op
namespace of its step glue (norms, rope, silu), whether it runs all layers in one call, and what its
attention reads (a pre-paired prefix, int8 snapshot codes), and the C++ sources of its library (`sources`:
cag/kernels/arch/<instruction set>/, built by cag.kernels.native). AMX is the AVX-512 library's backend with
its attention on AMX tiles (arch/amx/ is compiled into that library): the two name the same sources. Nothing
else compares kernel names: a new instruction set is a new Backend here, its folder under cag/kernels/arch/
and its library in cag.kernels.native. `cag info` prints its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cag.kernels import native

ATTR = "cag_backend"  # on a loaded model: its Backend (cag.model.loading sets it, `of` reads it)


@dataclass(frozen=True)
class Backend:
    name: str  # as `cag info`, /health and answers report it
    # whose packed products decode rows multiply by: "avx512" (cag's library), "avx2" (its AVX2 one), None: torch's
    products: str | None
    library: str | None  # torch.ops namespace of its attention and step glue: "cag", "cag_avx2"; None: torch's ops
    attention_op: str | None  # its decode attention op in that namespace
    all_layers: bool = False  # every decoder layer in one native call (cag.runtime.all_layers)
    paired: bool = False  # the attention takes a prefix's K/V pre-paired (attention.pair_kv)
    int8_codes: bool = False  # the attention reads an int8 snapshot's codes as stored (store/kv_int8.py)
    floor: tuple[str, ...] = ()  # CPU flags its library needs (cag.kernels.native)
    sources: tuple[Path, ...] = ()  # the .cpp files its library compiles (cag/kernels/arch/...); none: torch's kernels

    @property
    def cag_products(self) -> bool:
        """Decode rows through cag's AVX-512 products (its int4 on 8-bit activations, q8 head, bf16)."""
        return self.products == "avx512"

    def arithmetic(self, weights: str) -> str:
        """What its products multiply in a weights format: "int4-q8" where cag's products (AVX-512: VPDPBUSD; AVX2:
        VPMADDUBSW) meet int4 weights with 8-bit activations; every other format and backend multiplies the
        activations as the step holds them. Part of the prefill method of knowledge prefilled as decode rows:
        another arithmetic, other bits."""
        return f"{weights}-q8" if self.own_products and weights == "int4" else weights

    @property
    def avx2_products(self) -> bool:
        return self.products == "avx2"

    @property
    def own_products(self) -> bool:
        """Decode rows through one of cag's libraries: every row of a pass is then a decode row (rows.flat)."""
        return self.products is not None

    def loaded(self) -> bool:
        """Whether its library is built and loaded in this process (torch's and CUDA's always are)."""
        if self.library is None:
            return True
        return native.load_avx2() if self.library == "cag_avx2" else native.load() is not None

    def for_heads(self, head_dim: int) -> Backend:
        """The backend a step over heads of `head_dim` runs on: AMX's attention sums values 64 dims at a
        time, so heads of 80 and 96 take the AVX-512 one (and its glue)."""
        return AVX512 if self is AMX and head_dim % 64 else self

    def attention(self, head_dim: int) -> Callable | None:
        """Its decode attention op over bf16 K/V with heads of `head_dim`, or None (torch's, CUDA's, or
        heads it does not take: native.HEAD_DIMS)."""
        if self.attention_op is None or head_dim not in native.HEAD_DIMS or not self.loaded():
            return None
        return self.attention_kernel

    @property
    def attention_kernel(self) -> Callable:
        """The attention op itself (its library loaded), whatever the heads: for kernel tests and benchmarks."""
        if self.attention_op is None:
            raise ValueError(f"the {self.name} backend has no attention of its own")
        return getattr(self.ops(), self.attention_op)

    def ops(self) -> Any:
        """The op namespace of its step glue (rms_bf16, rms_f32, rope_write, silu_mul_bf16); None: torch's."""
        return getattr(torch.ops, self.library) if self.library is not None else None


AVX512 = Backend("avx512", "avx512", "cag", "decode_attention_avx512", all_layers=True, paired=True, int8_codes=True,
                 floor=native.FLAGS, sources=native.SOURCES)
AMX = Backend("amx", "avx512", "cag", "decode_attention", floor=native.FLAGS + native.TILES, sources=native.SOURCES)
AVX2 = Backend("avx2", "avx2", "cag_avx2", "decode_attention", all_layers=True, floor=native.AVX2_FLAGS,
               sources=native.AVX2_SOURCES)
TORCH = Backend("torch", None, None, None)
CUDA = Backend("cuda", None, None, None)  # torch's kernels on the GPU: the step's few-kernel cascade and graphs
BY_NAME = {b.name: b for b in (AVX512, AMX, AVX2, TORCH, CUDA)}


def of(model) -> Backend:
    """The backend a loaded model decodes on (TORCH for a model cag did not load)."""
    return getattr(model, ATTR, TORCH)


def attach(model, backend: Backend) -> None:
    object.__setattr__(model, ATTR, backend)  # not a submodule or parameter: a plain attribute
