"""Products that read the same input (a layer's q/k/v, its gate/up), multiplied in one call.

Their weights are stacked into one matrix per group: in fp32 the model's own parameters become views
of it (`stack`: same values, same memory), in the packed formats one packed copy serves the group
(cag.model.weights.FastLinear.packs, each member its columns of it). One product of the stacked matrix gives
every column bit for bit what the member's own matrix gives (oneDNN and MKL block the output
columns, never a column's sum; tests/test_weights.py): answers do not change, a step makes 2 calls
a layer where it made 5.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
STACK = "_cag_stack"  # on a group's first Linear: (weight (sum of outs, in), bias or None) its members view


def groups(model: torch.nn.Module) -> list[tuple[torch.nn.Module, tuple[str, ...], list[torch.nn.Linear]]]:
    """(parent, member names, members) of every group of plain Linears that can be stacked: one input
    width, dtype and device, biases on all or none."""
    out: list[tuple[torch.nn.Module, tuple[str, ...], list[torch.nn.Linear]]] = []
    for parent in model.modules():
        for names in GROUPS:
            lins = [m for m in (getattr(parent, n, None) for n in names) if type(m) is torch.nn.Linear]
            if len(lins) == len(names) and len(
                    {(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in lins}) == 1:
                out.append((parent, names, lins))
    return out


def stack(model: torch.nn.Module) -> None:
    """Each group's own weights (and biases) copied into one tensor, the members' parameters made
    views of it: the same values in the same memory (prefill and snapshots do not change), and the
    lean step multiplies the group in one call (`stacked`)."""
    for _, _, lins in groups(model):
        w = torch.cat([m.weight.detach() for m in lins])  # (sum of outs, in)
        b = None if lins[0].bias is None else torch.cat([m.bias.detach() for m in lins])
        lo = 0
        for m in lins:
            m.weight.data = w[lo : lo + m.out_features]
            if b is not None:
                m.bias.data = b[lo : lo + m.out_features]
            lo += m.out_features
        object.__setattr__(lins[0], STACK, (w, b))  # a plain attribute: not a parameter, not in state_dict


def restack(lins: list[torch.nn.Linear], w: torch.Tensor) -> None:
    """The group `lins` (stacked by `stack`) made views of `w` (sum of outs, in) instead: the same values
    held another way (cag.model.weights.narrowed)."""
    lo = 0
    for m in lins:
        m.weight.data = w[lo : lo + m.out_features]
        lo += m.out_features
    object.__setattr__(lins[0], STACK, (w, getattr(lins[0], STACK)[1]))


def stacked(*mods) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) the plain Linears `mods` are views of, in this order, or None (not stacked, or
    their parameters were replaced since, e.g. by .to())."""
    st = getattr(mods[0], STACK, None)
    if st is None or not all(type(m) is torch.nn.Linear for m in mods):
        return None
    w, b = st
    lo = 0
    for m in mods:
        if m.weight.data_ptr() != w[lo:].data_ptr() or m.weight.shape != w[lo : lo + m.out_features].shape:
            return None
        if (m.bias is None) != (b is None) or (b is not None and m.bias.data_ptr() != b[lo:].data_ptr()):
            return None
        lo += m.out_features
    return (w, b) if lo == w.shape[0] else None


def group_of(*mods):
    """The packed copy (packed.Packed) `mods` share, in this order, covering all of it; else None."""
    packs = getattr(mods[0], "packs", None)
    cols = [getattr(m, "cols", None) for m in mods]
    if packs is None or any(getattr(m, "packs", None) is not packs for m in mods) or None in cols:
        return None
    ok = cols[0][0] == 0 and cols[-1][1] == packs.out_features and all(a[1] == b[0] for a, b in zip(cols, cols[1:]))
    return packs if ok else None


def product(lin):
    """(x, roles) -> `lin`'s product: FastLinear.decode (packed weights, any number of rows; roles:
    packed.Packed) where the module has one, else its forward (roles do not apply)."""
    return lin.decode if hasattr(lin, "decode") else (lambda x, roles=None, f=lin.forward: f(x))


def together(*mods):
    """(x, roles) -> the products of `mods` (which read the same input; roles: packed.Packed): one call
    where their packed weights or own weights are stacked (GROUPS), else one call each."""
    sizes = [m.out_features for m in mods]
    packs = group_of(*mods)
    if packs is not None:
        return lambda x, roles=None: packs(x, roles).split(sizes, -1)
    st = stacked(*mods)
    if st is not None:
        w, b = st
        return lambda x, roles=None: F.linear(x, w, b).split(sizes, -1)
    fns = [product(m) for m in mods]
    return lambda x, roles=None: tuple(fn(x, roles) for fn in fns)


def group_products(mods: tuple, widths: tuple[int, ...]) -> Callable:
    """(x, roles) -> the products of a group (q/k/v, gate/up), one tensor per member's columns: stacked
    members (`together`), or the family's one fused Linear split into them (Phi-3)."""
    if len(mods) > 1:
        return together(*mods)
    f = product(mods[0])
    return lambda x, roles=None: f(x, roles).split(widths, -1)


def group_one(mods: tuple) -> Callable | None:
    """x -> the one product of a q/k/v group of plain Linears stacked in one tensor (`stacked`),
    or a family's fused Linear, else None."""
    if len(mods) == 1:
        return mods[0].forward if type(mods[0]) is torch.nn.Linear else None
    st = stacked(*mods)
    return None if st is None else (lambda x, w=st[0], b=st[1]: torch.nn.functional.linear(x, w, b))


def own(lin):
    """A module's own packed copy (not its share of a stacked group's), else None."""
    return lin.packs if getattr(lin, "cols", 0) is None else None


def group_shared(mods: tuple):
    """The packed copy a group's product reads: the members' shared one, or a fused Linear's own."""
    return group_of(*mods) if len(mods) > 1 else own(mods[0])
