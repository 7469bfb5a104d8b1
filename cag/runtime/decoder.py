"""Continuous batching: every active request advances one token per step, in one forward.

Decoding one request reads every weight once per token; B requests decoded together read them once for all B
(cag.runtime.step), and requests on the same snapshot read its prefix once too. One scheduler thread owns the
model's decode work: a request (from any thread) is queued; its question (or conversation) is prefilled in pieces
of at most `chunk` rows (CAG_CHUNK_TOKENS), one pass each, alone when nothing else runs, else riding along the
decode step (its rows share the step's weight reads, in the decode format CAG_WEIGHTS), so one long prompt never
stalls the requests decoding (the shortest prompt left goes first: Decoder._pieces); it then decodes with the
batch and leaves when it stops: a stop token, a stop sequence in its text (DecodeConfig.stop), max_tokens, or its
`should_stop` (client gone, timeout: also between pieces). Its own failure (a callback raising) ends only it.

Exactness: a request's tokens are the same alone and batched. On the CPU every product and the
decode attention compute a row from its own inputs (cag.kernels.native, cag.model.weights; tests/test_batch.py),
so a row's bits do not depend on the rows beside it (with CAG_DECODE_KERNELS=torch: on AMX CPUs
only, README). On CUDA cuBLAS picks a product's kernel by its shape, so there every decode step has
one shape: the requests over one prefix go in steps of exactly `rows` rows (CAG_DECODE_ROWS; the
rest padding rows, which write to a slot of their own), each step a replayed graph
(cag.runtime.cuda_graphs), and a question is prefilled in a forward of its own. A row then sees the
same kernels with or without neighbours (tests/test_fixed_rows.py pins it on the CPU with torch's
kernels, whose sums also move with the row count; tests/test_cuda.py on a GPU).

Models the batched step does not cover (cag.runtime.step.why_not) decode alone, in the caller's thread,
through the transformers forward over a buffer holding a copy of the prefix (cag.runtime.generate.alone).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial

import torch

from cag.kernels import native
from cag.model import file_pages
from cag.runtime import kv_cache
from cag.runtime import step as lean
from cag.runtime.cuda_graphs import Graphs
from cag.runtime.generate import TextStream, _pick, alone, generated, sampler
from cag.runtime.kept_conversations import KeptConversations, best_match
from cag.runtime.omp_pools import release as release_workers
from cag.runtime.requests import Request, chunks, fixed_rows
from cag.runtime.rows import Part
from cag.runtime.slots import Slots

log = logging.getLogger("cag")
IDLE_EXIT_S = 30.0  # an idle decode thread ends, so a dropped engine (and its slots) can be freed
_LIVE: weakref.WeakSet = weakref.WeakSet()  # every Decoder, for _stop_all


@atexit.register
def _stop_all() -> None:
    """Idle decode threads end before the interpreter shuts down: a decoder whose engine was dropped is
    freed by its own thread as it ends, and freeing tensors while torch is torn down aborts the process."""
    for d in list(_LIVE):
        d.close()


class Decoder:
    """Answers over prefixes: batched (one scheduler thread) where cag.runtime.step applies, else alone."""

    def __init__(self, lm, room: int, max_batch: int, threads: int = 0, chunk: int = 512, cuda_graphs: bool = True,
                 kept: KeptConversations | None = None, graph_room: int = 512, rows: int = 0,
                 quotes: KeptConversations | None = None):
        # room: the longest suffix (conversation and answer) a slot holds; graph_room: the suffix keys a
        # fixed-rows step reads (cag.runtime.cuda_graphs); rows: CAG_DECODE_ROWS (fixed_rows)
        self.lm, self.room, self.max_batch, self.threads, self.chunk = lm, room, max_batch, threads, chunk
        self.graph_room = graph_room
        self.kept = kept  # conversations' K/V kept between turns (cag.runtime.kept_conversations); None: nothing kept
        self.quotes = quotes  # warmed quotes (cag.answering.quotes): kept where a request is one, reused by `shared`
        self.step = lean.for_model(lm.model)
        # torch's CPU kernels (flash attention, oneDNN's and the weight-only products) give a row bits that depend
        # on the rows beside it on CPUs without AMX (tests/test_batch.py, bench/bench_exactness.py): there each
        # request steps alone unless CAG_DECODE_ROWS says otherwise
        alone = lm.device.type == "cpu" and self.step is not None and self.step.kernel is None and not native.tiles()
        self.rows = fixed_rows(lm.device.type, max_batch, rows, alone)  # module doc: exactness
        self.cuda_graphs = cuda_graphs
        self.slots: Slots | None = None
        self.pad: int | None = None  # the slot padding rows write to (fixed rows), never a request's
        self.graphs: Graphs | None = None  # CUDA: captured decode steps of `rows` rows
        self._pending: deque[Request] = deque()
        self._active: list[Request] = []
        self._filling: list[Request] = []  # holding a slot, their question not all prefilled yet
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.stats = {"decode_steps": 0, "decode_rows": 0, "batch_max": 0}  # read by /metrics
        _LIVE.add(self)

    def close(self, timeout: float = 5.0) -> None:
        """End the decode thread once it is idle (requests in flight are answered first)."""
        with self._cond:
            self._closing = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def batched(self) -> bool:
        return self.step is not None

    @property
    def keeps(self) -> bool:
        """Whether a request's conversation (one with a key) is kept and reused (cag.runtime.kept_conversations):
        only where the step makes every row a decode row (LeanStep.flat), so a row's K/V are the same bits whether
        its turn prefilled it, decoded it or a later turn recomputes it. Elsewhere (torch's kernels, CUDA) a question's
        products sum a row differently with the rows beside it, and each turn prefills its whole conversation."""
        return self.kept is not None and self.step is not None and self.step.flat

    @property
    def slot_bytes(self) -> int:
        return self.lm.kv_bytes(self.room, self.lm.attn_dtype)  # one request's suffix slot: the KV formula

    def snapshot(self) -> dict:
        """Counters and gauges for /metrics: steps, rows (rows / steps = mean batch), active, waiting."""
        return dict(self.stats, decode_active=len(self._active), decode_waiting=len(self._pending) + len(self._filling),
                    slot_bytes=self.slot_bytes if self.batched else 0)

    def run(self, req: Request) -> Request:
        """Answer `req`; blocks until it is done. Raises its error (kv_cache.Cancelled when it was stopped
        before its question was prefilled)."""
        file_pages.check(self.lm.model)  # weights read from their file must still be the file's
        if self.step is None:
            alone(self.lm, req, self.chunk)
        else:
            release_workers()  # this thread's OpenMP workers would slow the decode thread's every step
            with self._cond:
                if self.slots is None:
                    lm = self.lm
                    extra = 1 if self.rows else 0  # the padding rows' slot
                    self.slots = Slots(lm.n_layers, lm.n_kv_heads, lm.head_dim, self.room, self.max_batch + extra,
                                       lm.attn_dtype, lm.device)
                    self.pad = self.slots.take() if extra else None
                    if self.rows and self.cuda_graphs and lm.device.type == "cuda":
                        self.graphs = Graphs(self.step, self.slots, self.graph_room, self.rows)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="cag-decode", daemon=True)
                    self._thread.start()
                self._pending.append(req)
                self._cond.notify()
            req.done.wait()
        if req.error is not None:
            raise req.error
        return req

    # -- the scheduler thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        with torch.inference_mode():
            while True:
                with self._cond:
                    if not self._pending and not self._active and not self._filling:
                        release_workers()  # idle: the threads that prefill get the CPUs to themselves
                    while not self._pending and not self._active and not self._filling:
                        # idle: end the thread (the next run starts one)
                        if self._closing or not self._cond.wait(timeout=IDLE_EXIT_S):
                            self._thread = None
                            return
                    free = self.max_batch - len(self._active) - len(self._filling)
                    new = [self._pending.popleft() for _ in range(min(len(self._pending), free))]
                self._filling += [r for r in new if self._take_slot(r)]
                pieces = self._pieces()
                if self._active:  # question pieces ride along the decode step's weight reads
                    self._pass(list(self._active), pieces)
                    continue
                for piece in pieces:  # nothing to decode yet: each piece alone, as a lone request runs
                    self._pass([], [piece])

    def _take_slot(self, req: Request) -> bool:
        if req.should_stop and req.should_stop():
            self._finish(req, kv_cache.Cancelled("stopped before its question was prefilled"))
            return False
        assert self.slots is not None  # made before the scheduler thread starts
        req.slot = self.slots.take()
        rows = req.seed  # knowledge rows a refresh keeps (cag.runtime.knowledge_kv), or the conversation so far:
        if req.key is not None and self.keeps:  # copied into the slot, the prefill starts after them
            kept, n = best_match([(self.kept, req.key), (self.quotes, req.shared)], req.suffix)
            rows = [(k[:, :n], v[:, :n]) for k, v in kept.kv] if kept is not None else rows
        for (k, v), K, V in zip(rows or (), self.slots.k, self.slots.v):
            K[req.slot, :, : k.shape[1]], V[req.slot, :, : k.shape[1]] = k, v
        req.filled = req.start = rows[0][0].shape[1] if rows else 0
        return True

    def _pieces(self) -> list[tuple[Request, int]]:
        """The question rows of the next pass, (request, rows): the filling requests with the fewest rows
        left first (a short question never waits behind a long conversation's prefill), each its next
        piece, as long as the pass holds at most `chunk` question rows (one piece at least). A piece ends
        at the next multiple of `chunk` of its suffix, so a request's pieces are the same whatever else
        runs: the kernels that are not row-invariant (torch's, CUDA's) then see one split of a question,
        batched or alone, in `full` or not (those paths keep no conversation: every suffix starts at 0)."""
        out: list[tuple[Request, int]] = []
        rows = 0
        for r in sorted(self._filling, key=lambda r: len(r.suffix) - r.filled):
            if r.filled > r.start and r.should_stop:  # between pieces (_take_slot asked before the first)
                try:
                    if r.should_stop():  # gone (a client, a timeout): the rest is not prefilled
                        self._finish(r, kv_cache.Cancelled("stopped while its question was prefilled"))
                        continue
                except Exception as e:  # noqa: BLE001 - a failing callback ends its own request only
                    self._finish(r, e)
                    continue
            m = min(len(r.suffix), (r.filled // self.chunk + 1) * self.chunk) - r.filled
            if out and rows + m > self.chunk:
                break
            out.append((r, m))
            rows += m
        return out

    def _pass(self, batch: list[Request], new: list[tuple[Request, int]]) -> None:
        """One forward: a decode row for each request of `batch`, and a piece of the question of each of
        `new` (request, rows): one that ends its question joins the batch. Emits every decoding request's
        next token. With fixed rows (CUDA) the batch goes in steps of `rows` rows per prefix, each a
        replayed graph where CAG_CUDA_GRAPHS, and each piece has a forward of its own."""
        if self.rows:
            for chunk, seen in chunks(batch, self.rows, self.graph_room):
                self._forward(chunk, [], partial(self._fixed, chunk, seen))
            for piece in new:
                self._forward([], [piece], partial(self._step, [], [piece]))
            return
        self._forward(batch, new, partial(self._step, batch, new))

    def _step(self, batch: list[Request], new: list[tuple[Request, int]]) -> list[torch.Tensor]:
        """Logits per part of one step (see _forward)."""
        assert self.step is not None and self.slots is not None  # the scheduler thread runs only with both
        return self.step.run(self._parts(batch, new), self.slots)

    def _fixed(self, chunk: list[Request], seen: int | None) -> list[torch.Tensor]:
        """[logits (B, V)] of a decode step of `rows` rows: the chunk's requests (one prefix), then padding
        rows (token 0 at position 0 of the padding slot). `seen`: the suffix keys every row's attention
        reads (graph_room), or None for a request past it (alone, reading its own width)."""
        assert self.step is not None and self.slots is not None  # the scheduler thread runs only with both
        W, B, prefix = self.rows, len(chunk), chunk[0].prefix
        toks = [r.next_tok for r in chunk] + [0] * (W - B)
        slots = [r.slot for r in chunk] + [self.pad] * (W - B)
        starts = [r.length for r in chunk] + [0] * (W - B)
        if self.graphs is not None and seen is not None:
            # a decoding request has its slot and next token; the padding slot is taken with the slots
            return [self.graphs.run(prefix, toks, slots, starts)[:B]]  # type: ignore[arg-type]
        part = Part(torch.tensor(toks)[:, None], [prefix] * W, torch.tensor(slots), torch.tensor(starts), seen=seen)
        return [self.step.run([part], self.slots)[0][:B]]

    @staticmethod
    def _parts(batch: list[Request], new: list[tuple[Request, int]]) -> list[Part]:
        parts = [Part(torch.tensor([[r.next_tok] for r in batch]), [r.prefix for r in batch],
                      torch.tensor([r.slot for r in batch]), torch.tensor([r.length for r in batch]))] if batch else []
        return parts + [Part(torch.tensor([r.suffix[r.filled : r.filled + m]]), [r.prefix], torch.tensor([r.slot]),
                             torch.tensor([r.filled]), question=True) for r, m in new]

    def _forward(self, batch: list[Request], new: list[tuple[Request, int]],
                 forward: Callable[[], list[torch.Tensor]]) -> None:
        """Run `forward` (logits per part: the decode part (B, V) first when `batch`, then each of
        `new`'s (1, V)) and hand every request whose question is all prefilled its next token."""
        try:
            out = forward()
        except Exception as e:  # noqa: BLE001 - the pass itself failed (memory?): every request in it
            log.exception("decode step failed")
            for r in batch + [r for r, _ in new]:
                self._finish(r, e)
            return
        if batch:
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] += len(batch)
            self.stats["batch_max"] = max(self.stats["batch_max"], len(batch))
            for i, r in enumerate(batch):
                r.length += 1
                self._emit(r, out[0][i])
        for (r, m), logits in zip(new, out[len(out) - len(new):]):
            r.filled += m
            try:
                if r.on_piece is not None:
                    r.on_piece(m)
            except Exception as e:  # noqa: BLE001 - a failing callback ends its own request only
                self._finish(r, e)
                continue
            if r.filled < len(r.suffix):
                continue  # more pieces to come: its logits say nothing yet
            self._filling.remove(r)
            r.length = len(r.suffix)
            r.stream, r.gen = TextStream(self.lm.tokenizer, r.cfg.stop), sampler(r.cfg)
            self._active.append(r)
            self._emit(r, logits[0])

    def _keep(self, req: Request, ids: list[int]) -> None:
        """Keep the K/V of the request's first len(ids) suffix positions (its question and answer) for a later turn."""
        n = len(ids)
        assert self.kept is not None and req.key is not None and self.slots is not None  # as keeps checked
        kv = [(K[req.slot, :, :n], V[req.slot, :, :n]) for K, V in zip(self.slots.k, self.slots.v)]
        (self.quotes if req.quote and self.quotes is not None else self.kept).keep(req.key, ids, kv)

    def _emit(self, req: Request, logits: torch.Tensor) -> None:
        """Pick the next token from `logits` (V,): stop, or hand it out and schedule it."""
        cfg = req.cfg
        picked = logits if req.gen is None else logits.cpu()  # a seeded generator lives on the CPU
        tok = _pick(picked, cfg, req.gen, self.lm.stops, len(req.ids))
        if tok in self.lm.stops:
            return self._finish(req)
        if req.t_first is None:
            req.t_first = time.perf_counter()
        req.ids.append(tok)
        if req.score:
            req.logprobs.append(float(torch.log_softmax(logits.float(), -1)[tok]))
        try:
            assert req.stream is not None  # made as it joined the batch (_forward)
            piece = req.stream.push(tok)
            if req.on_text and piece:
                req.on_text(piece)
            stop = req.stream.stopped or (req.should_stop is not None and req.should_stop())  # a stop sequence, or gone
        except Exception as e:  # noqa: BLE001 - a failing callback ends its own request only
            return self._finish(req, e)
        if len(req.ids) >= cfg.max_tokens or stop or req.length >= self.room:
            return self._finish(req)
        req.next_tok = tok

    def _finish(self, req: Request, error: BaseException | None = None) -> None:
        if req in self._active:
            self._active.remove(req)
        if req in self._filling:
            self._filling.remove(req)
        if error is None and req.slot is not None and req.key is not None and self.keeps:
            self._keep(req, req.suffix + req.ids[: req.length - len(req.suffix)])  # with the answer's rows
        if error is None and req.slot is not None and req.export is not None:  # before the slot is zeroed
            assert self.slots is not None  # a slot was taken from them
            try:
                req.export([(K[req.slot, :, : len(req.suffix)], V[req.slot, :, : len(req.suffix)])
                            for K, V in zip(self.slots.k, self.slots.v)])
            except Exception as e:  # noqa: BLE001 - (memory) raised by run()
                error = e
        if req.slot is not None:  # zeroed as far as it may have been written (a failed pass: its whole suffix)
            assert self.slots is not None  # a slot was taken from them
            self.slots.give(req.slot, max(req.length, len(req.suffix)) + 1)
            req.slot = None
        if error is None:
            try:
                assert req.stream is not None  # an end without error comes from _emit: the request decoded
                if req.on_text and (tail := req.stream.flush()):
                    req.on_text(tail)  # a partial character held back: the pieces add up to the text
            except Exception as e:  # noqa: BLE001
                error = e
            else:
                req.result = generated(req.stream.text, req.ids, req.t_start, req.t_first, time.perf_counter())
        req.error = error
        req.done.set()
