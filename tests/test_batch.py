"""Continuous batching (cag.runtime.decoder): concurrent questions are decoded together, each getting the
tokens it gets alone; a request that fails or stops leaves the batch without harming the others;
`cag ask --questions-file` answers a file of questions in batches."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cag.answering.query import Query
from cag.errors import TooLarge
from cag.kernels import backends, native
from cag.rag.answer import ask_many
from tests.conftest import REPO
from tests.cpu import formats

QUESTIONS = ["Who keeps the lighthouse?", "When does the ferry leave?", "What does the bakery sell on Tuesdays?",
             "Where is the ferry going?", "Who lights the lamp?", "What is sold on Quay Street?"]


def together(engine, calls: list) -> list:
    """Run the calls at once (a barrier lines them up), so they share decode steps."""
    barrier = threading.Barrier(len(calls))

    def run(call):
        barrier.wait()
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - returned for the test to look at
            return e

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def cached_is_full_alone_and_together(engine, questions: list[str], n: int, distinct: bool = True) -> list[list[int]]:
    """Each question's `n` cached tokens == its `full` tokens; asked together, the same tokens again; and
    (`distinct`) not every question answered alike. Returns the answers. No stop token before the `n`th
    (min_tokens): a random model's answer is as long as asked, whatever it picks."""
    from cag.runtime.generate import DecodeConfig

    d = DecodeConfig(max_tokens=n, min_tokens=n)
    alone = []
    for q in questions:
        cached = engine.answer(Query("corpus", q, max_tokens=n, decoding=d)).token_ids
        assert (
            len(cached) == n
            and cached == engine.answer(Query("corpus", q, max_tokens=n, mode="full", decoding=d)).token_ids
        )
        alone.append(cached)
    assert not distinct or len({tuple(a) for a in alone}) > 1  # different questions, different answers
    assert (
        together(
            engine,
            [lambda q=q: engine.answer(Query("corpus", q, max_tokens=n, decoding=d)).token_ids for q in questions],
        )
        == alone
    )
    return alone


@pytest.fixture(params=formats("bf16", "int8"))
def tiny_engine(request, tiny_model_dir, monkeypatch):
    """The tiny model decoding in a packed format: those kernels give each row the same bits whatever
    the number of rows (test_packed_products_and_suffix_attention_are_row_invariant), so batched ==
    alone holds exactly, not just usually. (fp32 products go through a BLAS whose summation order
    depends on the row count: there agreement is measured, bench/bench_batch.py.)"""
    from cag.config import get_settings
    from cag.engine import Engine

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", request.param)
    # steps of 16 fixed rows: the tiny model's heads (16 wide) take torch's kernels, which step each request
    # alone by default on CPUs without AMX (cag.runtime.decoder); fixed rows batch them, each step one shape
    monkeypatch.setenv("CAG_DECODE_ROWS", "16")
    return Engine(get_settings())


@pytest.mark.parametrize(
    "kernels",
    [
        "native",
        # oneDNN's bf16 kernel sums a 1536-wide input differently by row count on CPUs without AMX
        # (measured on AMD Zen 4): CAG_DECODE_KERNELS=torch is batch-exact on AMX machines; `auto` runs
        # cag's own kernels elsewhere
        pytest.param(
            "torch",
            marks=pytest.mark.xfail(not native.tiles(), reason="oneDNN bf16 re-blocks its sum here", strict=False),
        ),
    ],
)
def test_packed_products_are_row_invariant(kernels):
    """What exactness in a batch rests on: a row's result does not depend on the other rows."""
    from cag.model.weights import FastLinear

    if kernels == "native" and (why := native.why_not()):
        pytest.skip(f"cag's kernels cannot run here: {why}")
    torch.manual_seed(0)
    with torch.inference_mode():
        for fmt in ("bf16", "int8", "int4"):
            # (576, 960), (576, 3072): SmolLM2's stacked q/k/v and gate/up; the last: an LM head's shape
            for i, o in ((64, 128), (576, 1536), (1536, 576), (576, 960), (576, 3072), (576, 49152)):
                fl = FastLinear(
                    torch.nn.Linear(i, o, bias=False),
                    fmt,
                    backend=backends.AVX512 if kernels == "native" else backends.TORCH,
                )
                x = torch.randn(256, i)
                alone = torch.cat([fl.decode(x[r : r + 1]) for r in range(256)])
                for m in (6, 9, 17, 40, 128, 160, 200, 256):  # over 128 rows: oneDNN's bf16 can re-block the sum
                    assert torch.equal(fl.decode(x[:m]), alone[:m]), (fmt, i, o, m)
                # a question's rows (int8/int4: the bf16 copy), alone or after decode rows in one call
                asked = torch.cat([fl.decode(x[r : r + 1], [(1, True)]) for r in range(40)])
                for m in (2, 17, 33):
                    assert torch.equal(fl.decode(x[:m], [(m, True)]), asked[:m]), (fmt, i, o, m)
                    mixed = fl.decode(x[:m + 5], [(5, False), (m, True)])
                    assert torch.equal(mixed[:5], alone[:5]) and torch.equal(mixed[5:], asked[5 : m + 5]), (
                        fmt,
                        i,
                        o,
                        m,
                    )


