"""Exact by construction, on the real embedded model with the settings a user gets (`auto` weights and
kernels): a refreshed snapshot is the rebuilt one bit for bit, and cag == full for conversations, alone
and batched (bench/scenarios.py draws the scenarios; bench/bench_exactness.py runs hundreds).

The two reproductions of the exactness issue come first, as named regressions: both failed before the
knowledge prefill ran in fixed, aligned blocks over stored-precision keys (cag.runtime.kv_cache)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from bench import scenarios
from cag.answering.query import Query
from cag.runtime import knowledge_kv

from .conftest import HANDBOOK
from .cpu import needs_bf16

pytestmark = pytest.mark.real

TURN2 = [
    {"role": "user", "content": "Who approves travel?"},
    {
        "role": "assistant",
        "content": "The company accepts travel as a normal part of the job. The company has a policy of allowing "
        "travel to and from the office, and they also have a policy of allowing travel to and from the beach.\n\n"
        "The company also accepts travel to and from the ship, and they have a policy of allowing travel to and",
    },
    {"role": "user", "content": "And what is the limit for that?"},
]


@pytest.fixture(scope="module")
def auto_lm(models_dir):
    """The embedded model as a user's `cag` loads it: weights and decode kernels chosen by `auto`."""
    from cag.config import DEFAULT_MODEL
    from cag.model.loading import load_model

    return load_model(DEFAULT_MODEL, models_dir, weights="auto", kernels="auto")


def _engine(lm, home, **settings):
    from cag.config import get_settings
    from cag.engine import Engine

    return Engine(get_settings(home=home, **settings), lm=lm)


def test_refreshed_handbook_answers_a_second_turn_as_full_does(auto_lm, tmp_path):
    """Reproduction 1: the README's tour, one sentence appended, `cag ingest handbook` (a refresh), then
    the second turn of a conversation: it split from `full` at answer token 14."""
    src = tmp_path / "handbook"
    shutil.copytree(HANDBOOK, src)
    engine = _engine(auto_lm, tmp_path / "home")
    engine.ingest(str(src))
    with open(src / "expenses-and-travel.md", "a") as f:
        f.write("Travel over 500 EUR needs a director.\n")
    assert engine.ingest("handbook").status == "refreshed"
    cag = engine.answer(Query("handbook", None, messages=TURN2, max_tokens=32))
    full = engine.answer(Query("handbook", None, messages=TURN2, max_tokens=32, mode="full"))
    assert cag.token_ids == full.token_ids and len(cag.token_ids) > 14


def test_a_refresh_of_the_last_document_is_the_rebuild_bit_for_bit(auto_lm, tmp_path):
    """Reproduction 2: a corpus several blocks long, its last document edited: the refresh reuses the
    blocks before it and stores what `--force` stores, with the same key."""
    src = tmp_path / "handbook"
    shutil.copytree(HANDBOOK, src)
    (src / "zz-last.md").write_text("The canteen opens at 11:30. Soup is free on Fridays.\n")
    engine = _engine(auto_lm, tmp_path / "home")
    engine.ingest(str(src))
    with open(src / "zz-last.md", "a") as f:
        f.write("Desserts cost 2 EUR.\n")
    refreshed = engine.ingest("handbook")
    assert refreshed.status == "refreshed" and refreshed.reused_tokens >= refreshed.n_tokens - 512
    assert refreshed.reused_tokens % knowledge_kv.block(engine.prefill(refreshed.n_tokens)) == 0
    before = load_file(refreshed.path)
    answer = engine.answer(Query("handbook", "When does the canteen open?", max_tokens=16)).token_ids
    rebuilt = engine.ingest("handbook", force=True)
    assert rebuilt.snapshot == refreshed.snapshot and rebuilt.status == "built"
    after = load_file(rebuilt.path)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    engine.evict()
    assert engine.answer(Query("handbook", "When does the canteen open?", max_tokens=16)).token_ids == answer


# CI-sized: seeds drawn small (at most 5 documents, 3 turns); bench/bench_exactness.py draws the full range.
# 19 draws a slot of 256 tokens: its knowledge is longer, so prefilled in blocks where rows would be the default
SEEDS = [11, 12, 13, 14, 19]


