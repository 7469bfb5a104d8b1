"""Decode loop: one token per forward over a preallocated cache, explicit positions, greedy by default."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

import torch

from cag.errors import BadInput
from cag.model import weights
from cag.runtime import kv_cache


@dataclass(frozen=True)
class DecodeConfig:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy (exact, the default everywhere)
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0  # no stop token is picked before this many answer tokens (vLLM's min_tokens)
    # stop sequences (OpenAI's `stop`): the answer ends before the first one its text holds (TextStream), a cut
    # on the text of the same tokens (decoding halts there: the tokens before it are those decoded without it)
    stop: tuple[str, ...] = ()

    def within(self, limit: int) -> DecodeConfig:
        """This decoding with `limit` answer tokens at most (min_tokens clamped to it)."""
        if self.min_tokens < 0:
            raise BadInput(f"min_tokens must be 0 or more, got {self.min_tokens}")
        return replace(self, max_tokens=limit, min_tokens=min(self.min_tokens, limit))


@functools.lru_cache(maxsize=16)
def _stop_index(stops: frozenset[int], device: torch.device) -> torch.Tensor:
    """The stop token ids as an index tensor, built once (not per step while min_tokens holds)."""
    return torch.tensor(sorted(stops), device=device)


def _pick(logits: torch.Tensor, cfg: DecodeConfig, gen: torch.Generator | None, stops: AbstractSet[int] = frozenset(),
          n: int = 0) -> int:
    """The next token from logits (V,), the n-th of the answer: stop tokens are ruled out while
    n < cfg.min_tokens (on a copy: the caller's logits are not written)."""
    if n < cfg.min_tokens and stops:
        logits = logits.index_fill(0, _stop_index(frozenset(stops), logits.device), float("-inf"))
    # Below 1e-5 sampling is greedy in all but name, and logits / T overflows float32 to inf
    # (softmax -> nan) long before T reaches 0: a vanishing temperature is greedy. `not >=` also
    # sends a NaN temperature here.
    if not cfg.temperature >= 1e-5:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)  # (V,)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < cfg.top_p
        keep[0] = True  # the most likely token always stays, however small top_p (1e-300 is 0 in float32)
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.inference_mode()
def decode(
    model,
    cache,
    logits: torch.Tensor,
    pos: int,
    cfg: DecodeConfig,
    stops: set[int],
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[int]:
    """Yield generated token ids. `logits` (V,) are those of the last prompt token at pos-1.

    Every step is a transformers forward over `cache`: the path for models the batched step
    (cag.runtime.step, cag.runtime.decoder) does not cover."""
    device = logits.device
    gen = sampler(cfg)
    for i in range(cfg.max_tokens):
        tok = _pick(logits if gen is None else logits.cpu(), cfg, gen, stops, i)  # a seeded generator lives on the CPU
        if tok in stops:
            return
        yield tok
        if i + 1 == cfg.max_tokens or (should_stop and should_stop()):
            return
        p = torch.tensor([pos], device=device)  # (1,)
        with weights.decoding():  # one row: the products in the decode format (CAG_WEIGHTS)
            logits = model(
                input_ids=torch.tensor([[tok]], device=device),
                past_key_values=cache,
                cache_position=p,
                position_ids=p.unsqueeze(0),
                use_cache=True,
            ).logits[0, -1]
        pos += 1


def stop_at(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first of the stop sequences `stops` starts in `text`, or None. The search starts at the
    text's first character that is not whitespace, where the answer (stripped) starts."""
    start = len(text) - len(text.lstrip())
    found = [i for s in stops if s and (i := text.find(s, start)) >= 0]
    return min(found) if found else None


def _undecided(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` (after its leading whitespace) may be the start of a
    stop sequence: held back until the next tokens decide it."""
    tail = text.lstrip()
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(tail)), n, -1):  # the longest proper prefix of s that ends the text
            if tail.endswith(s[:k]):
                n = k
                break
    return n


class TextStream:
    """Turns token ids into text increments; holds back a trailing partial UTF-8 character and, with
    stop sequences, the end of the text while it may be the start of one (a piece handed out is never
    part of a stop sequence). Once the text holds one, `stopped` is true and the text ends before it."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.sent = ""
        self.stops = tuple(s for s in stops if s)
        self.cut: int | None = None  # where the first stop sequence starts in the decoded text

    @property
    def stopped(self) -> bool:
        return self.cut is not None

    def push(self, tok: int) -> str:
        self.ids.append(tok)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if self.stops and (cut := stop_at(text, self.stops)) is not None:
            self.cut = cut
            return self._send(text[:cut])
        if text.endswith("\ufffd"):
            return ""
        return self._send(text[: len(text) - _undecided(text, self.stops)] if self.stops else text)

    def _send(self, text: str) -> str:
        piece, self.sent = text[len(self.sent) :], text
        return piece

    def flush(self) -> str:
        """What `push` held back (an incomplete UTF-8 sequence at the very end, the possible start of a
        stop sequence that never came), as decoded."""
        return self._send(self.text)

    @property
    def text(self) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        return text if self.cut is None else text[: self.cut]


@dataclass
class Generated:
    text: str  # stripped answer
    ids: list[int]  # generated token ids (stop token excluded)
    ttft_ms: float  # from t_start to the first token (or to the end, for an empty answer)
    decode_tok_s: float | None  # tokens after the first, per second; None below two tokens
    # suffix tokens taken from a kept conversation (cag.runtime.kept_conversations), not prefilled again
    reused: int = 0


def generate(lm, cache, n_prefix: int, suffix: list[int], cfg: DecodeConfig, chunk: int = 512,
             on_text: Callable[[str], None] | None = None, should_stop: Callable[[], bool] | None = None,
             t_start: float | None = None) -> Generated:
    """Answer over a buffer whose positions [0, n_prefix) hold a prompt prefix: prefill the suffix
    at n_prefix.., then decode into the same buffer. `lm` is a cag.model.loading.LoadedModel."""
    t_start = time.perf_counter() if t_start is None else t_start
    logits = kv_cache.prefill(lm.model, cache, suffix, n_prefix, chunk, should_stop=should_stop)
    stream, ids, t_first = TextStream(lm.tokenizer, cfg.stop), [], None
    for tok in decode(lm.model, cache, logits, n_prefix + len(suffix), cfg, lm.stops, should_stop):
        if t_first is None:
            t_first = time.perf_counter()
        ids.append(tok)
        piece = stream.push(tok)
        if on_text and piece:
            on_text(piece)
        if stream.stopped:  # a stop sequence: the answer ends before it, no more tokens are decoded
            break
    if on_text and (tail := stream.flush()):
        on_text(tail)  # a trailing partial character held back: the pieces add up to the text
    return generated(stream.text, ids, t_start, t_first, time.perf_counter())


def sampler(cfg: DecodeConfig) -> torch.Generator | None:
    """A seeded request's random generator (on the CPU); None for greedy or unseeded sampling."""
    return torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None and cfg.temperature > 0 else None


def generated(text: str, ids: list[int], t_start: float, t_first: float | None, t_end: float) -> Generated:
    """The Generated of an answer: TTFT from t_start, decode rate over the tokens after the first."""
    ttft = ((t_first or t_end) - t_start) * 1e3
    rate = (len(ids) - 1) / (t_end - t_first) if t_first is not None and len(ids) > 1 and t_end > t_first else None
    return Generated(text.strip(), list(ids), ttft, round(rate, 2) if rate else None)


def alone(lm, req, chunk: int) -> None:
    """Answer a cag.runtime.requests.Request of a model the batched step does not cover, in the caller's thread:
    the transformers forward over a cache holding a copy of its prefix (its result or error set on it)."""
    n = req.prefix.n
    cache = kv_cache.new_cache(lm.model, n + len(req.suffix) + req.cfg.max_tokens + 1)
    kv_cache.load_into(cache, req.prefix.kv, lm.dtype, lm.device)
    try:
        req.result = generate(lm, cache, n, req.suffix, req.cfg, chunk, req.on_text, req.should_stop, req.t_start)
        if req.score and req.result.ids:
            req.logprobs = kv_cache.answer_logprobs(lm.model, cache, req.suffix, req.result.ids, n)
    except Exception as e:  # noqa: BLE001 - raised by Decoder.run
        req.error = e
