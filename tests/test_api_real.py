"""Tier 2: `cag serve` with the embedded SmolLM2 model answers like `cag ask` on corpora/handbook."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from bench.harness import cag_command, serving
from tests.conftest import HANDBOOK, REPO
from tests.test_api import sse_events

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def real_server(models_dir, tmp_path_factory):
    """`cag ingest` materializes the embedded model into models_dir on first use; the server loads it from there."""
    root = tmp_path_factory.mktemp("served-real")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAG_")}
    env.update(CAG_HOME=str(root / "home"), CAG_MODELS_DIR=str(models_dir))
    r = subprocess.run([*cag_command(), "ingest", str(HANDBOOK), "--json"], env=env, cwd=REPO, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    with serving(env, root / "server.log", timeout_s=180, cwd=REPO) as srv:
        yield srv.url, env


def test_served_answer_equals_cag_ask_on_the_handbook(real_server):
    import openai

    url, env = real_server
    q = "What is the name of the company VPN?"
    cli = subprocess.run([*cag_command(), "ask", "handbook", q, "--max-tokens", "24", "--json"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    want = json.loads(cli.stdout)

    r = httpx.post(f"{url}/v1/ask", json={"corpus": "handbook", "question": q, "max_tokens": 24}, timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["answer"] == want["answer"] and got["answer"]
    assert got["usage"] == {
        k: want[k] for k in ("prompt_tokens", "cached_tokens", "conversation_tokens", "completion_tokens")
    }
    assert got["usage"]["cached_tokens"] > 1000  # the handbook came from the snapshot

    with httpx.stream("POST", f"{url}/v1/ask", json={"corpus": "handbook", "question": q, "max_tokens": 24,
                                                     "stream": True}, timeout=300) as s:
        events = sse_events(s)
    assert "".join(json.loads(d)["text"] for e, d in events if e == "token") == want["answer"]

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    c = client.chat.completions.create(model="handbook", max_tokens=24, messages=[{"role": "user", "content": q}])
    assert c.choices[0].message.content == want["answer"]
    # the snapshot's tokens, and (a question of 16 tokens or more asked again) all but its last from the kept prompt
    cached = c.cag["cached_tokens"]
    assert cached["snapshot"] == want["cached_tokens"] - want["conversation_tokens"]
    assert c.usage.prompt_tokens_details.cached_tokens == cached["snapshot"] + cached["conversation"]
