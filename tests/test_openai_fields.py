"""What an OpenAI client expects of /v1/chat/completions beyond the basics (issue 51): `stop` sequences
(also on /v1/ask), OpenAI's fields that cag does not honour refused in OpenAI's error shape, content as a
list of text parts, and `cached_tokens` on a sharded corpus over a conversation.

A stop sequence is a cut on the text of the same greedy tokens: the tokens before it are those decoded
without it (cag == full still holds), decoding halts there, and a stream never sends text that turns
out to be part of one.
"""

from __future__ import annotations

import json

import pytest

from tests.test_api import KEY, app_client, served_notes, sse_events
from tests.test_shards import ASKS
from tests.test_shards import DOCS as TOWN

QUESTION = "Who keeps the lighthouse?"
CHAT = {"model": "notes", "messages": [{"role": "user", "content": QUESTION}]}


# -- the text cut, on its own ---------------------------------------------------------------------
class Pieces:
    """A tokenizer whose token i decodes to vocab[i] (decode of a list: their concatenation)."""

    def __init__(self, vocab: list[str]):
        self.vocab = vocab

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.vocab[i] for i in ids)


def _stream(vocab: list[str], stops: tuple[str, ...]):
    from cag.runtime.generate import TextStream

    s, sent = TextStream(Pieces(vocab), stops), []
    for i in range(len(vocab)):
        sent.append(s.push(i))
        if s.stopped:
            break
    sent.append(s.flush())
    return s, sent


def test_a_stream_holds_back_what_may_start_a_stop_sequence():
    s, sent = _stream(["Hello", " wor", "ld", "\nE", "N", "D", " more"], ("\nEND",))
    assert s.stopped and s.text == "Hello world" and "".join(sent) == "Hello world"
    assert sent[:3] == ["Hello", " wor", "ld"] and sent[3:] == ["", "", "", ""]  # "\nE", "\nEN": undecided, then cut
    s, sent = _stream(["Hello", "\nE", "x", "it"], ("\nEND",))  # a prefix that does not go on: sent once decided
    assert not s.stopped and sent == ["Hello", "", "\nEx", "it", ""] and s.text == "Hello\nExit"
    s, sent = _stream(["a", "b", "\nE"], ("\nEND", "zz"))  # never decided: the end of the text comes with flush
    assert not s.stopped and sent == ["a", "b", "", "\nE"]
    s, sent = _stream(["ab", "cde", "f"], ("cd", "bc"))  # the first one the text holds wins, wherever it ends
    assert s.stopped and s.text == "a" and "".join(sent) == "a"
    s, sent = _stream(["  ", "x", "y"], (" ",))  # searched from the answer's first non-blank character
    assert not s.stopped and s.text == "  xy"
    s, sent = _stream(["x", "\ufffd", "y"], ("y",))  # a partial character is held back as before
    assert s.stopped and sent == ["x", "", "\ufffd", ""] and s.text == "x\ufffd"


# -- stop, in process -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir, models_dir):
    from cag.model.loading import load_model

    return load_model(str(tiny_model_dir), models_dir)


@pytest.fixture
def engine(tiny_lm, tiny_model_dir, small_corpus, monkeypatch):
    from cag.config import get_settings
    from cag.engine import Engine

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_KV_DTYPE", "float32")  # bit-identical state: cag == full exactly on the random model
    e = Engine(get_settings(answer_room=64), lm=tiny_lm)
    e.ingest(str(small_corpus), name="notes")
    return e


