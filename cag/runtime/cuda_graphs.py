"""CUDA graphs of the decode step: one request's next token through every layer in one replay.

Why: on CUDA a lean decode step (cag.runtime.step) is ~1,700 small kernels, and launching them one at a
time from Python costs more than running them (bench/gpu_check.py measures both ways; figures in
docs/performance.md). A CUDA graph records the step's
kernels once and launches them all with one call.

What is captured: the step of one request (B = 1, one token) over one resident prefix, its
attention reading the first `room` keys of its suffix slot (the question and answer room; the keys
past the request's own masked; a longer conversation steps eagerly past them), so one graph per
prefix, kept on the Prefix (Prefix.made) and gone with it; the first question on a prefix pays the
capture (an eager step and a recording, tens of ms). The request's token, slot and suffix start
are copied into static device tensors before each replay, and the position table is filled up to
the prefix's end plus the slot's room before the capture: nothing in the step reads a value back
from the device or allocates outside the graph's pool.

Exactness: every decode step of a request on CUDA is a replay (the first one too: a capture does
not compute, so an eager warm-up runs first and the replay overwrites the K/V it wrote), in `cag`
and in `full` mode alike, so both see the same kernels. Requests are replayed one at a time
(cag.runtime.decoder): cuBLAS picks a product's kernel by its shape, so a row's bits would move with the
rows beside it.
"""

from __future__ import annotations

import torch

from cag.runtime.rows import Part


class Graphs:
    """Captured decode steps of `step` (cag.runtime.step.LeanStep) writing to `slots` (cag.runtime.slots.Slots)."""

    def __init__(self, step, slots, room: int):
        self.step, self.slots = step, slots
        self.room = min(room, slots.room)  # suffix keys a captured step reads: a request past them steps eagerly
        dev = step.device
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)  # (B=1, m=1)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)
        self.captures = 0

    def run(self, prefix, tok: int, slot: int, start: int) -> torch.Tensor:
        """Logits (V,) of the token after `tok`, written at suffix position `start` of slot `slot`
        over `prefix`. Read them before the next call: the next replay overwrites them."""
        self.tok.fill_(tok)
        self.slot.fill_(slot)
        self.start.fill_(start)
        entry = prefix.made.get("cuda_graph")  # (graph, static logits (1, V))
        if entry is None:
            entry = prefix.made["cuda_graph"] = self._capture(prefix)
        graph, out = entry
        graph.replay()
        return out[0]

    def _capture(self, prefix):
        s = self.step
        part = Part(self.tok, [prefix], self.slot, self.start, seen=self.room)  # reads the first `room` keys of the slot
        s.cos_sin(self.start, s.embed[:1], prefix.n + self.room)  # the whole position table, before capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: cuBLAS handles and workspaces are made outside the capture
            s.run([part], self.slots)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (a prefill, a snapshot load) may use the GPU during the capture;
        # their work goes to other streams and pools, never into the graph
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = s.run([part], self.slots)[0]  # (1, V): static, overwritten by each replay
        self.captures += 1
        return graph, out
