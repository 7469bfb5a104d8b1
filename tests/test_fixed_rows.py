"""Fixed-row decode steps (CAG_DECODE_ROWS; CUDA's default, cag.runtime.decoder): every decode step has
the same number of rows, padding rows filling it, so a request's row meets one shape whatever else
decodes. Checked here with torch's CPU kernels in float32, whose product sums move with the row count
as cuBLAS's do (tests/test_cuda.py runs the same on a GPU), on one thread: torch's CPU flash kernel
gives the batch elements a second thread takes other last bits than the first thread's."""

from __future__ import annotations

import pytest
import torch

from cag.answering.query import Query
from cag.runtime.generate import DecodeConfig
from cag.runtime.requests import Request, chunks, fixed_rows
from cag.runtime.rows import Part
from cag.runtime.slots import PrefixKV, Slots
from tests.conftest import _tiny
from tests.test_batch import QUESTIONS, cached_is_full_alone_and_together, together


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """SmolLM2's widths (hidden 576, 9 heads over 3 K/V heads of 64), random, 2 layers: products wide
    enough that the BLAS blocks a sum differently by row count."""
    return _tiny(tmp_path_factory, "wide-model", hidden=576, heads=9, kv_heads=3, init=0.06)


def engine_for(model_dir, monkeypatch, rows: int, max_batch: int = 6):
    from cag.config import get_settings
    from cag.engine import Engine

    monkeypatch.setenv("CAG_MODEL", str(model_dir))
    monkeypatch.setenv("CAG_DECODE_KERNELS", "torch")  # torch's kernels: CUDA's way, on the CPU
    monkeypatch.setenv("CAG_DTYPE", "float32")
    monkeypatch.setenv("CAG_KV_DTYPE", "float32")
    monkeypatch.setenv("CAG_DECODE_ROWS", str(rows))
    monkeypatch.setenv("CAG_MAX_BATCH", str(max_batch))
    monkeypatch.setenv("CAG_THREADS", "1")  # module doc
    return Engine(get_settings())


def test_fixed_rows_resolves_auto_per_device():
    assert fixed_rows("cuda", 16) == 16 and fixed_rows("cpu", 16) == 0  # auto
    # torch's kernels without AMX
    assert fixed_rows("cpu", 16, alone=True) == 1 and fixed_rows("cpu", 16, 4, alone=True) == 4
    assert fixed_rows("cpu", 16, 4) == 4 and fixed_rows("cuda", 8, 32) == 8  # never past max_batch
    assert fixed_rows("cuda", 16, 1) == 1  # one request a step


def test_chunks_group_by_prefix_and_cap_rows():
    a, b = PrefixKV([], 0), PrefixKV([], 0)
    reqs = [Request(p, [1], DecodeConfig()) for p in (a, b, a, a, b, a)]
    reqs[5].length = 512  # past the room the fixed steps read: alone
    got = chunks(reqs, 2, 512)
    assert [([reqs.index(r) for r in c], seen) for c, seen in got] == [
        ([0, 2], 512),
        ([3], 512),
        ([1, 4], 512),
        ([5], None),
    ]


def test_a_row_is_the_same_at_any_place_beside_any_rows(wide_model_dir, one_thread):
    """The step itself: W rows over one prefix, a request's logits and K/V bit for bit the same alone
    (the rest padding) and at another row beside other requests."""
    from transformers import AutoModelForCausalLM

    from cag.runtime import step as lean

    model = AutoModelForCausalLM.from_pretrained(wide_model_dir, dtype=torch.float32).eval()
    s = lean.for_model(model)
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(1)
    prefix = PrefixKV.of([(torch.randn(1, 3, 40, d), torch.randn(1, 3, 40, d)) for _ in range(2)], torch.float32, "cpu")
    W, seen = 4, 64

    def step(toks, slots, starts, buffers):
        part = Part(torch.tensor(toks)[:, None], [prefix] * W, torch.tensor(slots), torch.tensor(starts), seen=seen)
        return s.run([part], buffers)[0]

    def fresh():
        b = Slots(2, 3, d, 64, W + 1, torch.float32)
        for t in (*b.k, *b.v):  # every request has 5 suffix keys written already
            t[:, :, :5] = torch.randn(t[:, :, :5].shape, generator=torch.Generator().manual_seed(2))
        return b

    alone, with_others = fresh(), fresh()
    lone = step([7, 0, 0, 0], [2, 4, 4, 4], [5, 0, 0, 0], alone)[0]  # padding rows: slot 4, position 0
    mixed = step([3, 11, 7, 19], [0, 1, 2, 3], [5, 5, 5, 5], with_others)[2]
    assert torch.equal(lone, mixed)
    for ka, km in zip(alone.k, with_others.k):
        assert torch.equal(ka[2, :, :6], km[2, :, :6])
    unpadded = s.run([Part(torch.tensor([[7]]), [prefix], torch.tensor([2]), torch.tensor([5]), seen=seen)], fresh())[
        0
    ][0]
    assert torch.allclose(unpadded, lone, atol=1e-4)  # the same math at another shape (its last bits may move)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # module doc
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("rows", [4, 1])
def test_batched_equals_alone_at_fixed_rows(wide_model_dir, small_corpus, monkeypatch, rows):
    """Six concurrent questions in steps of 4 rows (two steps a token: 4 + 2 and padding), or of 1: each
    answers as alone and as `full` does."""
    engine = engine_for(wide_model_dir, monkeypatch, rows)
    assert engine.decoder.rows == rows
    engine.ingest(str(small_corpus), name="corpus")
    cached_is_full_alone_and_together(engine, QUESTIONS, 12)
    assert engine.decoder.slots.capacity == 7 and engine.decoder.pad is not None  # six requests and the padding slot
    assert engine.stats["batch_max"] <= rows