def test_suffix_attention_is_row_invariant():
    from cag.runtime.rows import suffix_keys

    torch.manual_seed(0)
    with torch.inference_mode():
        # suffix attention: the width read (suffix_keys) changes with the batch's longest suffix, and
        # the keys past a row's own suffix hold other requests' leftovers (masked)
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        # a slot of a conversation's room: past 512 keys the width grows by blocks of 512
        room, heads, d, rows = 2048, 3, 64, 3
        for dtype, seen in (
            (dt, n) for dt in (torch.float32, torch.bfloat16) for n in (1, 17, 40, 128, 129, 300, 600, 1500)
        ):
            q, k, v = (torch.randn(1, heads, n, d).to(dtype) for n in (rows, room, room))
            outs = []
            for longest in (seen, seen + 9, 100, 130, 700, 1100, room):
                width = suffix_keys(max(seen, longest), room)
                k2, v2 = k.clone(), v.clone()
                k2[:, :, seen:], v2[:, :, seen:] = (torch.randn(1, heads, room - seen, d).to(dtype) for _ in "kv")
                bias = torch.zeros(1, 1, rows, width)
                bias[..., seen:] = float("-inf")
                outs.append(flash(q, k2[:, :, :width], v2[:, :, :width], 0.0, False, attn_mask=bias, scale=d ** -0.5))
            assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs), seen


# torch's CPU flash kernel gives rows bits that depend on the rows beside them at more prefix lengths on
# CPUs without AMX (measured on AMD Zen 4: 5 and 100 keys below), so CAG_DECODE_KERNELS=torch is
# batch-exact on AMX machines only; `auto` attends through cag's kernel on AVX512-BF16 CPUs
@pytest.mark.xfail(not native.tiles(), reason="torch's flash kernel is not row-invariant on this CPU", strict=False)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_attention_rows_do_not_depend_on_the_batch_at_any_prefix_length(dtype):
    """Requests on one prefix attend together: a row's output must be its output alone, and the right
    attention. torch's float32 flash kernel broke the first for prefixes of 1-3 keys past a multiple
    of 512 (513, 1027, 2049 below), which cag.runtime.attention reads in two parts."""
    from types import SimpleNamespace

    from cag.runtime import attention

    torch.manual_seed(0)
    heads, rows, d, room, seen, B = 3, 3, 64, 16, 5, 4
    for n in (5, 100, 512, 513, 1027, 2049, 3001):
        Kp, Vp = (torch.randn(1, heads, n, d).to(dtype) for _ in "kv")
        Ks, Vs = (torch.randn(B, heads, room, d).to(dtype) for _ in "kv")
        q = torch.randn(B, heads, rows, d).to(dtype)
        bias = torch.zeros(B, 1, rows, room)
        bias[..., seen:] = float("-inf")
        group = [(SimpleNamespace(kv=[(Kp, Vp)]), None)]
        together = attention._flash_parts(SimpleNamespace(bias=bias, groups=group), q, Ks, Vs, 0, d ** -0.5)
        alone = torch.cat(
            [
                attention._flash_parts(
                    SimpleNamespace(bias=bias[b : b + 1], groups=group),
                    q[b : b + 1],
                    Ks[b : b + 1],
                    Vs[b : b + 1],
                    0,
                    d**-0.5,
                )
                for b in range(B)
            ]
        )
        assert torch.equal(together, alone), n
        K = torch.cat([Kp.expand(B, -1, -1, -1), Ks[:, :, :seen]], 2).double()
        V = torch.cat([Vp.expand(B, -1, -1, -1), Vs[:, :, :seen]], 2).double()
        want = torch.softmax(q.double() @ K.transpose(-1, -2) * d ** -0.5, -1) @ V
        assert (together.double() - want).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2), n