def a_stop_in(answer: str) -> tuple[str, str]:
    """A stop sequence that occurs in the middle of `answer` (starting with a character that is not
    blank), and the answer it leaves: the text before its first occurrence, stripped."""
    i = next(i for i in range(len(answer) // 2, len(answer)) if not answer[i].isspace())
    stop = answer[i : i + 3]
    return stop, answer[: answer.index(stop)].strip()


def test_stop_cuts_the_same_tokens_answer_on_ask_and_chat(engine):
    with app_client(engine) as c:
        ask = {"corpus": "notes", "question": QUESTION, "max_tokens": 40, "include_token_ids": True}
        plain = c.post("/v1/ask", json=ask).json()
        assert plain["usage"]["completion_tokens"] == 40, "the random model should talk until max_tokens"
        stop, expected = a_stop_in(plain["answer"])

        cut = c.post("/v1/ask", json={**ask, "stop": stop}).json()
        assert cut["answer"] == expected and stop not in cut["answer"] and cut["finish_reason"] == "stop"
        n = cut["usage"]["completion_tokens"]
        assert n < 40 and cut["token_ids"] == plain["token_ids"][:n]  # the same tokens; decoding halted at the stop
        tok = engine.lm.tokenizer
        assert stop in tok.decode(cut["token_ids"]) and stop not in tok.decode(cut["token_ids"][:-1])
        # a list: the first sequence the text holds ends it; one that never occurs changes nothing
        assert c.post("/v1/ask", json={**ask, "stop": ["never said \u2603", stop]}).json()["answer"] == expected
        never = c.post("/v1/ask", json={**ask, "stop": ["never said \u2603"]}).json()
        assert never["token_ids"] == plain["token_ids"] and never["finish_reason"] == "length"
        assert c.post("/v1/ask", json={**ask, "stop": []}).json()["token_ids"] == plain["token_ids"]

        # the stop completed by the last allowed token: cut, and finish_reason says stop, not length
        last = c.post("/v1/ask", json={**ask, "stop": stop, "max_tokens": n}).json()
        assert (
            last["answer"] == expected and last["usage"]["completion_tokens"] == n and last["finish_reason"] == "stop"
        )
        assert c.post("/v1/ask", json={**ask, "max_tokens": n}).json()["finish_reason"] == "length"

        # exactness: `full` (the knowledge prefilled again, no snapshot) cuts the same tokens
        full = c.post("/v1/ask", json={**ask, "stop": stop, "mode": "full"}).json()
        assert full["token_ids"] == cut["token_ids"] and full["answer"] == expected

        chat = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40, "stop": stop}).json()
        assert chat["choices"][0]["message"]["content"] == expected and chat["choices"][0]["finish_reason"] == "stop"
        assert chat["usage"]["completion_tokens"] == n

        # streamed: the pieces add up to the cut answer, so no piece ever held a stop sequence's text
        with c.stream("POST", "/v1/ask", json={**ask, "stop": stop, "stream": True}) as r:
            events = sse_events(r)
        assert "".join(json.loads(d)["text"] for e, d in events if e == "token") == expected
        assert json.loads(events[-1][1])["finish_reason"] == "stop"
        with c.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 40, "stop": [stop], "stream": True}
        ) as r:
            chunks = [json.loads(d) for _, d in sse_events(r) if d != "[DONE]"]
        assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == expected
        assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None] * (len(chunks) - 1) + ["stop"]


def test_the_forward_path_cuts_the_same_tokens(tiny_lm):
    """Models the batched step does not cover decode through transformers' forward
    (cag.runtime.generate.generate): the same cut there, and streamed pieces that never hold the stop."""
    from cag.runtime import kv_cache
    from cag.runtime.generate import DecodeConfig, generate

    ids = tiny_lm.tokenizer.encode(QUESTION)

    def run(stop: tuple[str, ...] = ()):
        pieces: list[str] = []
        cache = kv_cache.new_cache(tiny_lm.model, len(ids) + 41)
        return generate(tiny_lm, cache, 0, ids, DecodeConfig(max_tokens=40, stop=stop), on_text=pieces.append), pieces

    plain, _ = run()
    assert len(plain.ids) == 40
    stop, expected = a_stop_in(plain.text)
    cut, pieces = run((stop,))
    assert cut.text == expected and len(cut.ids) < 40 and cut.ids == plain.ids[: len(cut.ids)]
    assert "".join(pieces).strip() == expected


