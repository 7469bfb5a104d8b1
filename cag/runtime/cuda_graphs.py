"""CUDA graphs of the decode step: a fixed number of rows' next tokens through every layer in one replay.

Why: on CUDA a lean decode step (cag.runtime.step) is hundreds of small kernels, and launching them one at
a time from Python costs more than running them (bench/gpu_check.py measures both ways; figures in
docs/performance.md). A CUDA graph records the step's kernels once and launches them all with one call.

What is captured: the step of W rows (CAG_DECODE_ROWS: requests over one resident prefix, the rest padding rows;
cag.runtime.decoder), one token each, their attention reading the first `room` keys of their suffix slots (the question
and answer room; the keys past a request's own masked; a longer conversation steps eagerly past them), so one graph per
prefix, kept on the PrefixKV (PrefixKV.made, keyed by the Graphs: a rebuilt decoder captures its own) and gone with it;
the first decode step on a prefix pays the capture (an eager step and a recording). The rows' tokens, slots and suffix
starts are copied into one static device tensor before each replay, and the position table is filled up to the prefix's
end plus the slots' room before the capture: nothing in the step reads a value back from the device or allocates outside
the graph's pool.

Exactness: every decode step on CUDA is a replay of W rows (the first one too: a capture does not
compute, so an eager warm-up runs first and the replay overwrites the K/V it wrote), in `cag` and in
`full` mode alike, alone or beside other requests, so a row always meets the same kernels at the same
shapes: cuBLAS picks a product's kernel by its shape, never by the values in the other rows.
"""

from __future__ import annotations

import torch

from cag.runtime.rows import Part


class Graphs:
    """Captured decode steps of `step` (cag.runtime.step.LeanStep) over `rows` rows writing to `slots`
    (cag.runtime.slots.Slots)."""

    def __init__(self, step, slots, room: int, rows: int):
        self.step, self.slots, self.rows = step, slots, rows
        self.room = min(room, slots.room)  # suffix keys a captured step reads: a request past them steps eagerly
        self.ids = torch.zeros(3, rows, dtype=torch.long, device=step.device)  # tokens, slots, suffix starts (W,) each
        self.captures = 0

    def run(self, prefix, toks: list[int], slots: list[int], starts: list[int]) -> torch.Tensor:
        """Logits (W, V) of the tokens after `toks` (W,), written at suffix positions `starts` of slots
        `slots` over `prefix`. Read them before the next call: the next replay overwrites them."""
        self.ids.copy_(torch.tensor([toks, slots, starts]))  # one host-to-device copy a step
        entry = prefix.made.get(self)  # (graph, static logits (W, V)), keyed by these Graphs: their slots and rows
        if entry is None:
            entry = prefix.made[self] = self._capture(prefix)
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, prefix):
        s, W = self.step, self.rows
        part = Part(self.ids[0].view(W, 1), [prefix] * W, self.ids[1], self.ids[2], seen=self.room)
        s.cos_sin(self.ids[2], s.embed[:1], prefix.n + self.room)  # the whole position table, before capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: cuBLAS handles and workspaces are made outside the capture
            s.run([part], self.slots)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (a prefill, a snapshot load) may use the GPU during the capture;
        # their work goes to other streams and pools, never into the graph
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = s.run([part], self.slots)[0]  # (W, V): static, overwritten by each replay
        self.captures += 1
        return graph, out
