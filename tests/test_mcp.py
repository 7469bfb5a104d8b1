"""The MCP server (api/mcp_server.py) through the official `mcp` SDK's own client, against real servers:
`cag mcp` spawned as a subprocess (stdio), and a real `cag serve` on loopback (streamable HTTP at /mcp),
both on the tiny model and the `notes` corpus of tests/test_api.py. An MCP answer equals the REST
answer to the same question (same mode, greedy); cag's user errors are tool errors with the REST
error's message; CAG_API_KEYS guards /mcp as it guards the API.
"""

from __future__ import annotations

import json
import sys
from contextlib import asynccontextmanager

import anyio
import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import Context
from mcp.shared.exceptions import MCPError

from tests.conftest import REPO
from tests.test_api import DOCS, KEY, served_notes

OTHER_KEY = "test-key-2"
MAX_CHARS = 200  # CAG_MAX_QUESTION_CHARS of both servers: a longer question is refused
QUESTION = "When does the ferry leave?"
TOOLS = {"list_corpora", "ask_corpus", "corpus_status"}


@pytest.fixture(scope="module")
def served(tiny_model_dir, models_dir, tmp_path_factory):
    """One `notes` corpus and one `cag serve` with API keys; its env also starts `cag mcp`."""
    with served_notes(tmp_path_factory.mktemp("mcp"), tiny_model_dir, models_dir, CAG_API_KEYS=f"{KEY},{OTHER_KEY}",
                      CAG_MAX_QUESTION_CHARS=str(MAX_CHARS)) as (srv, env, home, corpus):
        yield srv.url, env, home