def test_concurrent_questions_are_decoded_together_with_their_alone_tokens(tiny_engine, small_corpus):
    tiny_engine.ingest(str(small_corpus))
    alone = [tiny_engine.answer(Query("corpus", q, max_tokens=16)).token_ids for q in QUESTIONS]
    steps0 = tiny_engine.stats["decode_steps"]
    rows0 = tiny_engine.stats["decode_rows"]
    got = together(
        tiny_engine, [lambda q=q: tiny_engine.answer(Query("corpus", q, max_tokens=16)).token_ids for q in QUESTIONS]
    )
    stats = tiny_engine.stats
    assert tiny_engine.lm.attn_dtype == torch.bfloat16  # packed formats attend over bf16 K/V
    assert got == alone
    assert stats["batch_max"] > 1 and stats["decode_rows"] - rows0 > 1.5 * (stats["decode_steps"] - steps0)
    # every slot given back (the padding slot stays)
    assert stats["decode_active"] == 0 and tiny_engine.decoder.slots.in_use == (tiny_engine.decoder.pad is not None)


def test_requests_decoded_one_row_a_step_get_their_batched_tokens(tiny_engine, small_corpus, monkeypatch):
    """Fixed rows of one (CAG_DECODE_ROWS=1: each request a step of its own, a question a forward of its
    own), run eagerly on the CPU: the same tokens as one forward for the batch, one row a step, every slot
    given back (the padding slot stays taken)."""
    from cag.config import get_settings
    from cag.engine import Engine

    tiny_engine.ingest(str(small_corpus))
    batched = together(
        tiny_engine, [lambda q=q: tiny_engine.answer(Query("corpus", q, max_tokens=16)).token_ids for q in QUESTIONS]
    )
    monkeypatch.setenv("CAG_DECODE_ROWS", "1")
    engine = Engine(get_settings(), lm=tiny_engine.lm)
    apart = together(
        engine, [lambda q=q: engine.answer(Query("corpus", q, max_tokens=16)).token_ids for q in QUESTIONS]
    )
    decoder = engine.decoder
    assert apart == batched and decoder.rows == 1 and decoder.graphs is None
    assert decoder.stats["decode_steps"] > 0 and decoder.stats["batch_max"] == 1
    assert engine.stats["decode_active"] == 0 and decoder.slots.in_use == 1 and decoder.pad is not None


def test_full_and_cag_in_one_batch_still_agree(tiny_engine, small_corpus, monkeypatch):
    """`full` prefills its own prefix and joins the same batch: cag == full holds batched too."""
    monkeypatch.setenv("CAG_KV_DTYPE", "float32")
    from cag.config import get_settings
    from cag.engine import Engine

    engine = Engine(get_settings(), lm=tiny_engine.lm)
    engine.ingest(str(small_corpus))
    calls = [lambda q=q, m=m: engine.answer(Query("corpus", q, mode=m, max_tokens=16)).token_ids
             for q in QUESTIONS[:3] for m in ("cag", "full")]
    got = together(engine, calls)
    assert got[0::2] == got[1::2]


def test_a_failing_or_stopped_request_leaves_the_batch_and_the_others_finish(tiny_engine, small_corpus):
    tiny_engine.ingest(str(small_corpus))
    alone = {q: tiny_engine.answer(Query("corpus", q, max_tokens=20)).token_ids for q in QUESTIONS[:4]}

    class Boom(Exception):
        pass

    calls_seen = {"fail": 0, "stop": 0}

    def failing() -> bool:  # the client's check itself fails at its third token
        calls_seen["fail"] += 1
        if calls_seen["fail"] == 3:
            raise Boom("the client's check failed")
        return False

    def stopping() -> bool:  # the client goes away after its third token
        calls_seen["stop"] += 1
        return calls_seen["stop"] >= 3

    calls = [lambda: tiny_engine.answer(Query("corpus", QUESTIONS[0], max_tokens=20), should_stop=failing),
             lambda: tiny_engine.answer(Query("corpus", QUESTIONS[1], max_tokens=20), should_stop=stopping),
             lambda: tiny_engine.answer(Query("corpus", QUESTIONS[2], max_tokens=20)).token_ids,
             lambda: tiny_engine.answer(Query("corpus", QUESTIONS[3], max_tokens=20)).token_ids]
    failed, stopped, a, b = together(tiny_engine, calls)
    assert isinstance(failed, Boom)
    assert stopped.token_ids == alone[QUESTIONS[1]][:2]  # checked before prefill, then after tokens 1 and 2
    assert [a, b] == [alone[QUESTIONS[2]], alone[QUESTIONS[3]]]
    assert tiny_engine.decoder.slots.in_use == (tiny_engine.decoder.pad is not None)  # the padding slot stays


