"""The rows of one pass of the lean step (cag.runtime.step): parts (a decode batch, a question), where each
row's K/V goes, what its attention reads, and which weight copy multiplies it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Part:
    """B requests with m new tokens each: toks (B, m), their prefixes, slots (B,) and suffix starts (B,).

    The tensors are the scheduler's, on the CPU; a captured step (cag.runtime.cuda_graphs) passes its static
    device tensors instead, with `seen` given (at least the most suffix keys a row of the part sees:
    the slot's room), so no value is read back from the device."""

    toks: torch.Tensor
    prefixes: list
    slots: torch.Tensor
    starts: torch.Tensor
    seen: int | None = None
    # a question's rows (its whole suffix, or what a kept conversation leaves to prefill: one token, maybe)
    # take the question's products and attention; None: a part of more than one token per request is one
    question: bool | None = None

    @property
    def asks(self) -> bool:
        return self.question if self.question is not None else self.toks.shape[1] > 1


class Rows:
    """What a part's attention needs, computed once per forward: rows [r0, r1) of the pass."""

    def __init__(self, part: Part, s, r0: int, room: int):  # s: cag.runtime.step.LeanStep
        dev, rep = s.device, s.rep
        cpu = dev.type == "cpu"
        self.B, self.m = part.toks.shape
        self.question = part.asks  # the role picks kernels and weight copies, never the row count
        self.M = self.m * rep  # query rows per request and K/V head: token t, head r -> row t*rep + r
        self.r0, self.r1 = r0, r0 + self.B * self.m
        seen = part.seen if part.seen is not None else int(part.starts.max()) + self.m
        suf = part.starts.to(dev)[:, None] + torch.arange(self.m, device=dev)  # (B, m) suffix positions
        self.L = suffix_keys(seen, room)  # suffix keys the part's attention reads (the rest masked)
        same = all(p is part.prefixes[0] for p in part.prefixes)
        n = part.prefixes[0].n if same else torch.tensor([p.n for p in part.prefixes], device=dev)[:, None]  # (B, 1)
        self.pos = (suf + n).reshape(-1)  # (B*m,) absolute positions
        self.top = max(p.n for p in part.prefixes) + seen  # every position of the part is below this
        # (B, 1, M, L)
        self.hidden = (torch.arange(self.L, device=dev) > suf.repeat_interleave(rep, 1)[:, :, None])[:, None]
        # float32 additive mask for torch's CPU flash kernel (cag.runtime.attention); the other way reads `hidden`
        self.bias = torch.zeros(self.hidden.shape, device=dev).masked_fill_(self.hidden, float("-inf")) if cpu else None
        self.slots = part.slots.to(dev)
        self.rows_slot, self.rows_pos = self.slots.repeat_interleave(self.m), suf.reshape(-1)
        # a single request reads its slot as a view; from a device tensor (a captured step) it is gathered
        self.one = int(part.slots[0]) if self.B == 1 and part.slots.device.type == "cpu" else None
        if cpu:  # what cag.kernels.native's kernel reads on the host
            self.slots_cpu = part.slots.to(torch.int64)
            self.lens = (part.starts + self.m).to(torch.int64)  # (B,) suffix keys each request sees (its own, causal)
        self.groups = groups(part.prefixes, dev)


def flat(parts: list[Part]) -> tuple[Part, list[torch.Tensor]]:
    """A pass's parts as one part of single-token rows: a question's m tokens become m decode rows of its
    request (the same slot, suffix positions start.., each seeing its suffix causally up to itself). So
    every row of every pass takes one arithmetic, the decode rows' (products in the decode copy, cag's
    native attention), and a token's K/V are the same whether a question or a decode step wrote them:
    an answer's K/V can be kept with its conversation (cag.runtime.kept_conversations). Returns the part
    and, per given part, the rows whose logits it returns (each request's last)."""
    toks, prefixes, slots, starts, picks, r = [], [], [], [], [], 0
    for p in parts:
        B, m = p.toks.shape
        toks.append(p.toks.reshape(B * m, 1))
        prefixes += [x for x in p.prefixes for _ in range(m)]
        slots.append(p.slots.repeat_interleave(m))
        starts.append((p.starts[:, None] + torch.arange(m)).reshape(-1))
        picks.append(r + torch.arange(B) * m + (m - 1))
        r += B * m
    seens = [p.seen for p in parts if p.seen is not None]
    seen = max(seens) if len(seens) == len(parts) else None
    one = Part(torch.cat(toks), prefixes, torch.cat(slots), torch.cat(starts), seen=seen, question=False)
    return one, picks


def offsets(parts: list[Part]) -> list[int]:
    out, r = [], 0
    for p in parts:
        out.append(r)
        r += p.toks.numel()
    return out


SHORT = 128  # suffixes up to this many keys are read in 16-key steps; longer ones in steps of BLOCK
BLOCK = 512  # torch's CPU flash kernel sums keys in blocks of 512 once a call has that many


def suffix_keys(seen: int, room: int) -> int:
    """How many suffix keys a part's attention reads when its longest request sees `seen`: a width
    that does not depend on who else is in the batch or how a conversation was split into parts, so
    a request's rows get the same bits alone, batched and over a kept conversation. torch's CPU flash
    kernel gives a row with j visible keys identical results for every width from j rounded up to
    16 to 512 when j <= 128, and for every multiple of 512 from j rounded up to 512 on (blocks of
    masked keys change nothing: tests/test_batch.py pins both); between 128 and 512 keys the result
    moves with the width, so longer suffixes are read in whole blocks of 512 (a slot's room is a
    multiple of it)."""
    return min(room, -(-seen // 16) * 16) if seen <= SHORT else min(room, -(-seen // BLOCK) * BLOCK)


def roles(parts: list[Part]) -> list[tuple[int, bool]] | None:
    """(rows, question?) runs of the pass in row order, for the packed products (packed.Packed): a
    question part (Part.asks) is one run; None when every row decodes."""
    if not any(p.asks for p in parts):
        return None
    out: list[tuple[int, bool]] = []
    for p in parts:
        q = p.asks
        if out and out[-1][1] == q:
            out[-1] = (out[-1][0] + p.toks.numel(), q)
        else:
            out.append((p.toks.numel(), q))
    return out


def groups(prefixes: list, device) -> list[tuple]:
    """[(prefix, row indices or None for all rows)]: requests that share a PrefixKV read it together."""
    if all(p is prefixes[0] for p in prefixes):
        return [(prefixes[0], None)]
    by: dict[int, tuple] = {}
    for b, p in enumerate(prefixes):
        by.setdefault(id(p), (p, []))[1].append(b)
    return [(p, torch.tensor(rows, device=device)) for p, rows in by.values()]
