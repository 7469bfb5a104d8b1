"""The HTTP service on the tiny model: a real `cag serve` process on loopback for the key paths
(httpx and the official `openai` client), FastAPI's TestClient for limits and error codes.

Nothing of our own stack is mocked: the server runs the real engine on a real HF model folder,
snapshots on disk and a real SQLite index.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from httpx_sse import EventSource

from bench.harness import cag_command, serving
from cag.answering.query import Query
from cag.kernels import native
from tests.conftest import PREFILL_BLOCK, REPO

KEY = "test-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
# TestClient's own "testserver" is not a Host the server answers to (api/middleware.py SameSite)
LOCAL = "http://localhost"
QUESTIONS = [
    "When does the ferry leave?",
    "Who keeps the lighthouse?",
    "What does the bakery sell on Tuesdays?",
    "When does the ferry return?",
    "Where is the bakery?",
    "Who lights the lamp at dusk?",
    "Which street is the bakery on?",
    "What time does the ferry come back on weekdays?",
]
DOCS = {
    "a.md": "# Lighthouse\nThe lighthouse keeper is Mara Voss. She lights the lamp at dusk.\n",
    "b.txt": "The ferry leaves the harbour at 7:15 every weekday and returns at 18:40.\n",
    "c.md": "The bakery on Quay Street sells rye bread on Tuesdays only.\n",
}


def sse_events(response: httpx.Response) -> list[tuple[str, str]]:
    """(event, data) of every server-sent event of a streaming response; unnamed events are "message"."""
    return [(e.event, e.data) for e in EventSource(response).iter_sse()]


@contextlib.contextmanager
def served_notes(root: Path, tiny_model_dir: Path, models_dir: Path, **env_vars: str):
    """The tiny model and the `notes` corpus (DOCS) ingested by `cag ingest`, served by a real
    `cag serve` on loopback with these CAG_* variables; yields (Served, env, home, corpus folder)."""
    corpus = root / "notes"
    corpus.mkdir()
    for name, text in DOCS.items():
        (corpus / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAG_")}
    env.update(CAG_HOME=str(root / "home"), CAG_MODELS_DIR=str(models_dir), CAG_MODEL=str(tiny_model_dir),
               # as every test pins them: `auto` measures the machine
               CAG_WEIGHTS="fp32", CAG_PREFILL_BLOCK=str(PREFILL_BLOCK))
    env.update(env_vars)
    r = subprocess.run([*cag_command(), "ingest", str(corpus), "--json"], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    with serving(env, root / "server.log", cwd=REPO) as srv:
        yield srv, env, root / "home", corpus


# -- a real `cag serve` process ------------------------------------------------------------------
@dataclass
class Server:
    url: str
    env: dict
    home: Path
    corpus: Path
    proc: subprocess.Popen
    log: Path

    @property
    def keeps(self) -> bool:
        """Whether conversations are kept: cag's kernels (cag.runtime.decoder.Decoder._keeps)."""
        return self.env["CAG_WEIGHTS"] == "int4"

    def client(self, key: str | None = KEY, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kw)

    def ask(self, question: str, **body) -> dict:
        with self.client() as c:
            r = c.post("/v1/ask", json={"corpus": "notes", "question": question, **body})
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tiny64_model_dir, models_dir, tmp_path_factory):
    # int4 on cag's kernels where they run: every row a decode row, so conversations are kept (and batched);
    # elsewhere fp32 on torch's, batched in fixed steps, each turn prefilling its conversation
    model, weights = (
        (tiny64_model_dir, "int4") if native.load() is not None or native.load_avx2() else (tiny_model_dir, "fp32")
    )
    with served_notes(tmp_path_factory.mktemp("served"), model, models_dir, CAG_API_KEYS=f"{KEY},test-key-2",
                      CAG_WORKERS="4", CAG_MAX_QUEUE="32", CAG_ANSWER_ROOM="1024", CAG_WEIGHTS=weights,
                      CAG_DECODE_ROWS="16") as (srv, env, home, corpus):
        yield Server(srv.url, env, home, corpus, srv.proc, srv.log)