def test_a_request_stopped_while_waiting_never_starts(tiny_engine, small_corpus):
    from cag.runtime.kv_cache import Cancelled

    tiny_engine.ingest(str(small_corpus))
    with pytest.raises(Cancelled):
        tiny_engine.answer(Query("corpus", QUESTIONS[0]), should_stop=lambda: True)


def test_ask_many_keeps_order_and_reports_each_failure(tiny_engine, small_corpus, monkeypatch):
    tiny_engine.ingest(str(small_corpus))
    qs = [QUESTIONS[0], "x " * 400, QUESTIONS[1]]  # the middle one is longer than CAG_QUESTION_ROOM
    out = list(ask_many(tiny_engine, "corpus", qs, max_tokens=8))
    assert [q for q, _ in out] == qs
    assert isinstance(out[1][1], TooLarge)
    assert out[0][1].token_ids == tiny_engine.answer(Query("corpus", QUESTIONS[0], max_tokens=8)).token_ids


def _cag(env: dict, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["python", "-m", "cag", *args], env=env, cwd=REPO, capture_output=True, text=True,
                          input=stdin, timeout=300)


def test_cli_questions_file(tiny_model_dir, small_corpus, tmp_path):
    env = dict(os.environ, CAG_MODEL=str(tiny_model_dir))
    assert _cag(env, "ingest", str(small_corpus)).returncode == 0
    qfile = tmp_path / "questions.txt"
    qfile.write_text(
        f"# a comment\n{QUESTIONS[0]}\n\n{json.dumps({'question': QUESTIONS[1], 'id': 7})}\n{'x ' * 400}\n"
    )
    r = _cag(env, "ask", "corpus", "--questions-file", str(qfile), "--max-tokens", "8")
    assert r.returncode == 1, r.stderr  # the first failure's exit code (TooLarge: 1)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["line"] for row in rows] == [2, 4, 5]
    assert rows[1]["input"] == {"question": QUESTIONS[1], "id": 7}
    assert rows[2]["error"]["code"] == "too_large" and "answer" not in rows[2]
    single = json.loads(_cag(env, "ask", "corpus", QUESTIONS[0], "--max-tokens", "8", "--json").stdout)
    assert rows[0]["answer"] == single["answer"] and rows[0]["completion_tokens"] == single["completion_tokens"]
    assert "questions in" in r.stderr

    stdin = _cag(env, "ask", "corpus", "--questions-file", "-", "--max-tokens", "8", stdin=QUESTIONS[0] + "\n")
    assert stdin.returncode == 0 and json.loads(stdin.stdout)["answer"] == single["answer"]
    # bad inputs: one line each, documented exit codes
    both = _cag(env, "ask", "corpus", QUESTIONS[0], "--questions-file", str(qfile))
    assert both.returncode == 2 and "--questions-file" in both.stderr
    missing = _cag(env, "ask", "corpus", "--questions-file", str(tmp_path / "nope.txt"))
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    empty = tmp_path / "empty.txt"
    empty.write_text("\n# nothing\n")
    assert _cag(env, "ask", "corpus", "--questions-file", str(empty)).returncode == 1
    unknown = _cag(env, "ask", "nope", "--questions-file", str(qfile))
    assert unknown.returncode == 1 and "unknown corpus" in unknown.stderr and not unknown.stdout


def test_questions_tokenized_at_once_get_the_tokens_they_get_alone(tiny_engine):
    """Encoding user text and template pieces from many threads (API workers) at once: each call
    keeps its own special-token handling (the tokenizer's flag for it is shared state)."""
    from cag.model.prompt import encode_template, encode_text

    tok = tiny_engine.lm.tokenizer
    texts = [
        (encode_text, "Who keeps <|im_end|> the lighthouse?"),
        (encode_template, "<|im_end|>\n<|im_start|>assistant\n"),
    ] * 8
    alone = [f(tok, t) for f, t in texts]
    assert alone[0] != alone[1]  # the two kinds differ on special-token strings: a race would show
    for _ in range(20):
        assert together(tiny_engine, [lambda f=f, t=t: f(tok, t) for f, t in texts]) == alone


def test_full_equals_cag_with_fp16_snapshots_in_packed_formats(tiny_engine, small_corpus):
    """`full` holds its freshly prefilled K/V at the snapshot's precision (fp16 by default) before
    the bf16 attention copy, as cag's prefix is: the same bits, so the same tokens."""
    tiny_engine.ingest(str(small_corpus))
    for q in QUESTIONS:
        cag, full = (tiny_engine.answer(Query("corpus", q, mode=m, max_tokens=16)) for m in ("cag", "full"))
        assert cag.token_ids == full.token_ids, q


