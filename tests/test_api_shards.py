"""Sharded corpora over HTTP: unchanged for the client, with the shard(s) that answered reported."""

from __future__ import annotations

from cag.answering.query import Query
from tests.test_api import app_client
from tests.test_shards import DOCS


def test_sharded_corpus_is_served_unchanged_for_the_client(tiny_model_dir, tmp_path, monkeypatch):
    from cag.config import get_settings
    from cag.engine import Engine

    root = tmp_path / "town"
    root.mkdir()
    for name, text in DOCS.items():
        (root / name).write_text(text + "\n")
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    engine = Engine(get_settings())
    one = engine.ingest(str(root), name="probe")
    ing = engine.ingest(str(root), name="town", shard_tokens=one.n_tokens * 2 // 3)
    assert ing.n_shards == 2
    alone = engine.answer(Query("town", "Who teaches at the village school?", max_tokens=6))
    with app_client(engine) as c:
        r = c.post(
            "/v1/ask", json={"corpus": "town", "question": "Who teaches at the village school?", "max_tokens": 6}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["answer"] == alone.answer and body["snapshot"] == alone.snapshot
        # the chosen shard's tokens, plus what the kept conversation of the same question (asked just before) gave
        shard = alone.cached_tokens - alone.conversation_tokens
        assert body["usage"]["cached_tokens"] == shard + body["usage"]["conversation_tokens"] and shard < ing.n_tokens
        assert [s["shard"] for s in body["shards"]] == [alone.shards[0]["shard"]] and body["timings"]["routing_ms"] > 0
        assert body["timings"]["decode_tok_s"] > 0
        r = c.post("/v1/ask", json={"corpus": "town", "question": "Who teaches at the village school?", "max_tokens": 6,
                                    "shards": 2})
        assert len(r.json()["shards"]) == 2 and sum(s["chosen"] for s in r.json()["shards"]) == 1
        assert c.post("/v1/ask", json={"corpus": "town", "question": "Who?", "shards": 0}).status_code == 400
        chat = c.post("/v1/chat/completions", json={"model": "town", "max_tokens": 6, "messages": [
            {"role": "user", "content": "Who teaches at the village school?"}]}).json()
        assert chat["choices"][0]["message"]["content"] == alone.answer
        assert (
            chat["usage"]["prompt_tokens_details"]["cached_tokens"]
            == shard + chat["cag"]["cached_tokens"]["conversation"]
        )
        assert chat["cag"]["cached_tokens"]["snapshot"] == shard
        assert chat["cag"]["shards"][0]["shard"] == alone.shards[0]["shard"]
        unsharded = c.post("/v1/ask", json={"corpus": "probe", "question": "Who?", "max_tokens": 2}).json()
        assert "shards" not in unsharded and unsharded["timings"]["routing_ms"] == 0