def test_a_stop_sequence_is_refused_where_openai_refuses_it(engine):
    with app_client(engine) as c:
        for stop in (["a", "b", "c", "d", "e"], "", [""], ["ok", 5], 5, "x" * 257):
            r = c.post("/v1/chat/completions", json={**CHAT, "stop": stop})
            assert r.status_code == 400, (stop, r.text)
            assert (
                r.json()["error"]["param"].startswith("stop") and r.json()["error"]["type"] == "invalid_request_error"
            )
        assert c.post("/v1/ask", json={"corpus": "notes", "question": "q", "stop": ["a"] * 5}).status_code == 400
        assert (
            c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stop": ["a", "b", "c", "d"]}).status_code
            == 200
        )
        assert c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stop": None}).status_code == 200


# -- fields cag does not honour ---------------------------------------------------------------------
REFUSED = [
    ("n", 2), ("tools", [{"type": "function", "function": {"name": "f"}}]), ("functions", [{"name": "f"}]),
    ("tool_choice", "required"), ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("function_call", {"name": "f"}), ("frequency_penalty", 0.5), ("presence_penalty", -1),
    ("logit_bias", {"50256": -100}), ("logprobs", True), ("top_logprobs", 3),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}), ("reasoning_effort", "low"),
    ("verbosity", "low"), ("web_search_options", {}),
]
ACCEPTED = {  # harmless at these values: what clients send by default
    "n": 1, "tools": [], "functions": [], "tool_choice": "none", "function_call": "auto", "parallel_tool_calls": False,
    "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False, "top_logprobs": 0,
    "response_format": {"type": "text"}, "modalities": ["text"], "user": "u-1", "seed": 3, "store": False,
    "metadata": {"k": "v"}, "service_tier": "auto", "stream_options": None, "audio": None, "reasoning_effort": None,
    "not_openai_at_all": {"x": 1},  # unknown fields: ignored
}


@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED)])
def test_an_unsupported_field_is_400_in_openai_shape_naming_it(engine, field, value):
    with app_client(engine) as c:
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json={**CHAT, field: value, "stream": stream})
            assert r.status_code == 400, r.text
            assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                          "param": field, "code": "unsupported_parameter"}}
            assert r.json()["error"]["message"].startswith(f"{field}: ")


def test_fields_at_harmless_values_are_accepted_and_change_nothing(engine):
    with app_client(engine) as c:
        plain = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8}).json()
        r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, **ACCEPTED})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        # wrong types are still schema errors (400 invalid_request), never 500
        for field, value in [("logprobs", "yes"), ("frequency_penalty", 3), ("response_format", "json"), ("n", 0)]:
            r = c.post("/v1/chat/completions", json={**CHAT, field: value})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (field, r.text)


def test_content_as_text_parts_is_read_and_other_parts_refused(engine):
    with app_client(engine) as c:
        joined = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "messages": [
            {"role": "user", "content": "Who keeps\nthe lighthouse?"}]}).json()
        parts = c.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "max_tokens": 8,
                "messages": [
                    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "Who keeps"}, {"type": "text", "text": "the lighthouse?"}],
                    },
                ],
            },
        )
        assert parts.status_code == 200, parts.text
        assert parts.json()["usage"]["prompt_tokens"] > joined["usage"]["prompt_tokens"]  # the system part is read
        one = c.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "Who keeps"}, {"type": "text", "text": "the lighthouse?"}],
                    }
                ],
            },
        )
        assert one.json()["choices"][0]["message"]["content"] == joined["choices"][0]["message"]["content"]
        for part in ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                     {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}):
            r = c.post("/v1/chat/completions", json={**CHAT, "messages": [
                {"role": "user", "content": [{"type": "text", "text": QUESTION}, part]}]})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
            assert part["type"] in r.json()["error"]["message"]


