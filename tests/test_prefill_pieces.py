"""A long prompt is prefilled in pieces of CAG_CHUNK_TOKENS rows (cag.runtime.decoder.Decoder._pieces): the
answer is exact (cag == full on every path; where every row is a decode row, the same as one pass), and a
short question asked meanwhile does not wait for the long prompt's whole prefill (issue 55 E4)."""

from __future__ import annotations

import threading
import time

import pytest

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.kernels import native

WORDS = "the lighthouse keeper lights the lamp at dusk and the ferry leaves the harbour at seven ".split()
LONG = [
    {"role": "user", "content": " ".join(WORDS[i % len(WORDS)] for i in range(400)) + "\nWho keeps the lighthouse?"}
]


def _engine(request, monkeypatch, small_corpus, model: str, weights: str, chunk: int) -> Engine:
    if weights == "int4" and native.load() is None and not native.load_avx2():
        pytest.skip(f"cag's kernels do not run here: {native.reason()}")
    monkeypatch.setenv("CAG_MODEL", str(request.getfixturevalue(f"{model}_model_dir")))
    monkeypatch.setenv("CAG_WEIGHTS", weights)
    monkeypatch.setenv("CAG_CHUNK_TOKENS", str(chunk))
    e = Engine(get_settings())
    e.ingest(str(small_corpus))
    return e


@pytest.mark.parametrize("model,weights", [("tiny", "fp32"), ("tiny64", "int4")])
def test_a_long_prompt_in_pieces_is_exact_alone_batched_and_full(request, monkeypatch, small_corpus, model, weights):
    e = _engine(request, monkeypatch, small_corpus, model, weights, chunk=16)
    pieces = e.answer(Query("corpus", None, messages=LONG, max_tokens=12))
    assert pieces.prompt_tokens - pieces.cached_tokens > 10 * 16  # many pieces
    full = e.answer(Query("corpus", None, messages=LONG, max_tokens=12, mode="full"))
    out: dict = {}
    threads = [
        threading.Thread(
            target=lambda i=i: out.update(
                {i: e.answer(Query("corpus", None, messages=LONG, max_tokens=12, mode=("cag", "full")[i % 2]))}
            )
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i].token_ids for i in range(4)] == [pieces.token_ids] * 4 == [full.token_ids] * 4
    if e.decoder.step.flat:  # every row a decode row: the split does not change a bit
        monkeypatch.setenv("CAG_CHUNK_TOKENS", "4096")
        one = Engine(get_settings(), lm=e.lm).answer(Query("corpus", None, messages=LONG, max_tokens=12))
        assert one.token_ids == pieces.token_ids


def test_a_short_question_does_not_wait_for_a_long_prompts_prefill(request, monkeypatch, small_corpus):
    e = _engine(request, monkeypatch, small_corpus, "tiny", "fp32", chunk=16)
    e.answer(Query("corpus", "Warm up.", max_tokens=2))
    got: dict = {}

    def long():
        got["t0"] = time.perf_counter()
        got["long"] = e.answer(Query("corpus", None, messages=LONG, max_tokens=2))

    t = threading.Thread(target=long)
    t.start()
    deadline = time.monotonic() + 30
    while not any(r.filled > 0 for r in list(e.decoder._filling)):  # its first pieces are in
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.001)
    short = e.answer(Query("corpus", "Who keeps the lighthouse?", max_tokens=3))
    done = time.perf_counter()
    t.join()
    assert len(short.token_ids) == 3
    assert got["t0"] + got["long"].ttft_ms / 1e3 > done  # answered before the long prompt's first token
    assert e.decoder.slots.in_use == (e.decoder.pad is not None)


def test_a_stopped_request_ends_between_pieces(request, monkeypatch, small_corpus):
    from cag.runtime.kv_cache import Cancelled

    e = _engine(request, monkeypatch, small_corpus, "tiny", "fp32", chunk=16)
    calls = []

    def stop() -> bool:  # the client goes away during the prefill
        calls.append(1)
        return len(calls) >= 3

    with pytest.raises(Cancelled):
        e.answer(Query("corpus", None, messages=LONG, max_tokens=4), should_stop=stop)
    assert len(calls) == 3  # asked before the first piece and between pieces, not after it stopped
    assert e.decoder.slots.in_use == (e.decoder.pad is not None)
    assert e.answer(Query("corpus", None, messages=LONG, max_tokens=4)).token_ids  # the engine goes on