def rest(url: str, path: str, body: dict | None = None, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is None:
        return httpx.get(url + path, headers=headers, timeout=60)
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


@asynccontextmanager
async def http_client(url: str, key: str | None = KEY, statuses: list[int] | None = None, **kw):
    """The SDK's client on `url`/mcp with `key` as Bearer key; the HTTP statuses it got go to `statuses`."""
    async def seen(response) -> None:
        if statuses is not None:
            statuses.append(response.status_code)

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx2.AsyncClient(headers=headers, timeout=60, event_hooks={"response": [seen]}) as hc, \
            Client(streamable_http_client(f"{url}/mcp", http_client=hc), **kw) as client:
        yield client


def run(main) -> None:
    """anyio.run(main), with a failure inside the client's task groups raised as itself."""
    try:
        anyio.run(main)
    except BaseException as e:  # an exception group, 3.10's backport or 3.11's builtin
        while getattr(e, "exceptions", None) and len(e.exceptions) == 1:
            e = e.exceptions[0]
        raise e from None


def result(r) -> dict:
    """A successful tool call's structured result, which its text content repeats as JSON."""
    assert not r.is_error, r.content
    assert json.loads(r.content[0].text) == r.structured_content
    return r.structured_content


def tool_error(r) -> str:
    assert r.is_error and r.structured_content is None
    return r.content[0].text


async def check_tools(client, url: str) -> None:
    """What both transports must answer, checked against the REST API of the server at `url`."""
    tools = {t.name: t for t in (await client.list_tools()).tools}
    assert set(tools) == TOOLS
    ask_schema = tools["ask_corpus"].input_schema
    assert ask_schema["required"] == ["corpus", "question"]
    assert ask_schema["properties"]["mode"]["enum"] == ["cag", "full", "rag", "cag+rag"]
    assert all(t.annotations.read_only_hint for t in tools.values())

    listed = result(await client.call_tool("list_corpora", {}))["corpora"]
    want = {c["name"]: c for c in rest(url, "/v1/corpora").json()["corpora"]}
    assert [c["name"] for c in listed] == ["notes"]
    notes = listed[0]
    assert notes["freshness"] == "fresh" and notes["stale_reasons"] == []
    for field in ("n_tokens", "bytes", "n_documents", "snapshot"):
        assert notes[field] == want["notes"][field], field
    assert notes["n_tokens"] > 0 and notes["n_shards"] == 1 and notes["size"]

    status = result(await client.call_tool("corpus_status", {"corpus": "notes"}))
    assert status["name"] == "notes" and status["freshness"] == "fresh" and status["reasons"] == []
    assert status["n_documents"] == len(DOCS) and status["snapshot"] == notes["snapshot"]

    for mode in ("cag", "rag", "cag+rag"):
        got = result(await client.call_tool("ask_corpus", {"corpus": "notes", "question": QUESTION, "mode": mode,
                                                           "max_tokens": 8}))
        r = rest(url, "/v1/ask", {"corpus": "notes", "question": QUESTION, "mode": mode, "max_tokens": 8})
        assert r.status_code == 200, r.text
        want = r.json()
        assert got["answer"] == want["answer"] and got["mode"] == mode and got["corpus"] == "notes"
        assert got["finish_reason"] == want["finish_reason"] and got["stale"] is False
        for k in ("prompt_tokens", "completion_tokens"):
            assert got["usage"][k] == want["usage"][k], k
        snapshot = lambda u: u["cached_tokens"] - u["conversation_tokens"]  # noqa: E731 (a kept conversation may add to it)
        assert snapshot(got["usage"]) == snapshot(want["usage"])
        if mode == "cag":
            assert got["usage"]["cached_tokens"] > 0 and "passages" not in got and "sources" not in got
        else:  # what was retrieved, and the documents read: rag's passages, cag+rag's quoted one
            assert got["passages"] == want["passages"] and got["passages"]
            quoted = {p["doc_id"] for p in got["passages"] if p.get("quoted", True)}
            assert set(got["sources"]) == quoted and quoted <= set(DOCS) and quoted

    # cag's user errors: tool errors carrying the message the REST API gives for the same input
    for args, status_code in (({"corpus": "nope", "question": QUESTION}, 404),
                              ({"corpus": "notes", "question": "x" * (MAX_CHARS + 1)}, 413)):
        message = tool_error(await client.call_tool("ask_corpus", {"max_tokens": 8, **args}))
        r = rest(url, "/v1/ask", {"max_tokens": 8, **args})
        assert r.status_code == status_code and message == r.json()["error"]["message"], args
    assert message.startswith(f"question is {MAX_CHARS + 1} characters")
    # ... and the engine's own, where the REST schema refuses first (as `cag ask` prints them)
    message = tool_error(
        await client.call_tool("ask_corpus", {"corpus": "notes", "question": QUESTION, "mode": "bogus"})
    )
    assert message.startswith("unknown mode 'bogus'") and "\n" not in message
    assert tool_error(await client.call_tool("ask_corpus", {"corpus": "notes", "question": QUESTION,
                                                            "max_tokens": 0})) == "max_tokens must be at least 1"
    status_error = tool_error(await client.call_tool("corpus_status", {"corpus": "nope"}))
    assert status_error == rest(url, "/v1/corpora/nope").json()["error"]["message"]
    # the server still answers after the errors
    assert result(await client.call_tool("list_corpora", {}))["corpora"][0]["name"] == "notes"


# -- streamable HTTP on `cag serve` --------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_http_tools_answer_as_the_rest_api(served, mode):
    """`auto` discovers the 2026 protocol; `legacy` is the initialize handshake older clients use."""
    url, _, _ = served

    async def main():
        async with http_client(url, mode=mode) as client:
            await check_tools(client, url)

    run(main)


def test_http_needs_a_key_when_keys_are_set(served):
    url, _, _ = served
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}},
    }
    headers = {"Accept": "application/json, text/event-stream"}
    for auth in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(f"{url}/mcp", json=init, headers={**headers, **auth}, timeout=30)
        assert r.status_code == 401, (auth, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(f"{url}/mcp", json=init, headers={**headers, "Authorization": f"Bearer {OTHER_KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["result"]["serverInfo"]["name"] == "cag"

    async def refused(key):
        statuses = []
        with pytest.raises(Exception) as e:  # noqa: B017 - the SDK reports an HTTP error as its own MCPError
            async with http_client(url, key=key, statuses=statuses) as client:
                await client.list_tools()
        assert statuses and set(statuses) == {401}, statuses
        error = e.value
        while getattr(error, "exceptions", None):  # the client's task groups
            error = error.exceptions[0]
        assert isinstance(error, MCPError), repr(error)

    async def main():
        await refused(None)
        await refused("wrong-key")
        async with http_client(url, key=OTHER_KEY) as client:
            assert {t.name for t in (await client.list_tools()).tools} == TOOLS

    run(main)
    assert "/mcp" not in rest(url, "/openapi.json").json()["paths"]  # the protocol's endpoint, not a REST route


def test_http_calls_carry_the_key_scope(tiny):
    """A tool call over HTTP answers in its API key's scope (api/auth.py: what keeps one key's kept
    conversations from another's), as POST /v1/ask does; in-process, with a tool that reports it."""
    import hashlib
    import threading
    import time

    import uvicorn

    from bench.harness import free_port
    from cag.api.app import create_app
    from cag.api.auth import scope_of
    from cag.api.mcp_server import _scope
    from cag.api.settings import ApiSettings

    app = create_app(ApiSettings(api_keys=f"{KEY},{OTHER_KEY}"))

    async def whoami(ctx: Context) -> str:
        return str(_scope(ctx))

    app.state.mcp.add_tool(whoami)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started

        async def main():
            for mode in ("auto", "legacy"):
                for key in (KEY, OTHER_KEY):
                    async with http_client(url, key=key, mode=mode) as client:
                        r = await client.call_tool("whoami", {})
                    assert r.content[0].text == scope_of(hashlib.sha256(key.encode()).digest()), (mode, key)

        run(main)
    finally:
        server.should_exit = True
        thread.join(30)


# -- stdio: `cag mcp` ----------------------------------------------------------------------------
def test_stdio_tools_answer_as_the_rest_api(served, tmp_path):
    """`cag mcp` on the same CAG_HOME as the HTTP server (the index is shared; answers are the same)."""
    url, env, _ = served
    params = StdioServerParameters(command=sys.executable, args=["-m", "cag", "mcp"], env=env, cwd=str(REPO))

    async def main():
        with open(tmp_path / "mcp.log", "w") as errlog:
            async with Client(stdio_client(params, errlog=errlog)) as client:
                assert client.server_info.name == "cag"
                await check_tools(client, url)

    try:
        run(main)
    finally:
        print((tmp_path / "mcp.log").read_text()[-4000:], file=sys.stderr)
