"""Conversations (cag.answering.chat, cag.runtime.kept_conversations): the whole conversation is the prompt's suffix,
its K/V kept between turns where every row is a decode row (cag's kernels), and every turn exact: reused == evicted and
recomputed == `full`, alone and batched."""

from __future__ import annotations

import threading

import pytest
import torch

from cag.answering import chat
from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.errors import BadInput, ContextExceeded
from cag.kernels import native
from tests.cpu import formats

Q1 = "Who keeps the lighthouse?"
Q2 = "And when does the ferry leave?"
Q3 = "Which bread is sold on Tuesdays?"


def conversation(engine, turns: list[str], mode: str = "cag", system: str | None = None, max_tokens: int = 12):
    """Ask each question with the history so far (the answers the engine gave); the answers."""
    messages = [{"role": "system", "content": system}] if system else []
    out = []
    for q in turns:
        messages.append({"role": "user", "content": q})
        a = engine.answer(Query("corpus", None, mode=mode, max_tokens=max_tokens, messages=messages))
        out.append(a)
        messages.append({"role": "assistant", "content": a.answer or "..."})
    return out


def history(questions: list[str], answers) -> list[dict]:
    messages = []
    for q, a in zip(questions, answers):
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a.answer or "..."}]
    return messages[:-1]


@pytest.fixture
def engine(tiny_engine, small_corpus):
    tiny_engine.ingest(str(small_corpus))
    return tiny_engine