# -- cached_tokens on a sharded corpus, over a conversation --------------------------------------------
def test_cached_tokens_on_a_sharded_corpus_add_the_kept_conversation_each_turn(tiny64_model_dir, tmp_path, monkeypatch):
    """usage.prompt_tokens_details.cached_tokens = the routed shard's snapshot + the kept conversation, every
    turn, and the `cag` extension's split adds up to it (issue 51: the conversation was subtracted from the
    snapshot's part). Conversations are kept where every row is a decode row (int4 on cag's kernels);
    elsewhere each turn reuses the shard's snapshot only."""
    from cag.config import get_settings
    from cag.engine import Engine
    from tests.test_shards import _shard_tokens

    root = tmp_path / "town"
    root.mkdir()
    for name, text in TOWN.items():
        (root / name).write_text(text + "\n")
    monkeypatch.setenv("CAG_MODEL", str(tiny64_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    engine = Engine(get_settings())
    keeps = engine.decoder.step.flat  # cag's kernels run here (AVX-512, AMX or AVX2)
    ing = engine.ingest(str(root), name="town", shard_tokens=_shard_tokens(engine, root, 2))
    assert ing.n_shards == 2
    # over 16 tokens: kept
    question = ASKS["b-ferry.txt"] + " Please answer in one short sentence, naming the document."
    messages = [{"role": "system", "content": "Answer from the documents."}]
    turns = []
    with app_client(engine) as c:
        for q in (question, "And when does it come back in the evening?", "Why?"):
            messages.append({"role": "user", "content": q})
            r = c.post("/v1/chat/completions", json={"model": "town", "max_tokens": 8, "messages": messages})
            assert r.status_code == 200, r.text
            turns.append(r.json())
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    shard = ing.shards[turns[0]["cag"]["shards"][0]["shard"]]["n_tokens"]
    assert shard < ing.n_tokens and all(
        t["cag"]["shards"][0]["shard"] == turns[0]["cag"]["shards"][0]["shard"] for t in turns
    )
    prompt = [t["usage"]["prompt_tokens"] for t in turns]
    cached = [t["usage"]["prompt_tokens_details"]["cached_tokens"] for t in turns]
    split = [t["cag"]["cached_tokens"] for t in turns]
    assert [s["snapshot"] for s in split] == [shard] * 3  # the shard's snapshot every turn, never less
    assert cached == [shard + s["conversation"] for s in split]  # the parts add up to what usage reports
    assert split[0]["conversation"] == 0 and prompt[0] < prompt[1] < prompt[2]
    if keeps:  # each turn reuses at least the turn before's prompt, never its own last token
        assert 0 < split[1]["conversation"] < split[2]["conversation"]
        assert all(p0 <= c < p1 for p0, c, p1 in zip(prompt, cached[1:], prompt[1:])), (prompt, cached)
    else:
        assert cached == [shard] * 3, (prompt, cached)


# -- through the official client, on a real server ------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_model_dir, models_dir, tmp_path_factory):
    with served_notes(tmp_path_factory.mktemp("served"), tiny_model_dir, models_dir, CAG_API_KEYS=KEY,
                      CAG_KV_DTYPE="float32") as (srv, *_):
        yield srv.url


def test_stop_through_the_openai_client(served):
    import openai

    client = openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    plain = client.chat.completions.create(model="notes", max_tokens=40, messages=messages)
    stop, expected = a_stop_in(plain.choices[0].message.content)

    c = client.chat.completions.create(model="notes", max_tokens=40, messages=messages, stop=stop)
    assert c.choices[0].message.content == expected and c.choices[0].finish_reason == "stop"
    assert c.usage.completion_tokens < plain.usage.completion_tokens
    c = client.chat.completions.create(model="notes", max_tokens=40, messages=messages, stop=["\u2603\u2603", stop])
    assert c.choices[0].message.content == expected

    chunks = list(
        client.chat.completions.create(
            model="notes",
            max_tokens=40,
            messages=messages,
            stop=[stop],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(pieces) == expected  # nothing of the stop sequence was ever sent
    assert all(expected.startswith("".join(pieces[: i + 1])) for i in range(len(pieces)))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == c.usage.completion_tokens

    never = client.chat.completions.create(model="notes", max_tokens=40, messages=messages, stop="\u2603\u2603")
    assert never.choices[0].message.content == plain.choices[0].message.content
    assert never.choices[0].finish_reason == plain.choices[0].finish_reason

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="notes", messages=messages, logprobs=True)
    assert e.value.status_code == 400 and e.value.param == "logprobs" and e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="notes", messages=messages, n=2, stream=True)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="notes", messages=messages, response_format={"type": "json_object"})
    assert e.value.param == "response_format"