@pytest.mark.parametrize("rows", [4, 0])
def test_a_product_that_moves_with_the_row_count_moves_no_answer(tiny_model_dir, small_corpus, monkeypatch, rows):
    """The LM head made to depend on its row count, as a cuBLAS kernel picked by shape does (here far
    more than last bits): at fixed rows every step has one row count, so batched == alone still; with
    as many rows as decode (0, the control) the same probe moves the batched answers."""
    engine = engine_for(tiny_model_dir, monkeypatch, rows)
    engine.decoder.rows = rows  # 0: as many rows as decode (auto would step alone here on torch's kernels without AMX)
    engine.ingest(str(small_corpus), name="corpus")
    step = engine.decoder.step
    head, noise = step.head, torch.randn(len(engine.lm.tokenizer), generator=torch.Generator().manual_seed(3))
    step.head = lambda x: head(x) + (x.shape[0] - 1) * noise  # (R, V)
    d = DecodeConfig(max_tokens=12, min_tokens=12)
    alone = [engine.answer(Query("corpus", q, decoding=d)).token_ids for q in QUESTIONS]
    batched = together(engine, [lambda q=q: engine.answer(Query("corpus", q, decoding=d)).token_ids for q in QUESTIONS])
    assert (batched == alone) == bool(rows)


def test_fixed_rows_over_two_snapshots_at_once(wide_model_dir, small_corpus, tmp_path, monkeypatch):
    """Requests over two corpora decode at once, each prefix in steps of its own: each answers as alone."""
    engine = engine_for(wide_model_dir, monkeypatch, 4)
    other = tmp_path / "other"
    other.mkdir()
    (other / "d.md").write_text("The museum opens at nine. The curator is Ivo Lind, who restores clocks.\n")
    engine.ingest(str(small_corpus), name="corpus")
    engine.ingest(str(other), name="other")
    d = DecodeConfig(max_tokens=10, min_tokens=10)
    calls = [("corpus", q) for q in QUESTIONS[:3]] + [("other", q) for q in QUESTIONS[3:]]
    alone = [engine.answer(Query(c, q, decoding=d)).token_ids for c, q in calls]
    assert (
        together(engine, [lambda c=c, q=q: engine.answer(Query(c, q, decoding=d)).token_ids for c, q in calls]) == alone
    )


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "olmo2", "granite"])
def test_the_few_kernel_step_is_the_same_math_and_row_invariant(family, one_thread):
    """CUDA's step (LeanStep few=True: fused norms, q and k roped in one pass, the attention merged in five
    kernels), run here with torch's CPU kernels: within float32 rounding of the op-for-op step for every
    family, a row's bits the same alone and beside other rows, and far fewer ops than the op-for-op step."""
    from bench.kernel_count import step_writes
    from cag.model import stacked_products
    from cag.runtime import step as lean
    from tests.test_families import build

    model = build(family, hidden=128, heads=4, kv_heads=2)  # heads of 32
    stacked_products.stack(model)
    torch.manual_seed(2)
    prefix = PrefixKV.of(
        [(torch.randn(1, 2, 30, 32), torch.randn(1, 2, 30, 32)) for _ in range(2)], torch.bfloat16, "cpu"
    )
    W = 4

    def run(s, toks, slots, starts):
        b = Slots(2, 2, 32, 64, W + 1, torch.bfloat16)
        part = Part(torch.tensor(toks)[:, None], [prefix] * W, torch.tensor(slots), torch.tensor(starts), seen=64)
        with torch.inference_mode():
            return s.run([part], b)[0], b

    few, ref = lean.LeanStep(model, few=True), lean.LeanStep(model, few=False)
    assert few.few and not ref.few
    a, ka = run(few, [5, 0, 0, 0], [1, 4, 4, 4], [0, 0, 0, 0])
    b, kb = run(few, [9, 17, 5, 3], [0, 2, 1, 3], [0, 0, 0, 0])
    assert torch.equal(a[0], b[2])
    assert all(torch.equal(x[1, :, :1], y[1, :, :1]) for x, y in zip(ka.k + ka.v, kb.k + kb.v))
    r, _ = run(ref, [5, 0, 0, 0], [1, 4, 4, 4], [0, 0, 0, 0])
    assert torch.allclose(a[0], r[0], atol=1e-4, rtol=1e-4)
    # two layers: the pass's own ops (rows, embedding, head) weigh more than at 30 (bench.kernel_count: 803 vs 1,620)
    assert step_writes(model, prefix, W, True, seen=64).n < 0.65 * step_writes(model, prefix, W, False, seen=64).n