@pytest.fixture
def keeping(tiny64_model_dir, small_corpus, monkeypatch):
    """An engine that keeps conversations: int4 weights on cag's kernels (`auto` picks this CPU's: AVX-512,
    AMX or AVX2)."""
    monkeypatch.setenv("CAG_MODEL", str(tiny64_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    e = Engine(get_settings())
    if not e.decoder.step.flat:
        pytest.skip(f"cag's kernels do not run here: {e.lm.kernels_why}")
    e.ingest(str(small_corpus))
    return e


FORMATS = formats(("tiny", "fp32", "torch"), ("tiny", "bf16", "torch"), ("tiny", "int4", "torch"),
                  ("tiny64", "int4", "avx512"), ("tiny64", "bf16", "avx512"), ("tiny64", "int4", "avx2"))


@pytest.mark.parametrize("model,weights,kernels", FORMATS)
def test_a_conversation_is_exact_reused_recomputed_and_full(
    request, small_corpus, monkeypatch, model, weights, kernels
):
    if kernels == "avx2" and not native.load_avx2() or kernels not in ("torch", "avx2") and native.load() is None:
        pytest.skip(f"cag's {kernels} kernels do not run here: {native.reason()}")
    monkeypatch.setenv("CAG_MODEL", str(request.getfixturevalue(f"{model}_model_dir")))
    monkeypatch.setenv("CAG_WEIGHTS", weights)
    monkeypatch.setenv("CAG_DECODE_KERNELS", kernels)
    engine = Engine(get_settings())
    engine.ingest(str(small_corpus))
    keeps = kernels != "torch"  # every row a decode row: kept; torch's kernels: each turn prefills its conversation
    assert engine.decoder.step.flat == keeps
    kept = conversation(engine, [Q1, Q2, Q3])
    assert [a.conversation_tokens > 0 for a in kept] == [False, keeps, keeps]  # turns 2 and 3 reuse the last one
    assert [a.cached_tokens - a.conversation_tokens for a in kept] == [kept[0].cached_tokens] * 3  # the snapshot
    assert kept[0].prompt_tokens < kept[1].prompt_tokens < kept[2].prompt_tokens
    recomputed, full = [], conversation(engine, [Q1, Q2, Q3], mode="full")
    for i in range(3):  # each turn recomputed from the snapshot alone, over the same history
        engine.kept.clear()
        recomputed.append(
            engine.answer(Query("corpus", None, max_tokens=12, messages=history([Q1, Q2, Q3][: i + 1], kept)))
        )
    assert all(a.conversation_tokens == 0 for a in recomputed) and all(a.mode == "full" for a in full)
    ids = lambda answers: [a.token_ids for a in answers]  # noqa: E731
    assert ids(kept) == ids(recomputed) == ids(full)
    again = engine.answer(Query("corpus", Q1, max_tokens=12))  # all but its last token kept: one question row left
    if keeps:
        assert again.conversation_tokens == again.prompt_tokens - again.cached_tokens + again.conversation_tokens - 1
    assert again.token_ids == kept[0].token_ids


def test_one_user_message_is_a_plain_question(engine):
    plain = engine.answer(Query("corpus", Q1, max_tokens=12))
    assert (
        engine.answer(Query("corpus", None, max_tokens=12, messages=[{"role": "user", "content": Q1}])).token_ids
        == plain.token_ids
    )


def test_history_and_system_messages_change_the_prompt(engine):
    alone = engine.answer(Query("corpus", Q2, max_tokens=12))
    turns = conversation(engine, [Q1, Q2])
    assert turns[1].prompt_tokens > alone.prompt_tokens
    told = conversation(engine, [Q1], system="Answer in French.")[0]
    assert told.prompt_tokens > turns[0].prompt_tokens


def test_an_edited_turn_reuses_only_up_to_the_edit(keeping):
    engine = keeping
    conversation(engine, [Q1, Q2])
    edited = [{"role": "user", "content": Q3}, {"role": "assistant", "content": "rye"}, {"role": "user", "content": Q2}]
    a = engine.answer(Query("corpus", None, max_tokens=12, messages=edited))
    assert a.conversation_tokens < 5  # at most the shared first tokens of the two first questions
    engine.kept.clear()
    assert engine.answer(Query("corpus", None, max_tokens=12, messages=edited)).token_ids == a.token_ids


def test_interleaved_and_concurrent_conversations_keep_their_tokens(keeping):
    engine, questions = keeping, [[Q1, Q2, Q3], [Q3, Q1, Q2], [Q2, Q3, Q1], [Q1, Q3, Q2]]
    alone = [[a.token_ids for a in conversation(engine, qs)] for qs in questions]
    engine.kept.clear()
    out: dict[int, list] = {}

    def run(i):
        out[i] = [a.token_ids for a in conversation(engine, questions[i])]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(len(questions))] == alone
    assert engine.stats["conversation_hits"] >= 8


def test_kept_conversations_are_bounded_and_evicted(request, monkeypatch):
    monkeypatch.setenv("CAG_CONVERSATION_BYTES", "60000")
    engine = request.getfixturevalue("keeping")
    first = conversation(engine, [Q1, Q2, Q3])
    for qs in ([Q2, Q3], [Q3, Q1]):
        conversation(engine, qs)
    assert engine.kept.nbytes <= 60000 and engine.stats["conversation_evictions"] > 0
    again = conversation(engine, [Q1, Q2, Q3])
    assert [a.token_ids for a in again] == [a.token_ids for a in first]


@pytest.mark.parametrize("messages,match", [
    ([], "no messages"),
    ([{"role": "system", "content": "Be brief."}], "no user message"),
    ([{"role": "user", "content": Q1}, {"role": "system", "content": "Be brief."}], "must end with a user message"),
    ([{"role": "user", "content": Q1}, {"role": "assistant", "content": "Mara"}], "must end with a user message"),
    ([{"role": "assistant", "content": "Hi"}, {"role": "user", "content": Q1}], "starts with an assistant"),
    ([{"role": "tool", "content": "x"}, {"role": "user", "content": Q1}], "calls no tools"),
    ([{"role": "user", "content": "  "}], "is empty"),
    ([{"role": "user", "content": ["image"]}], "must be text"),
    ([{"role": "wizard", "content": Q1}], "unknown role"),
])
def test_bad_conversations_are_refused_with_a_message(engine, messages, match):
    with pytest.raises(BadInput, match=match):
        engine.answer(Query("corpus", None, messages=messages))


def test_a_conversation_longer_than_the_context_is_refused(engine):
    messages = []
    for i in range(400):
        messages += [{"role": "user", "content": f"{Q1} {i}"}, {"role": "assistant", "content": "Mara Voss keeps it."}]
    messages.append({"role": "user", "content": Q2})
    with pytest.raises(ContextExceeded, match="maximum context length is 4096 tokens"):
        engine.answer(Query("corpus", None, messages=messages))


def test_turns_join_system_text_to_the_next_user_message():
    turns = chat.turns_of(
        [("system", "Be brief."), ("user", "a"), ("user", "b"), ("assistant", "c"), ("developer", "d"), ("user", "e")]
    )
    assert turns == [chat.Turn("user", "Be brief.\n\na\n\nb"), chat.Turn("assistant", "c"), chat.Turn("user", "d\n\ne")]


def test_kept_conversations_are_found_by_their_first_tokens_and_replaced_by_their_extension():
    import torch

    from cag.runtime.kept_conversations import KeptConversations

    kept = KeptConversations(10**9)
    kv = lambda n: [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]  # noqa: E731
    base = list(range(100, 140))
    kept.keep("d", base, kv(40))
    kept.keep("d", base + [1, 2, 3], kv(43))  # the next turn: it replaces the one it extends
    assert [i.n for i in kept._items.values()] == [43]
    assert kept.match("d", base + [1, 2, 3, 9])[1] == 43
    assert kept.match("d", base + [1, 2, 3])[1] == 42  # the last token is prefilled: its row gives the logits
    assert kept.match("e", base + [1])[0] is None  # another snapshot
    assert kept.match("d", base[:10] + [7] * 20)[0] is None  # 10 shared tokens: below the reuse floor
    kept.keep("d", base[:10], kv(10))  # too short to be worth keeping
    for i in range(50):
        kept.keep("d", [i] * 20, kv(20))
    assert len(kept._items) == 51 and kept.match("d", [7] * 25)[1] == 20
    half = kept.nbytes // 2
    kept.shrink(half)  # the oldest go first: the base conversation, then the oldest of the others
    assert kept.nbytes <= half and kept.match("d", base + [1, 2, 3, 9])[0] is None
    assert kept.match("d", [49] * 25)[1] == 20 and kept.stats["conversation_evictions"] == 51 - len(kept._items)
    kept.shrink(0)
    assert not kept._items and not kept._heads


@pytest.mark.parametrize("kernels", ["avx512", "avx2"])
def test_an_answers_rows_hold_what_a_prefill_of_its_tokens_writes(tiny64_model_dir, small_corpus, monkeypatch, kernels):
    """Every row a decode row (cag.runtime.rows.flat): the K/V an answer's decode steps wrote, kept with the
    conversation, equal bit for bit what its tokens prefilled as a question's rows write."""
    if not (native.load_avx2() if kernels == "avx2" else native.load() is not None):
        pytest.skip(f"cag's {kernels} kernels do not run here")
    from cag.runtime.generate import DecodeConfig
    from cag.runtime.requests import Request

    monkeypatch.setenv("CAG_MODEL", str(tiny64_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    monkeypatch.setenv("CAG_DECODE_KERNELS", kernels)
    engine = Engine(get_settings())
    assert engine.decoder.step is not None and engine.decoder.step.flat
    digest = engine.ingest(str(small_corpus)).snapshot
    prefix = engine.resident.get(digest, lambda: engine._load_resident(digest)).prefix
    question = engine.lm.tokenizer("Who keeps the lighthouse, and when does the ferry leave the harbour?")["input_ids"]
    asked = engine.decoder.run(Request(prefix, question, DecodeConfig(max_tokens=10, min_tokens=10), key=digest))
    kept = max(engine.kept._items.values(), key=lambda k: k.n)  # the question and the answer's written rows
    assert kept.n == len(question) + len(asked.ids) - 1 and kept.ids.tolist() == question + asked.ids[:-1]
    answer_kv = [(k.clone(), v.clone()) for k, v in kept.kv]
    engine.kept.clear()
    # all question rows
    engine.decoder.run(Request(prefix, kept.ids.tolist() + [0], DecodeConfig(max_tokens=1), key=digest))
    again = max(engine.kept._items.values(), key=lambda k: k.n)
    for (k1, v1), (k2, v2) in zip(answer_kv, again.kv):
        assert torch.equal(k1, k2[:, : kept.n]) and torch.equal(v1, v2[:, : kept.n])