@pytest.mark.parametrize("seed", SEEDS)
def test_drawn_scenarios_hold_exactly(auto_lm, tmp_path, seed):
    s = scenarios.draw(seed, max_docs=5, max_turns=3)
    out = scenarios.run(s, _engine(auto_lm, tmp_path / "home", kv_dtype=s.kv_dtype), tmp_path / "corpus")
    assert out.checks >= 1 and out.mismatches == [], (s.describe(), out.mismatches)


def test_an_answers_kv_is_kept_and_the_next_turn_prefills_only_its_question(auto_lm, tmp_path):
    """With cag's kernels every row is a decode row (cag.runtime.rows.flat), so an answer's K/V are what a
    prefill of it writes: they are kept with the conversation, a turn reuses the previous answer, and the
    tokens stay those of a recomputation (kept conversations cleared) and of `full`."""
    engine = _engine(auto_lm, tmp_path / "home")
    if not (engine.decoder.step is not None and engine.decoder.step.flat):
        pytest.skip(f"decode kernels {auto_lm.kernels}: answers are not kept on this path")
    n = engine.ingest(str(HANDBOOK)).n_tokens
    history, turns = [], []
    for q in ("Who approves travel expenses above the limit, and what is the process for that approval?",
              "And what is the limit?", "How many days of annual leave do I get?"):
        messages = history + [{"role": "user", "content": q}]
        kept = engine.answer(Query("handbook", None, messages=messages, max_tokens=32))
        engine.kept.clear()
        recomputed = engine.answer(Query("handbook", None, messages=messages, max_tokens=32))
        full = engine.answer(Query("handbook", None, messages=messages, max_tokens=32, mode="full"))
        assert kept.token_ids == recomputed.token_ids == full.token_ids
        turns.append(kept)
        history = messages + [{"role": "assistant", "content": kept.answer}]  # `recomputed` kept this turn again
    for before, after in zip(turns, turns[1:]):  # more than the previous prompt is reused: its answer too
        assert after.conversation_tokens > before.prompt_tokens - n
        assert after.prompt_tokens - n - after.conversation_tokens < 40  # the new question's turn, not the answer again


@pytest.mark.parametrize("weights", ["int8", pytest.param("bf16", marks=needs_bf16)])
def test_seed_1004_batched_on_torchs_kernels_equals_alone(models_dir, tmp_path, weights):
    """Found by bench_exactness (int8 and bf16 weights on torch's kernels, AMD Zen 4): a turn decoded beside
    two other questions split from its answer alone, and with bf16 a second turn split from `full` (a kept
    conversation made its question one product of fewer rows). torch's CPU kernels sum a row differently beside other
    rows where the CPU has no AMX; each request now steps alone there (cag.runtime.decoder), and conversations
    are kept only where every row is a decode row (not on torch's kernels), so every request meets the same
    shapes alone, batched and in `full`."""
    from cag.config import DEFAULT_MODEL
    from cag.model.loading import load_model

    lm = load_model(DEFAULT_MODEL, models_dir, weights=weights, kernels="torch")
    s = scenarios.draw(1004)
    assert s.batched and s.kv_dtype == "int8"
    out = scenarios.run(s, _engine(lm, tmp_path / "home", kv_dtype=s.kv_dtype), tmp_path / "corpus")
    assert out.checks == 9 and out.mismatches == [], out.mismatches


def test_the_harness_skips_a_pair_it_cannot_run_and_says_why(monkeypatch, tmp_path):
    """fp32 weights on cag's AVX-512 kernels are refused (fp32 K/V; or the library does not run here): the harness
    names the pair and the reason and runs the others; with none left it exits 2, the skip in its results file."""
    import bench.common
    from bench import bench_exactness

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    assert ("fp32", "avx512") not in bench_exactness.configs_here()
    assert bench_exactness.main(["--configs", "fp32/avx512:1", "--no-cost", "--name", "skipped"]) == 2
    table = (tmp_path / "skipped.md").read_text()
    assert "| fp32/avx512: skipped, CAG_DECODE_KERNELS=avx512 " in table
