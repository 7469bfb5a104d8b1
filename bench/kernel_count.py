"""Kernels a piece of torch code launches, counted on any device: the aten ops that write memory (a new
tensor, or an in-place write); views, and casts to the dtype a tensor already has, write none.

On CUDA each such op is at least one kernel, and a decode step of small ones costs its launches more
than its work (cag.runtime.step: the few-kernel path). The count here runs on the CPU too, so the
tests pin it without a GPU; bench/gpu_check.py counts the CUDA kernels themselves with torch's profiler.

  python -m bench.kernel_count   # SmolLM2's shape, random weights: one decode step's ops, both paths
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _ptr(t: torch.Tensor):
    """Where t's storage starts; an opaque tensor (oneDNN's packed weights on the CPU) by its identity."""
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:
        return id(t)


class Writes(TorchDispatchMode):
    """Counts the ops that write memory while it is entered: `n`, and `ops` by op name."""

    def __init__(self):
        super().__init__()
        self.n, self.ops = 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        write = any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)
        new = any(isinstance(t, torch.Tensor) and _ptr(t) not in ins for t in tree_leaves(out))
        if write or new:
            self.n += 1
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return out


def _one_step(model, prefix, rows: int, few: bool, seen: int):
    """A function running one decode step of `rows` rows over `prefix` (cag.runtime.slots.PrefixKV), the
    lean step's few-kernel path or the op-for-op one, run once already (the position table made)."""
    from cag.runtime import step as lean
    from cag.runtime.rows import Part
    from cag.runtime.slots import Slots

    s = lean.LeanStep(model, few=few)
    cfg = getattr(model.config, "text_config", model.config)
    buffers = Slots(cfg.num_hidden_layers, s.n_kv, s.head_dim, seen, rows + 1, prefix.kv[0][0].dtype, s.device)

    def step():
        part = Part(
            torch.zeros(rows, 1, dtype=torch.long),
            [prefix] * rows,
            torch.arange(rows),
            torch.full((rows,), 5),
            seen=seen,
        )
        with torch.inference_mode():
            return s.run([part], buffers)

    step()
    return step


def step_writes(model, prefix, rows: int, few: bool, seen: int = 512) -> Writes:
    """The ops writing memory in one decode step (_one_step)."""
    step = _one_step(model, prefix, rows, few, seen)
    counted = Writes()
    with counted:
        step()
    return counted


def step_kernels(model, prefix, rows: int, few: bool, seen: int = 512) -> int:
    """The CUDA kernels (and device copies and fills) one decode step (_one_step) launches, as torch's profiler sees
    them."""
    from torch.profiler import ProfilerActivity, profile

    step = _one_step(model, prefix, rows, few, seen)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from cag.model import stacked_products
    from cag.runtime.slots import PrefixKV

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval().to(torch.bfloat16)
    stacked_products.stack(model)
    prefix = PrefixKV.of(
        [(torch.randn(1, 3, 700, 64), torch.randn(1, 3, 700, 64)) for _ in range(30)], torch.bfloat16, "cpu"
    )
    print("| rows | op-for-op | few kernels |\n|---|---|---|")
    for rows in (1, 16):
        print(f"| {rows} | {step_writes(model, prefix, rows, False).n} | {step_writes(model, prefix, rows, True).n} |")


if __name__ == "__main__":
    main()