def test_health_is_open_and_everything_else_needs_a_key(server):
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    for method, path in [("GET", "/v1/models"), ("GET", "/v1/corpora"), ("GET", "/v1/corpora/notes"),
                         ("POST", "/v1/corpora/notes/refresh"), ("GET", "/v1/jobs/job_x"), ("GET", "/metrics"),
                         ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("POST", "/v1/ask"),
                         ("POST", "/v1/chat/completions")]:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": KEY}):
            r = httpx.request(method, server.url + path, headers=headers, json={})
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
    # a path that does not exist is 404 with or without a key: there is nothing to protect
    assert httpx.get(f"{server.url}/v1/no-such-route").status_code == 404
    with server.client("test-key-2") as c:  # any configured key
        assert c.get("/v1/corpora").status_code == 200
        assert c.get("/docs").status_code == 200
        spec = c.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "One of CAG_API_KEYS."}
    assert "security" not in spec, "security is declared per operation, not globally"
    for path, ops in spec["paths"].items():
        for op in ops.values():
            if path == "/health":
                assert "security" not in op and "401" not in op["responses"]
            else:
                assert op["security"] == [{"bearer": []}] and "401" in op["responses"], path

    import openai

    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_ask_equals_cag_ask_and_the_engine(server):
    q = QUESTIONS[0]
    got = server.ask(q, max_tokens=24, include_token_ids=True)
    assert got["corpus"] == "notes" and got["mode"] == "cag" and got["stale"] is False
    assert set(got["usage"]) == {"prompt_tokens", "cached_tokens", "conversation_tokens", "completion_tokens"}
    assert set(got["timings"]) >= {"load_ms", "ttft_ms", "total_ms"}
    assert got["usage"]["cached_tokens"] > 0 and got["usage"]["completion_tokens"] == len(got["token_ids"])

    cli = subprocess.run([*cag_command(), "ask", "notes", q, "--max-tokens", "24", "--json"], env=server.env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    want = json.loads(cli.stdout)
    assert got["answer"] == want["answer"]
    for k in ("prompt_tokens", "completion_tokens"):
        assert got["usage"][k] == want[k]
    # the snapshot's share of the cached tokens (either may also have reused an earlier asking of q)
    assert (
        got["usage"]["cached_tokens"] - got["usage"]["conversation_tokens"]
        == want["cached_tokens"] - want["conversation_tokens"]
    )
    assert got["snapshot"] == want["snapshot"]

    from cag.config import Settings
    from cag.engine import Engine

    engine = Engine(
        Settings(
            home=server.home,
            model=server.env["CAG_MODEL"],
            answer_room=1024,
            weights=server.env["CAG_WEIGHTS"],
            models_dir_override=server.env["CAG_MODELS_DIR"],
        )
    )
    direct = engine.answer(Query("notes", q, max_tokens=24))
    assert direct.token_ids == got["token_ids"] and direct.answer == got["answer"]


def test_cag_rag_over_http_and_the_chat_endpoint(server):
    got = server.ask(QUESTIONS[0], mode="cag+rag", max_tokens=8)
    assert got["mode"] == "cag+rag" and got["usage"]["cached_tokens"] > 0
    two = server.ask(QUESTIONS[0], mode="cag+rag", k=2, max_tokens=8)
    assert two["usage"]["prompt_tokens"] > got["usage"]["prompt_tokens"]  # a second passage quoted
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "notes", "mode": "cag+rag", "max_tokens": 8,
                                                 "messages": [{"role": "user", "content": QUESTIONS[0]}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == got["answer"]
        assert (
            c.post("/v1/ask", json={"corpus": "notes", "question": "x", "mode": "cag+rag", "k": 0}).status_code == 400
        )


def test_ask_stream_sends_tokens_then_the_answer(server):
    q = QUESTIONS[1]
    plain = server.ask(q, max_tokens=20)
    with server.client() as c, c.stream("POST", "/v1/ask", json={"corpus": "notes", "question": q, "max_tokens": 20,
                                                                   "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    kinds = [e for e, _ in events]
    assert kinds[-1] == "answer" and set(kinds[:-1]) <= {"token"}
    final = json.loads(events[-1][1])
    text = "".join(json.loads(d)["text"] for e, d in events if e == "token")
    assert text == final["answer"] == plain["answer"]
    snapshot = lambda u: u["cached_tokens"] - u["conversation_tokens"]  # noqa: E731 (the second asking reuses the first)
    assert final["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] and snapshot(final["usage"]) == snapshot(
        plain["usage"]
    )
    assert final["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert set(final["timings"]) >= {"load_ms", "ttft_ms", "total_ms"}

    # errors before the first token keep their HTTP status, also when streaming
    with server.client() as c:
        r = c.post("/v1/ask", json={"corpus": "nope", "question": q, "stream": True})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_chat_completions_with_the_openai_client(server):
    import openai

    q = QUESTIONS[2]
    plain = server.ask(q, max_tokens=24)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert "notes" in [m.id for m in client.models.list()]
    assert client.models.retrieve("notes").id == "notes"

    c = client.chat.completions.create(model="notes", max_tokens=24, messages=[{"role": "user", "content": q}],
                                       extra_body={"unknown_field": {"nested": 1}, "logit_bias": {}})
    assert c.object == "chat.completion" and c.model == "notes"
    assert c.choices[0].message.content == plain["answer"]  # one user message: the plain question
    assert c.choices[0].message.role == "assistant"
    assert c.choices[0].finish_reason in ("stop", "length")
    assert c.usage.prompt_tokens == plain["usage"]["prompt_tokens"]
    assert c.usage.completion_tokens == plain["usage"]["completion_tokens"]
    assert c.usage.prompt_tokens_details.cached_tokens >= plain["usage"]["cached_tokens"] > 0

    stream = client.chat.completions.create(model="notes", max_tokens=24, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": [{"type": "text", "text": q}]}])
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain["answer"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    # all but its last token kept
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chunks[-1].usage.prompt_tokens - 1

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": q}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="notes", messages=[{"role": "system", "content": "no question"}])

    # raw SSE: the stream ends with data: [DONE]; unknown fields are ignored
    body = {"model": "notes", "messages": [{"role": "user", "content": q}], "max_tokens": 8, "stream": True,
            "frequency_penalty": 0, "tools": [], "user": "someone", "whatever": [1, 2]}
    with server.client() as hc, hc.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1][1] == "[DONE]"
    first = json.loads(events[0][1])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def chat_turns(client, questions: list[str], system: str | None = None, **kw) -> list:
    """A conversation through the official client: each turn sends the history, the answers it got."""
    messages = [{"role": "system", "content": system}] if system else []
    out = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        c = client.chat.completions.create(model="notes", max_tokens=16, messages=messages, **kw)
        out.append(c)
        messages.append({"role": "assistant", "content": c.choices[0].message.content})
    return out


def test_a_conversation_through_the_openai_client_reuses_its_turns_exactly(server, tmp_path):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    turns = chat_turns(client, QUESTIONS[:3], system="Answer in one short sentence.")
    prompt = [c.usage.prompt_tokens for c in turns]
    cached = [c.usage.prompt_tokens_details.cached_tokens for c in turns]
    conv = [c.cag["cached_tokens"]["conversation"] for c in turns]  # the extension says which cached tokens are whose
    snapshot = turns[0].cag["cached_tokens"]["snapshot"]
    assert prompt[0] < prompt[1] < prompt[2] and conv[0] == 0
    assert [c - v for c, v in zip(cached, conv)] == [snapshot] * 3
    # each turn reuses at least the previous prompt (and the answer, as far as its text re-tokenizes alike)
    if server.keeps:
        assert all(p0 <= c < p1 for p0, c, p1 in zip(prompt, cached[1:], prompt[1:])), (prompt, cached)
    else:
        assert cached == [snapshot] * 3 and conv == [0] * 3
    # the same conversation, answered from scratch (`full`: the knowledge prefilled again) by the CLI
    messages = [{"role": "system", "content": "Answer in one short sentence."}]
    for q, c in zip(QUESTIONS[:3], turns):
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": c.choices[0].message.content}]
    (tmp_path / "m.json").write_text(json.dumps(messages[:-1]))
    r = subprocess.run(
        [
            *cag_command(),
            "ask",
            "notes",
            "--messages",
            str(tmp_path / "m.json"),
            "--mode",
            "full",
            "--max-tokens",
            "16",
            "--json",
        ],
        env=server.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["answer"] == turns[2].choices[0].message.content
    # history counts: the last question alone gets another prompt
    alone = server.ask(QUESTIONS[2], max_tokens=16)
    assert alone["usage"]["prompt_tokens"] < prompt[2]


def test_kept_conversations_are_not_shared_across_api_keys(server):
    """Issue 55 E1: one key's kept conversation is never reused for (nor reported to) another key; the same
    history sent again with the first key is."""
    if not server.keeps:
        pytest.skip("conversations are kept only on cag's kernels")
    import openai

    history = [{"role": "system", "content": "Answer briefly."},
               {"role": "user", "content": "My locker code is 7731 and my badge says tulip-seven."}]

    def cached(key: str) -> int:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        return client.chat.completions.create(model="notes", max_tokens=1, messages=history).cag["cached_tokens"][
            "conversation"
        ]

    assert cached(KEY) == 0  # the first asking keeps it
    assert cached("test-key-2") == 0  # the other key reuses nothing: no guess of the text can be tested
    assert cached(KEY) > 0  # the same key's next asking reuses it


def test_interleaved_and_concurrent_conversations_get_their_own_answers(server):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    plans = [[QUESTIONS[i % 8], QUESTIONS[(i + 3) % 8]] for i in range(16)]
    alone = [[c.choices[0].message.content for c in chat_turns(client, p)] for p in plans[:4]]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: [c.choices[0].message.content for c in chat_turns(client, p)], plans))
    assert together[:4] == alone and together[8:12] == alone
    metrics = server.client().get("/metrics").text
    if server.keeps:
        assert _value(metrics, "cag_conversation_hits_total") >= 16 and _value(metrics, "cag_conversations_kept") >= 1


def _value(metrics: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize(
    "body,code",
    [
        (
            {"messages": [{"role": "tool", "content": "42", "tool_call_id": "x"}, {"role": "user", "content": "q?"}]},
            "bad_request",
        ),
        (
            {
                "messages": [{"role": "user", "content": "q?"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "unsupported_parameter",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            "bad_request",
        ),
        ({"messages": [{"role": "user", "content": ""}]}, "bad_request"),
        ({"messages": [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "a"}]}, "bad_request"),
        (
            {
                "messages": [
                    {"role": "user", "content": f"Who keeps the lighthouse, number {i}?"}
                    if j == 0
                    else {"role": "assistant", "content": "Mara Voss keeps the lighthouse."}
                    for i in range(1000)
                    for j in range(2)
                ]
                + [{"role": "user", "content": "q?"}]
            },
            "context_length_exceeded",
        ),
    ],
)
def test_bad_conversations_get_400_with_a_message(server, body, code):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "notes", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    if code == "context_length_exceeded":
        assert "maximum context length is 4096 tokens" in err["message"]


def decode_counters(server) -> tuple[float, float]:
    """(decode steps, decode rows) from /metrics."""
    with server.client() as c:
        got = {line.split()[0]: float(line.split()[1]) for line in c.get("/metrics").text.splitlines()
               if line.startswith(("cag_decode_steps_total ", "cag_decode_rows_total "))}
    return got["cag_decode_steps_total"], got["cag_decode_rows_total"]


def test_eight_concurrent_clients_get_their_sequential_answers(server):
    import openai

    want = {q: server.ask(q, max_tokens=24, include_token_ids=True) for q in QUESTIONS}
    assert len({w["answer"] for w in want.values()}) >= 4, "the tiny model should answer questions differently"
    barrier = threading.Barrier(len(QUESTIONS))

    def client(i: int, q: str):
        barrier.wait()
        kind = i % 3
        if kind == 0:
            a = server.ask(q, max_tokens=24, include_token_ids=True)
            return a["answer"], a["token_ids"]
        if kind == 1:
            with (
                server.client() as c,
                c.stream(
                    "POST",
                    "/v1/ask",
                    json={
                        "corpus": "notes",
                        "question": q,
                        "max_tokens": 24,
                        "stream": True,
                        "include_token_ids": True,
                    },
                ) as r,
            ):
                events = sse_events(r)
            final = json.loads(events[-1][1])
            streamed = "".join(json.loads(d)["text"] for e, d in events if e == "token")
            assert streamed == final["answer"]
            return final["answer"], final["token_ids"]
        oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        c = oc.chat.completions.create(model="notes", max_tokens=24, messages=[{"role": "user", "content": q}])
        return c.choices[0].message.content, None

    before = decode_counters(server)
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        results = list(pool.map(client, range(len(QUESTIONS)), QUESTIONS))
    for q, (answer, ids) in zip(QUESTIONS, results):
        assert answer == want[q]["answer"], q
        if ids is not None:
            assert ids == want[q]["token_ids"], q
    after = decode_counters(server)  # and they were decoded together: more rows than steps
    steps, rows = after[0] - before[0], after[1] - before[1]
    assert rows > 1.5 * steps > 0, (rows, steps)


def _stopped(metrics_text: str, reason: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(f'cag_generations_stopped_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_that_disconnects_stops_its_generation(server):
    from cag.store.index import Index

    q = "Tell me everything about the lighthouse, the ferry and the bakery."
    with server.client() as c:
        before = _stopped(c.get("/metrics").text, "disconnect")
        with c.stream("POST", "/v1/ask", json={"corpus": "notes", "question": q, "max_tokens": 1000,
                                               "stream": True}) as r:
            assert r.status_code == 200
            next(EventSource(r).iter_sse())  # one token in, hang up
    index = Index(server.home / "index.db")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = [row for row in index.queries("notes") if row["question"] == q]
        if rows:
            break
        time.sleep(0.05)
    assert rows, "the stopped generation should still be logged"
    assert rows[0]["completion_tokens"] < 1000
    with server.client() as c:
        assert _stopped(c.get("/metrics").text, "disconnect") == before + 1


def test_metrics_are_prometheus_text(server):
    server.ask(QUESTIONS[3], max_tokens=4)
    with server.client() as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'cag_http_requests_total{method="POST",route="/v1/ask",status="200"}' in text
    assert 'cag_http_requests_total{method="GET",route="/v1/corpora",status="401"}' in text
    assert 'cag_http_requests_total{method="GET",route="other",status="404"}' in text  # unknown paths: one label
    assert "cag_http_request_duration_seconds_bucket" in text
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    assert values["cag_snapshot_hits_total"] >= 1 and values["cag_snapshot_loads_total"] >= 1
    assert values["cag_resident_bytes"] > 0 and values["cag_model_loaded"] == 1
    assert values['cag_tokens_total{kind="cached",mode="cag"}'] > 0
    assert values['cag_tokens_total{kind="completion",mode="cag"}'] > 0


# -- in-process: FastAPI's TestClient on the same engine code -------------------------------------
@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir, models_dir):
    from cag.model.loading import load_model

    return load_model(str(tiny_model_dir), models_dir)


@pytest.fixture
def engine(tiny_lm, tiny_model_dir, small_corpus, monkeypatch):
    from cag.config import get_settings
    from cag.engine import Engine

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    e = Engine(get_settings(answer_room=64), lm=tiny_lm)
    e.ingest(str(small_corpus), name="notes")
    return e


def wait_job(c, job: dict, timeout_s: float = 60) -> dict:
    """Poll a refresh job until it is neither queued nor running; its last state."""
    deadline = time.monotonic() + timeout_s
    while job["status"] in ("queued", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        job = c.get(f"/v1/jobs/{job['id']}").json()
    return job


@contextmanager
def app_client(engine, **settings):
    from fastapi.testclient import TestClient

    from cag.api.app import create_app
    from cag.api.settings import ApiSettings

    app = create_app(ApiSettings(**settings), engine=engine)
    with TestClient(app, raise_server_exceptions=False, base_url=LOCAL) as c:
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        yield c


def _err(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "code"}, body
    if code:
        assert body["error"]["code"] == code, body
    return body["error"]


def test_health_is_503_until_the_model_is_loaded(tiny_model_dir, monkeypatch):
    from fastapi.testclient import TestClient

    from cag.api.app import create_app
    from cag.config import get_settings
    from cag.engine import Engine

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    engine = Engine(get_settings())
    engine._lm_lock.acquire()  # hold the model load where it starts, to look at the server meanwhile
    try:
        with TestClient(create_app(engine=engine), base_url=LOCAL) as c:
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            _err(c.get("/v1/models"), 503, "not_ready")
            _err(c.post("/v1/ask", json={"corpus": "x", "question": "y"}), 503, "not_ready")
            engine._lm_lock.release()
            assert 503 in wait_healthy_client(c)
    finally:
        if engine._lm_lock.locked():
            engine._lm_lock.release()

    broken = Engine(get_settings(model=str(tiny_model_dir / "missing")))
    with TestClient(create_app(engine=broken), base_url=LOCAL) as c:
        deadline = time.monotonic() + 30
        while (r := c.get("/health")).json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert r.status_code == 503 and r.json()["status"] == "error"
        assert "failed to load" in _err(c.get("/v1/corpora"), 503, "not_ready")["message"]
        # the reason names the model's path: the server's log has it, callers (unauthenticated on
        # /health) get no more than "failed"
        assert "missing" in broken.settings.model
        assert "missing" not in r.text and "missing" not in c.get("/v1/corpora").text


def wait_healthy_client(c) -> list[int]:
    seen, deadline = [], time.monotonic() + 30
    while time.monotonic() < deadline:
        seen.append(c.get("/health").status_code)
        if seen[-1] == 200:
            return seen
        time.sleep(0.02)
    raise TimeoutError(seen)


def test_limits_and_validation_errors(engine):
    with app_client(engine, max_body_bytes=2000, max_question_chars=100) as c:
        _err(c.post("/v1/ask", content=b"{" + b" " * 3000 + b"}", headers={"content-type": "application/json"}),
             413, "too_large")
        chunked = iter([b'{"corpus": "notes", "question": "', b"x" * 2500, b'"}'])  # no Content-Length
        _err(c.post("/v1/ask", content=chunked, headers={"content-type": "application/json"}), 413, "too_large")
        _err(c.post("/v1/ask", json={"corpus": "notes", "question": "q" * 101}), 413, "too_large")
        _err(
            c.post(
                "/v1/chat/completions", json={"model": "notes", "messages": [{"role": "user", "content": "q" * 101}]}
            ),
            413,
            "too_large",
        )

        ok = c.post("/v1/ask", json={"corpus": "notes", "question": "Who keeps the lighthouse?", "max_tokens": 10**6})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 64  # clamped to answer_room

        cases = [
            ({"corpus": "notes"}, "question"),
            ({"corpus": "notes", "question": "q", "mode": "bogus"}, "mode"),
            ({"corpus": "notes", "question": "q", "max_tokens": 0}, "max_tokens"),
            ({"corpus": "notes", "question": "q", "min_tokens": -1}, "min_tokens"),
            ({"corpus": "notes", "question": "q", "on_stale": "maybe"}, "on_stale"),
            ({"corpus": "notes", "question": ""}, "question"),
            ({"corpus": "notes", "question": ["not", "text"]}, "question"),
        ]
        for body, param in cases:
            assert _err(c.post("/v1/ask", json=body), 400, "invalid_request")["param"] == param
        _err(c.post("/v1/ask", json={"corpus": "notes", "question": "   "}), 400, "bad_request")  # engine: empty
        _err(c.post("/v1/ask", content=b"{not json", headers={"content-type": "application/json"}), 400)
        _err(c.post("/v1/ask", content=b"corpus=notes", headers={"content-type": "application/x-www-form-urlencoded"}),
             400)
        _err(c.post("/v1/ask", json={"corpus": "nope", "question": "q"}), 404, "not_found")
        chat = {"model": "notes", "messages": [{"role": "user", "content": "q"}]}
        _err(c.post("/v1/chat/completions", json={**chat, "messages": []}), 400)
        _err(c.post("/v1/chat/completions", json={**chat, "n": 2}), 400)
        _err(c.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": []}]}), 400)
        _err(c.get("/v1/corpora/nope"), 404, "not_found")
        _err(c.get("/v1/models/nope"), 404, "not_found")
        _err(c.get("/v1/jobs/job_nope"), 404, "not_found")
        _err(c.post("/v1/corpora/nope/refresh"), 404, "not_found")
        _err(c.get("/v1/no-such-route"), 404, "not_found")
        _err(c.get("/v1/ask"), 405, "method_not_allowed")

        # strict types: what the schema says is what is accepted (no 0 for false, no "5" for 5)
        ask = {"corpus": "notes", "question": "q", "max_tokens": 2}
        for field, value in [("include_token_ids", 0), ("include_token_ids", "true"), ("stream", 1),
                             ("max_tokens", "5"), ("max_tokens", 2.5), ("max_tokens", True), ("min_tokens", "2")]:
            assert _err(c.post("/v1/ask", json={**ask, field: value}), 400, "invalid_request")["param"] == field
        _err(c.post("/v1/chat/completions", json={**chat, "stream": True, "stream_options": {"include_usage": 1}}),
             400, "invalid_request")
        assert c.post("/v1/ask", json={**ask, "include_token_ids": True}).status_code == 200
        assert c.post("/v1/ask", json={**ask, "max_tokens": 2.0}).status_code == 200  # JSON Schema: an integer
        fixed = c.post("/v1/ask", json={**ask, "max_tokens": 6, "min_tokens": 6}).json()
        assert fixed["usage"]["completion_tokens"] == 6 and fixed["finish_reason"] == "length"
        _err(c.post("/v1/chat/completions", json={**chat, "min_tokens": -1}), 400, "invalid_request")


def test_sampling_parameters_at_their_limits_are_answers_not_500(engine):
    """A vanishing temperature is greedy; top_p keeps at least the most likely token; any integer
    seed is taken modulo 2**64 (torch's range: -1 and 2**64-1 were already the same seed there)."""
    chat = {"model": "notes", "messages": [{"role": "user", "content": "Who keeps the lighthouse?"}], "max_tokens": 8}

    def content(**sampling) -> str:
        r = c.post("/v1/chat/completions", json={**chat, **sampling})
        assert r.status_code == 200, (sampling, r.text)
        return r.json()["choices"][0]["message"]["content"]

    with app_client(engine) as c:
        greedy = content()
        for t in (1e-40, 5e-324, 1e-6):  # inf/nan probabilities before
            assert content(temperature=t, seed=7) == greedy, t
        for t in (1.0, 2.0):  # an empty nucleus before: only the most likely token is left
            assert content(temperature=t, top_p=1e-300, seed=7) == greedy, t
        # torch.Generator.manual_seed overflowed beyond -2**63 .. 2**64-1: 500 before
        sampled = {seed: content(temperature=2.0, seed=seed) for seed in (0, 5, 2**64, 2**64 + 5, -1, 2**64 - 1,
                                                                          -(2**63) - 1, 10**30)}
        assert sampled[2**64] == sampled[0] and sampled[2**64 + 5] == sampled[5] and sampled[-1] == sampled[2**64 - 1]
        assert len(set(sampled.values())) > 1, "different seeds should sample differently at temperature 2"
        assert content(temperature=2.0, seed=5) == sampled[5]


def test_a_corrupt_snapshot_is_503_until_a_refresh_rebuilds_it(engine):
    row = engine.index.snapshot(engine.index.corpus("notes")["current_snapshot"])
    path = Path(row["path"])
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)  # tensor bytes (the header is at the front): the checksum no longer matches
    path.write_bytes(bytes(data))
    with app_client(engine) as c:
        err = _err(c.post("/v1/ask", json={"corpus": "notes", "question": "Who keeps the lighthouse?"}), 503,
                   "snapshot_corrupt")
        assert err["type"] == "server_error"
        job = c.post("/v1/corpora/notes/refresh").json()
        job = wait_job(c, job)
        assert job["status"] == "done", job
        assert c.post("/v1/ask", json={"corpus": "notes", "question": "Who keeps the lighthouse?",
                                       "max_tokens": 4}).status_code == 200


def test_a_full_queue_answers_429_with_retry_after(engine):
    with app_client(engine, workers=1, max_queue=0) as c:
        barrier = threading.Barrier(12)

        def one(i):
            barrier.wait()
            return c.post("/v1/ask", json={"corpus": "notes", "question": QUESTIONS[i % 8], "max_tokens": 64})

        with ThreadPoolExecutor(12) as pool:
            responses = list(pool.map(one, range(12)))
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) == {200, 429} and statuses.count(200) >= 1, statuses
        for r in responses:
            if r.status_code == 429:
                _err(r, 429, "queue_full")
                assert int(r.headers["retry-after"]) >= 1
        # the queue drains: a later request is served again (a worker frees its slot a moment after its
        # answer is sent, so one sent at once may still see it taken)
        deadline = time.monotonic() + 10
        while (r := c.post("/v1/ask", json={"corpus": "notes", "question": "q", "max_tokens": 2})).status_code == 429:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert r.status_code == 200


def test_the_request_timeout_stops_generation_with_504(engine):
    from cag.store.index import Index

    with app_client(engine, request_timeout_s=0.02) as c:
        q = "A question that will not finish in 20 ms?"
        _err(c.post("/v1/ask", json={"corpus": "notes", "question": q, "max_tokens": 64}), 504, "timeout")
        index = Index(engine.settings.index_path)
        deadline = time.monotonic() + 20
        while not (rows := [r for r in index.queries("notes") if r["question"] == q]):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert rows[0]["completion_tokens"] < 64
        assert _stopped(c.get("/metrics").text, "timeout") >= 1


def test_stale_corpus_refuse_409_then_refresh_job(engine, small_corpus):
    with app_client(engine) as c:
        (small_corpus / "c.md").write_text("The bakery on Quay Street now sells rye bread every day.\n")
        status = c.get("/v1/corpora/notes").json()
        assert status["stale"] is True and status["reasons"]
        body = {"corpus": "notes", "question": "What does the bakery sell?", "max_tokens": 4}
        _err(c.post("/v1/ask", json={**body, "on_stale": "refuse"}), 409, "stale")
        served = c.post("/v1/ask", json=body).json()  # default policy: serve, flagged
        assert served["stale"] is True and served["stale_reasons"]

        r = c.post("/v1/corpora/notes/refresh")
        assert r.status_code == 202
        job = r.json()
        assert r.headers["location"] == f"/v1/jobs/{job['id']}" and job["corpus"] == "notes"
        job = wait_job(c, job)
        assert job["status"] == "done", job
        assert job["progress"] == 1.0 and job["result"]["status"] == "refreshed"
        assert job["reused_tokens"] > 0 and job["done_tokens"] == job["total_tokens"] > 0  # only c.md re-prefilled
        assert c.get("/v1/corpora/notes").json()["stale"] is False
        fresh = c.post("/v1/ask", json={**body, "on_stale": "refuse"})
        assert fresh.status_code == 200 and fresh.json()["stale"] is False
        assert "cag_refresh_jobs_total{status=\"done\"} 1.0" in c.get("/metrics").text


def test_cors_is_off_unless_configured(engine):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with app_client(engine) as c:
        r = c.get("/v1/corpora", headers={"Origin": "https://app.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert "access-control-allow-origin" not in c.options("/v1/ask", headers=preflight).headers
    with app_client(engine, cors_origins="https://app.example", api_keys=KEY) as c:
        r = c.options("/v1/ask", headers=preflight)  # preflight needs no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.get("/v1/corpora", headers={"Origin": "https://app.example", **AUTH})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = c.get("/v1/corpora", headers={"Origin": "https://evil.example", **AUTH})
        assert "access-control-allow-origin" not in r.headers


def test_full_mode_and_openapi_docs(engine):
    with app_client(engine) as c:
        full = c.post("/v1/ask", json={"corpus": "notes", "question": "Who keeps the lighthouse?", "mode": "full",
                                       "max_tokens": 6})
        assert full.status_code == 200 and full.json()["usage"]["cached_tokens"] == 0
        assert full.json()["timings"]["load_ms"] == 0
        rag = c.post("/v1/ask", json={"corpus": "notes", "question": "When does the ferry leave?", "mode": "rag",
                                      "max_tokens": 6})
        assert rag.status_code == 200, rag.text
        assert rag.json()["usage"]["cached_tokens"] == 0 and rag.json()["passages"]
        assert "token_ids" not in full.json() and "passages" not in full.json() and full.json()["snapshot"]
        assert c.get("/docs").status_code == 200
        spec = c.get("/openapi.json").json()
        assert {"/v1/ask", "/v1/chat/completions", "/v1/models", "/v1/corpora", "/v1/corpora/{name}",
                "/v1/corpora/{name}/refresh", "/v1/jobs/{job_id}", "/health", "/metrics"} <= set(spec["paths"])
        assert "422" not in spec["paths"]["/v1/ask"]["post"]["responses"]