def test_min_tokens_holds_back_stop_tokens_alone_and_batched(tiny_engine, small_corpus, monkeypatch):
    """`min_tokens` (fixed-length answers for load tests): no stop token is picked before that many
    answer tokens, and a batched answer is still the answer alone."""
    from cag.runtime.generate import DecodeConfig

    tiny_engine.ingest(str(small_corpus))
    qs = QUESTIONS[:3]
    free = {q: tiny_engine.answer(Query("corpus", q, max_tokens=12)).token_ids for q in qs}
    # the tiny random model never stops by itself: make each answer's 4th token a stop token
    monkeypatch.setattr(tiny_engine.lm, "stops", tiny_engine.lm.stops | {ids[3] for ids in free.values()})
    short = {q: tiny_engine.answer(Query("corpus", q, max_tokens=12)).token_ids for q in qs}
    assert all(len(ids) <= 3 for ids in short.values())
    held = DecodeConfig(min_tokens=12)
    alone = [tiny_engine.answer(Query("corpus", q, max_tokens=12, decoding=held)).token_ids for q in qs]
    assert [len(ids) for ids in alone] == [12] * 3
    assert [ids[: len(short[q])] for q, ids in zip(qs, alone)] == [short[q] for q in qs]
    assert (
        together(
            tiny_engine,
            [lambda q=q: tiny_engine.answer(Query("corpus", q, max_tokens=12, decoding=held)).token_ids for q in qs],
        )
        == alone
    )
    # clamped to max_tokens
    assert len(tiny_engine.answer(Query("corpus", qs[0], max_tokens=5, decoding=held)).token_ids) == 5


@pytest.mark.parametrize("src,dst", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_a_prefix_converted_through_float32_has_the_direct_conversions_bits(src, dst):
    """PrefixKV.of converts fp16 <-> bf16 snapshots through float32 (twice as fast): every finite value,
    subnormal and infinity must get exactly the bits of torch's direct conversion."""
    from cag.runtime.slots import PrefixKV

    torch.manual_seed(0)
    x = (torch.randn(1, 3, 512, 64) * torch.logspace(-9, 5, 64)).to(src)  # spans both types' subnormals and overflow
    x[0, 0, 0, :3] = torch.tensor([float("inf"), -float("inf"), -0.0]).to(src)
    k, v = PrefixKV.of([(x, x.neg())], dst, "cpu").kv[0]
    assert torch.equal(k.view(torch.int16), x.to(dst).view(torch.int16))
    assert torch.equal(v.view(torch.int16), x.neg().to(dst).view(torch.int16))


def test_cuda_cascade_pieces_merge_to_the_attention():
    """cag.runtime.attention's CUDA way, its pieces run on the CPU: the suffix by a float32 softmax (keys past a
    request's own masked, a different count per request), the prefix by a kernel that returns its
    log-sum-exp (the CPU flash kernel standing in for CUDA's), merged: the attention over both."""
    from types import SimpleNamespace

    from cag.runtime import attention

    torch.manual_seed(0)
    heads, rows, d, room, B, n = 3, 3, 64, 32, 2, 700
    seen = torch.tensor([5, 20])  # suffix keys each request sees
    Kp, Vp = (torch.randn(1, heads, n, d).bfloat16() for _ in "kv")
    Ks, Vs = (torch.randn(B, heads, room, d).bfloat16() for _ in "kv")
    q = torch.randn(B, heads, rows, d).bfloat16()
    hidden = (torch.arange(room) >= seen[:, None])[:, None, None, :].expand(B, 1, rows, room)  # (B, 1, M, L)
    r = SimpleNamespace(hidden=hidden, groups=[(SimpleNamespace(kv=[(Kp, Vp)]), None)])
    got = attention._flash_parts(r, q, Ks, Vs, 0, d ** -0.5, attention._cuda_suffix, attention._prefix_parts)
    assert got.dtype == torch.float32 and got.shape == (B, heads, rows, d)
    for b in range(B):
        K = torch.cat([Kp[0], Ks[b, :, : seen[b]]], 1).double()  # (H, n + seen, D)
        V = torch.cat([Vp[0], Vs[b, :, : seen[b]]], 1).double()
        want = torch.softmax(q[b].double() @ K.transpose(-1, -2) * d ** -0.5, -1) @ V
        assert (got[b].double() - want).abs().max() < 2e-3, b  # the prefix kernel returns bf16 outputs
