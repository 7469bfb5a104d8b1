"""Issue 55, from a hostile probe: a lone surrogate in a chat message (E7), DNS rebinding and
cross-site requests (E8), the AVX2 library's build failing silently (E10), a question or answer room
larger than the context (E13), content-part arrays on the CLI (E14).

The HTTP checks run against a real `cag serve` on loopback (tests/test_api.py's `served_notes`),
without API keys: the documented default, and the case E8 exposed.
"""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest
from typer.testing import CliRunner

from cag.answering import chat
from cag.answering.query import Query
from cag.cli.main import app
from cag.errors import BadInput, BadSettings, ModelError
from cag.kernels import native
from tests.test_api import served_notes

runner = CliRunner()
Q = "When does the ferry leave?"


def cag(*args: str, input: str | bytes | None = None):
    return runner.invoke(app, list(args), input=input, catch_exceptions=False)


def one_line_error(r, message: str, code: int = 1) -> str:
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert message in r.stderr, r.stderr
    return r.stderr


@pytest.fixture
def town(tiny, small_corpus):
    r = cag("ingest", str(small_corpus), "--name", "town", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def open_server(tiny_model_dir, models_dir, tmp_path_factory):
    """`cag serve` with no CAG_API_KEYS (loopback: the documented default)."""
    with served_notes(tmp_path_factory.mktemp("open"), tiny_model_dir, models_dir, CAG_ANSWER_ROOM="64") as (srv, *_):
        yield srv


# -- E7: a lone surrogate in a chat message ------------------------------------------------------
SURROGATE_BODIES = [
    (
        "/v1/chat/completions",
        {"model": "notes", "messages": [{"role": "user", "content": "\ud800 hi"}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {"model": "notes", "messages": [{"role": "system", "content": "\ud800"}, {"role": "user", "content": "hi"}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {"model": "notes", "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "notes",
            "stream": True,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "hi \ud800"},
            ],
        },
        "messages.2.content",
    ),
    (
        "/v1/ask",
        {
            "corpus": "notes",
            "question": "hi",
            "history": [{"role": "user", "content": "\udfff x"}, {"role": "assistant", "content": "ok"}],
        },
        "history.0.content",
    ),
    (
        "/v1/ask",
        {
            "corpus": "notes",
            "question": "hi",
            "stream": True,
            "history": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "\udc80"}],
        },
        "history.1.content",
    ),
]


@pytest.mark.parametrize("path,body,param", SURROGATE_BODIES, ids=[f"{p}:{x}" for p, _, x in SURROGATE_BODIES])
def test_a_lone_surrogate_in_any_message_is_400_naming_the_message(open_server, path, body, param):
    # json.dumps writes the lone surrogate as the escape "\ud800", as the probe's curl sent it
    r = httpx.post(
        open_server.url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and err["param"] == param and "surrogate" in err["message"], err
    ok = httpx.post(open_server.url + "/v1/ask", json={"corpus": "notes", "question": Q, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200, ok.text  # the server goes on


def test_the_engine_refuses_a_lone_surrogate_in_messages_and_questions(tiny_engine, small_corpus):
    """Whatever the caller (the CLI, an embedding), before the tokenizer sees it (a TypeError before)."""
    tiny_engine.ingest(str(small_corpus), name="town")
    for messages, where in [
        ([{"role": "user", "content": "\ud800 hi"}], "message 0 (user)"),
        ([{"role": "system", "content": "be \udfff brief"}, {"role": "user", "content": "hi"}], "message 0 (system)"),
        ([("user", "hi"), ("assistant", "ok"), ("user", "x\udcff")], "message 2 (user)"),
        ([{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}], "message 0 (user)"),
    ]:
        with pytest.raises(BadInput, match=rf"^{re.escape(where)} is not valid text: .*lone surrogate"):
            tiny_engine.answer(Query("town", None, messages=messages))
    with pytest.raises(BadInput, match=r"^the question .*lone surrogate"):
        tiny_engine.answer(Query("town", "When does the office open? \udcff"))  # argv's \xff, as Python decodes it


def test_the_cli_refuses_a_lone_surrogate_or_bytes_not_utf8_in_one_line(town):
    r = cag("ask", "town", "--messages", "-", input='[{"role":"user","content":"\\ud800 When does the ferry leave?"}]')
    one_line_error(r, "error: message 0 (user) is not valid text")
    # `cag ask NAME $'... \xff'`: Python hands the byte over as U+DCFF (surrogateescape)
    one_line_error(cag("ask", "town", "When does the ferry leave? \udcff"), "error: the question ")
    one_line_error(
        cag("ask", "town", "--messages", "-", input=b'[{"role":"user","content":"hi \xff"}]'), "can't decode byte 0xff"
    )


def test_cag_chat_refuses_a_line_that_is_not_utf8_and_goes_on(town):
    r = cag(
        "chat",
        "town",
        "--max-tokens",
        "4",
        input=b"When does the ferry leave?\n/new\n\xff hi\nWho keeps the lighthouse?\n",
    )
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert r.stderr.count("error: ") == 1 and "not valid" in r.stderr, r.stderr
    assert r.stderr.count("[cag] prompt") == 2, r.stderr  # the lines before and after were answered


def test_cag_chat_refuses_a_system_message_that_is_not_text_before_the_first_prompt(town):
    one_line_error(cag("chat", "town", "--system", "be \udcff brief", input=""), "message 0 (system)")


# -- E14: content-part arrays on the CLI ---------------------------------------------------------
def test_ask_messages_reads_content_parts_as_the_http_api_does(town):
    plain = json.loads(cag("ask", "town", Q, "--max-tokens", "8", "--json").stdout)
    parts = [{"role": "user", "content": [{"type": "text", "text": Q}]}]
    for body in (parts, {"model": "town", "messages": parts}):  # a list, or a chat completion request body
        r = cag("ask", "town", "--messages", "-", "--max-tokens", "8", "--json", input=json.dumps(body))
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["answer"] == plain["answer"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    one_line_error(
        cag("ask", "town", "--messages", "-", input=json.dumps(image)), "content of type 'image_url' is not supported"
    )


def test_content_parts_join_as_the_http_api_joins_them():
    turns = chat.turns_of([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                           {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert turns == [chat.Turn("user", "Be brief.\n\na\nb")]
    for content in (["image"], [{"type": "text", "text": 5}], 7):
        with pytest.raises(BadInput, match="content must be text"):
            chat.turns_of([{"role": "user", "content": content}])


# -- E8: Host and Origin -------------------------------------------------------------------------
def test_a_host_that_is_not_this_server_is_refused(open_server):
    """DNS rebinding: a page of attacker.example rebinds its name to 127.0.0.1; the browser then sends
    `Host: attacker.example:PORT` to this server, as same-origin as far as it knows."""
    port = httpx.URL(open_server.url).port
    for host in ("attacker.example.com", f"attacker.example.com:{port}", f"localhost.attacker.example:{port}"):
        for method, path, body in (
            ("GET", "/v1/corpora", None),
            ("POST", "/v1/ask", {"corpus": "notes", "question": Q}),
            ("GET", "/", None),
            ("GET", "/health", None),
        ):
            r = httpx.request(method, open_server.url + path, json=body, headers={"Host": host}, timeout=60)
            assert r.status_code == 403, (host, path, r.text)
            err = r.json()["error"]
            assert err["code"] == "host_not_allowed" and "CAG_ALLOWED_HOSTS" in err["message"], err
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost", f"LOCALHOST:{port}",
                 f"192.168.7.9:{port}"):  # an IP address cannot be rebound: a LAN client's way in
        r = httpx.get(open_server.url + "/v1/corpora", headers={"Host": host}, timeout=60)
        assert r.status_code == 200, (host, r.text)


def test_cross_site_requests_that_change_state_are_refused(open_server):
    url = open_server.url
    # a plain cross-site form POST (no preflight): it started a refresh job
    r = httpx.post(
        url + "/v1/corpora/notes/refresh",
        headers={"Origin": "http://evil.example", "Content-Type": "text/plain"},
        content=b"x",
        timeout=60,
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site", r.text
    for origin in ("null", "http://127.0.0.1.evil.example", f"http://evil.example:{httpx.URL(url).port}"):
        r = httpx.post(url + "/v1/ask", headers={"Origin": origin}, json={"corpus": "notes", "question": Q}, timeout=60)
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site", (origin, r.text)
    # the routes that take a body refuse anything but JSON, whoever sends it: a form cannot post them
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = httpx.post(url + "/v1/chat/completions", headers={"Content-Type": ctype},
                       content=json.dumps({"model": "notes", "messages": [{"role": "user", "content": Q}]}), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (ctype, r.text)
    # reading is not refused by Origin (the browser keeps a cross-site page from reading the answer)
    assert httpx.get(url + "/v1/corpora", headers={"Origin": "http://evil.example"}, timeout=60).status_code == 200
    # what the chat page sends (its own origin), and clients that send no Origin
    for headers in ({"Origin": url}, {"Origin": url.replace("127.0.0.1", "localhost")}, {}):
        r = httpx.post(
            url + "/v1/ask", headers=headers, json={"corpus": "notes", "question": Q, "max_tokens": 4}, timeout=60
        )
        assert r.status_code == 200, (headers, r.text)
    r = httpx.post(url + "/v1/corpora/notes/refresh", headers={"Origin": url}, timeout=60)
    assert r.status_code == 202, r.text


def _client(host: str, **settings):
    from fastapi.testclient import TestClient

    from cag.api.app import create_app
    from cag.api.settings import ApiSettings
    from cag.config import get_settings
    from cag.engine import Engine

    # no lifespan: the model never loads (503 not_ready past the check); the check comes before any route
    return TestClient(create_app(ApiSettings(**settings), engine=Engine(get_settings())), base_url=f"http://{host}")


def test_allowed_hosts_cors_origins_and_keys(tiny):
    c = _client("cag.example.org:8000")
    assert c.get("/v1/corpora").json()["error"]["code"] == "host_not_allowed"
    c = _client("cag.example.org:8000", allowed_hosts="cag.example.org, other.example")
    assert c.get("/", headers={"Host": "CAG.example.org"}).status_code == 200
    assert c.get("/", headers={"Host": "evil.example"}).status_code == 403
    # a named host's pages may post (any port); others may not, whatever the Host
    assert c.post("/v1/ask", json={}, headers={"Origin": "https://other.example"}).status_code == 503  # past the check
    assert c.post("/v1/ask", json={}, headers={"Origin": "https://evil.example"}).status_code == 403
    c = _client("anything.example", allowed_hosts="*")  # any Host; cross-site still refused
    assert c.get("/").status_code == 200
    assert (
        c.post("/v1/ask", json={}, headers={"Origin": "https://evil.example"}).json()["error"]["code"] == "cross_site"
    )
    c = _client("localhost:8000", cors_origins="https://app.example")  # an origin CORS allows may post
    assert c.post("/v1/ask", json={}, headers={"Origin": "https://app.example"}).status_code == 503
    # with API keys the same rule: a key does not make a rebound name this server's
    c = _client("attacker.example", api_keys="k1")
    assert c.get("/v1/corpora").json()["error"]["code"] == "host_not_allowed"
    assert c.get("/health").status_code == 403
    c = _client("localhost:8000", api_keys="k1")
    assert c.get("/v1/corpora").status_code == 401
    assert c.post("/v1/corpora/notes/refresh", headers={"Origin": "http://evil.example"}).status_code == 403


def test_allowed_hosts_setting_and_the_bound_host(monkeypatch):
    from cag.api.settings import load_api_settings

    s = load_api_settings(allowed_hosts=" cag.example.org ,[fd00::7], 10.0.0.5")
    assert s.hosts == ["cag.example.org", "fd00::7", "10.0.0.5"]
    assert load_api_settings().serving_on("myhost.lan").hosts == ["myhost.lan"]
    assert load_api_settings(allowed_hosts="a.example").serving_on("0.0.0.0").hosts == ["a.example", "0.0.0.0"]
    for bad in ("http://cag.example.org", "cag.example.org:8000", "cafe:8000", "a/b", "a b"):
        monkeypatch.setenv("CAG_ALLOWED_HOSTS", f"ok.example,{bad}")
        with pytest.raises(BadSettings, match="CAG_ALLOWED_HOSTS=.*is not a host name"):
            load_api_settings()


# -- E10: the AVX2 library failing on an AVX2 CPU ------------------------------------------------
@pytest.fixture
def avx2_cpu(tiny_model_dir, monkeypatch, tmp_path):
    """A fresh process's view of an AVX2-only CPU (below the AVX-512 floor) with a private kernel cache."""
    below = {native.FLAGS: "this CPU lacks avx512f, avx512_bf16", native.AVX2_FLAGS: None}
    monkeypatch.setattr(native, "cpu_why_not", lambda flags=native.FLAGS: below[flags])
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_avx2", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")  # what `auto` gives a model on int4's grid with the AVX2 library
    return tmp_path


def _no_compiler(tmp_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++ or g++ on it
    return "no C++ compiler found", "no C++ compiler found (install g++, or set CXX)"


def _failing_compiler(tmp_path, monkeypatch):
    cxx = tmp_path / "broken-c++"
    cxx.write_text(
        '#!/bin/sh\n[ "$1" = "--version" ] && { echo fake; exit 0; }\necho "arch/avx2/step.cpp:1: error: boom" '
        ">&2\nexit 1\n"
    )
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    return "error: boom", "it did not build or load (the server's log says why)"


@pytest.mark.parametrize("fault", [_no_compiler, _failing_compiler])
def test_an_avx2_cpu_whose_library_cannot_build_says_why_once(avx2_cpu, monkeypatch, caplog, fault):
    from cag.config import get_settings
    from cag.engine import Engine

    logged, public = fault(avx2_cpu, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="cag.kernels.native"):
        lm = Engine(get_settings()).lm
        again = Engine(get_settings()).lm  # a second model in the process: no second warning
    assert (lm.kernels, lm.kernels_why) == ("torch", f"cag's AVX2 kernels cannot run here: {public}")
    assert again.kernels_why == lm.kernels_why and str(avx2_cpu) not in lm.kernels_why  # /health shows it to anyone
    warnings = [r.getMessage() for r in caplog.records if "falls back to torch" in r.getMessage()]
    assert len(warnings) == 1 and logged in warnings[0], caplog.text
    # asked for by name: the compiler is the reason, not the weights format `auto` fell back to
    monkeypatch.setenv("CAG_WEIGHTS", "fp32")
    monkeypatch.setenv("CAG_DECODE_KERNELS", "avx2")
    with pytest.raises(ModelError, match=f"CAG_DECODE_KERNELS=avx2 cannot run here: .*{re.escape(logged)}"):
        _ = Engine(get_settings()).lm


def test_the_reason_on_an_avx2_cpu_that_lacks_nothing_but_avx512_is_unchanged(avx2_cpu, monkeypatch, caplog):
    """fp32 weights, the AVX2 library never tried: the CPU is still the reason, and nothing is warned."""
    from cag.config import get_settings
    from cag.engine import Engine

    _no_compiler(avx2_cpu, monkeypatch)
    monkeypatch.setenv("CAG_WEIGHTS", "fp32")
    with caplog.at_level(logging.WARNING, logger="cag.kernels.native"):
        lm = Engine(get_settings()).lm
    assert lm.kernels_why == "cag's kernels cannot run here: this CPU lacks avx512f, avx512_bf16"
    assert "falls back" not in caplog.text


# -- E13: rooms larger than the context ----------------------------------------------------------
@pytest.mark.parametrize("setting,value,room", [("CAG_ANSWER_ROOM", "9000", 9256), ("CAG_QUESTION_ROOM", "4000", 4256)])
def test_rooms_larger_than_the_context_name_the_rooms(tiny, small_corpus, monkeypatch, setting, value, room):
    monkeypatch.setenv(setting, value)
    err = one_line_error(cag("ingest", str(small_corpus), "--name", "room"),
                         f"CAG_QUESTION_ROOM + CAG_ANSWER_ROOM ({room}) leave no room in the model's context (4096)")
    assert "shard" not in err and not re.search(r"-\d", err), err  # no negative shard size
