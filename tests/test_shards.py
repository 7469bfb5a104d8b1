"""Knowledge larger than one context: shards at document boundaries, one snapshot each, routing,
exactness over the routed shard, per-shard refresh."""

from __future__ import annotations

import pytest

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.knowledge.shards import Unit, doc_of, pack

DOCS = {
    "a-lighthouse.md": "The lighthouse keeper is Mara Voss. She lights the lamp at dusk and logs every ship.",
    "b-ferry.txt": "The ferry leaves the harbour at 7:15 every weekday and returns at 18:40 in the evening.",
    "c-bakery.md": "The bakery on Quay Street sells rye bread on Tuesdays only, and pretzels on Sundays.",
    "d-school.md": "The village school has forty pupils and one teacher, Mr Alder, who also plays the organ.",
}
ASKS = {  # a question routed to each document's shard (BM25 over the shards' text)
    "a-lighthouse.md": "Who is the lighthouse keeper?",
    "b-ferry.txt": "When does the ferry leave the harbour?",
    "c-bakery.md": "When does the bakery on Quay Street sell rye bread?",
    "d-school.md": "Who teaches at the village school?",
}


@pytest.fixture
def engine(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("CAG_KV_DTYPE", "float32")  # bit-identical state: cag == full exactly on the random model
    return Engine(get_settings())


def _shard_tokens(engine, town, per_shard: int) -> int:
    """A --shard-tokens that holds `per_shard` of these (similar-sized) documents."""
    one = engine.ingest(str(town), name="probe")
    overhead = one.n_tokens - sum(s["end"] - s["start"] for s in engine.index.snapshot_documents(one.snapshot))
    biggest = max(s["end"] - s["start"] for s in engine.index.snapshot_documents(one.snapshot))
    return overhead + per_shard * biggest


def test_a_corpus_that_fits_is_one_shard_with_the_same_snapshot(engine, town):
    a = engine.ingest(str(town), name="one")
    assert a.n_shards == 1 and a.shards[0]["snapshot"] == a.snapshot
    b = engine.ingest(str(town), name="again", shard_tokens=0)
    assert b.snapshot == a.snapshot  # same key: nothing about sharding enters an unsharded corpus


def test_sharded_ingest_routes_and_answers_exactly(engine, town):
    cap = _shard_tokens(engine, town, 2)
    r = engine.ingest(str(town), name="town", shard_tokens=cap)
    assert r.n_shards == 2 and len({s["snapshot"] for s in r.shards}) == 2
    assert all(s["n_tokens"] <= cap for s in r.shards) and r.n_tokens == sum(s["n_tokens"] for s in r.shards)
    assert r.bytes == sum(s["bytes"] for s in r.shards)
    ferry, (other, q) = _shard_of(engine, r, "b-ferry.txt"), _elsewhere(engine, r, "b-ferry.txt")
    a = engine.answer(Query("town", ASKS["b-ferry.txt"], max_tokens=12))
    assert len(a.shards) == 1 and a.shards[0]["shard"] == ferry and a.routing_ms > 0
    assert a.cached_tokens == r.shards[ferry]["n_tokens"] and a.snapshot == r.shards[ferry]["snapshot"]
    b = engine.answer(Query("town", q, max_tokens=12))
    assert b.shards[0]["shard"] == other and b.snapshot == r.shards[other]["snapshot"]
    full = engine.answer(Query("town", q, max_tokens=12, mode="full"))
    assert full.token_ids == b.token_ids and len(b.token_ids) == 12  # cag == full over the routed shard
    both = engine.answer(Query("town", q, max_tokens=12, shards=5))  # clamped to 2
    assert len(both.shards) == 2 and sum(s["chosen"] for s in both.shards) == 1
    assert all(s["mean_logprob"] is not None for s in both.shards)
    chosen = next(s for s in both.shards if s["chosen"])
    assert chosen["mean_logprob"] == max(s["mean_logprob"] for s in both.shards)
    assert len(engine.answer(Query("town", "Who?", max_tokens=2, shards=0)).shards) == 1  # clamped (the CLI warns)


def test_a_conversation_on_a_shard_counts_its_reused_turns_as_cached(tiny64_model_dir, town, monkeypatch):
    """cached_tokens = the shard's snapshot tokens + the kept conversation's, as on one snapshot (kept where
    every row is a decode row: int4 on cag's kernels)."""
    monkeypatch.setenv("CAG_MODEL", str(tiny64_model_dir))
    monkeypatch.setenv("CAG_WEIGHTS", "int4")
    engine = Engine(get_settings())
    if not engine.decoder.step.flat:  # AVX-512, AMX or AVX2: `auto` picks this CPU's
        pytest.skip(f"cag's kernels do not run here: {engine.lm.kernels_why}")
    r = engine.ingest(str(town), name="town", shard_tokens=_shard_tokens(engine, town, 2))
    q = ASKS["b-ferry.txt"] + " Please answer in one short sentence, naming the document."  # over 16 tokens: kept
    first = engine.answer(Query("town", None, max_tokens=8, messages=[{"role": "user", "content": q}]))
    shard = r.shards[first.shards[0]["shard"]]["n_tokens"]
    assert first.cached_tokens == shard and first.conversation_tokens == 0
    again = [
        {"role": "user", "content": q},
        {"role": "assistant", "content": first.answer},
        {"role": "user", "content": "Why?"},
    ]
    second = engine.answer(Query("town", None, max_tokens=8, messages=again))
    assert second.shards[0]["shard"] == first.shards[0]["shard"] and second.conversation_tokens >= 16
    assert second.cached_tokens == shard + second.conversation_tokens < second.prompt_tokens


def test_editing_a_document_reprefills_only_its_shard(engine, town):
    cap = _shard_tokens(engine, town, 2)
    first = engine.ingest(str(town), name="town", shard_tokens=cap)
    (town / "d-school.md").write_text(DOCS["d-school.md"].replace("forty", "fifty") + "\n")
    st = engine.status("town")
    assert st.stale and any("d-school.md" in r for r in st.reasons)
    again = engine.ingest("town")  # the cap is kept for the refresh
    assert [s["status"] for s in again.shards] == ["fresh", "refreshed"]
    assert again.shards[0]["snapshot"] == first.shards[0]["snapshot"]
    assert again.shards[1]["reused_tokens"] > 0 and again.prefilled_tokens < first.shards[1]["n_tokens"]
    (town / "e-mill.md").write_text("The old mill grinds barley on Mondays.\n")
    added = engine.ingest("town")
    assert added.n_shards == 3 or added.shards[-1]["status"] == "refreshed"  # filled the last shard, or opened one
    assert added.shards[0]["status"] == "fresh" and not engine.status("town").stale


def test_a_document_larger_than_a_shard_is_cut_into_parts(engine, town):
    cap = _shard_tokens(engine, town, 2)
    (town / "z-long.md").write_text(
        "\n\n".join(f"Paragraph {i} tells how the harbour wall was repaired in year {1900 + i}." for i in range(40))
    )
    r = engine.ingest(str(town), name="town", shard_tokens=cap)
    names = [s["path"] for sh in r.shards for s in engine.index.snapshot_documents(sh["snapshot"])]
    parts = [n for n in names if n.startswith("z-long.md#part")]
    assert len(parts) > 1 and {doc_of(n) for n in names} == set(DOCS) | {"z-long.md"}
    assert all(s["n_tokens"] <= cap for s in r.shards)
    assert not engine.status("town").stale  # parts count as their document for freshness
    a = engine.answer(Query("town", "When was the harbour wall repaired in paragraph 33?", max_tokens=4))
    assert any(n.startswith("z-long.md") for n in _docs_of(engine, a.snapshot))


def _docs_of(engine, digest):
    return [s["path"] for s in engine.index.snapshot_documents(digest)]


def _shard_of(engine, result, doc: str) -> int:
    """Which shard of an ingest result holds `doc` (packing decides, not prompt order alone)."""
    return next(i for i, sh in enumerate(result.shards) if doc in _docs_of(engine, sh["snapshot"]))


def _elsewhere(engine, result, doc: str) -> tuple[int, str]:
    """A shard other than `doc`'s and a question routed to it."""
    here = _shard_of(engine, result, doc)
    other = next(d for d in ASKS if _shard_of(engine, result, d) != here)
    return _shard_of(engine, result, other), ASKS[other]


def test_packing_keeps_units_in_their_shards():
    u = lambda n, t: Unit(n, n, "", "h", t)  # noqa: E731
    units = [u("a", 30), u("b", 30), u("c", 30), u("d", 30)]
    assert [[x.name for x in s.units] for s in pack(units, 70, 10)] == [["a", "b"], ["c", "d"]]
    firsts = [u("a", 60), u("b", 40), u("c", 20), u("d", 40)]  # c still fits shard 0 once b opened shard 1
    assert [[x.name for x in s.units] for s in pack(firsts, 100, 10)] == [["a", "c"], ["b", "d"]]
    new = pack(firsts + [u("e", 5), u("f", 40)], 100, 10, previous=[["a", "c"], ["b", "d"]])
    # new: last shard, then a new one
    assert [[x.name for x in s.units] for s in new] == [["a", "c"], ["b", "d", "e"], ["f"]]
    grown = [u("a", 30), u("b", 45), u("c", 30), u("d", 30), u("e", 5)]  # b grew, e is new
    shards = pack(grown, 100, 10, previous=[["a", "b"], ["c", "d"]])
    assert [[x.name for x in s.units] for s in shards] == [["a", "b"], ["c", "d", "e"]]
    uneven = [u("a", 40), u("b", 40), u("c", 80), u("d", 20)]  # first fit: [a, b] [c] [d], the last at 20
    assert [[x.name for x in s.units] for s in pack(uneven, 100, 10)] == [["a", "d"], ["b"], ["c"]]  # even: 60, 40, 80
    too_big = [u("a", 30), u("b", 60), u("c", 30), u("d", 30)]  # shard 0 no longer fits: repacked from there
    assert [[x.name for x in s.units] for s in pack(too_big, 90, 10, previous=[["a", "b"], ["c", "d"]])] == [
        ["a"],
        ["b"],
        ["c", "d"],
    ]


def test_a_lost_shard_is_named_rebuilt_and_the_others_still_serve(engine, town):
    from cag.errors import SnapshotCorrupt

    r = engine.ingest(str(town), name="town", shard_tokens=_shard_tokens(engine, town, 2))
    school, q = _elsewhere(engine, r, "b-ferry.txt")  # the shard that is lost, and a question for it
    before = engine.answer(Query("town", ASKS["b-ferry.txt"], max_tokens=8)).token_ids
    engine.evict()
    lost = engine.index.snapshot(r.shards[school]["snapshot"])["path"]
    with open(lost, "r+b") as f:  # damage the tensor bytes at the end of the file
        f.seek(-64, 2)
        f.write(b"\0" * 64)
    assert engine.answer(Query("town", ASKS["b-ferry.txt"], max_tokens=8)).token_ids == before  # its shard is sound
    with pytest.raises(SnapshotCorrupt, match=f"shard {school} of 'town'"):
        engine.answer(Query("town", q, max_tokens=8))
    assert any(x.startswith(f"shard {school}: snapshot is corrupt") for x in engine.status("town").reasons)
    again = engine.ingest("town")
    assert [s["status"] for s in again.shards] == ["built" if i == school else "fresh" for i in range(2)]
    assert engine.answer(Query("town", q, max_tokens=8)).completion_tokens == 8


def test_cli_ingest_and_ask_a_sharded_corpus(engine, town, tiny_model_dir, monkeypatch):
    import json

    from typer.testing import CliRunner

    from cag.cli.main import app

    cap = _shard_tokens(engine, town, 2)
    run = lambda *a: CliRunner().invoke(app, list(a))  # noqa: E731
    r = run("ingest", str(town), "--name", "town", "--shard-tokens", str(cap), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["n_shards"] == 2 and [s["n_tokens"] <= cap for s in out["shards"]] == [True, True]
    human = run("status", "town")
    assert "in 2 shards" in human.stdout
    r = run("ask", "town", "Who teaches at the village school?", "--shards", "9", "--max-tokens", "3", "--json")
    assert r.exit_code == 0 and "clamped to 2" in r.stderr
    assert len(json.loads(r.stdout)["shards"]) == 2


def test_a_sentence_longer_than_a_shard_is_cut_between_tokens_and_said_so(engine, town, tiny_model_dir, monkeypatch):
    from typer.testing import CliRunner

    from cag.cli.main import app

    cap = _shard_tokens(engine, town, 2)
    (town / "z-run-on.md").write_text(" ".join(f"word{i} and" for i in range(400)))  # one sentence, no boundary
    r = CliRunner().invoke(app, ["ingest", str(town), "--name", "town", "--shard-tokens", str(cap)])
    assert r.exit_code == 0, r.output
    cut = [line for line in r.stderr.splitlines() if line.startswith("warning: z-run-on.md#part")]
    assert cut and all(line.endswith("a sentence longer than a shard, cut between tokens") for line in cut)
    assert "skipped" not in r.stderr  # cut, not skipped: every part is in a shard
    names = [s["path"] for sh in engine.index.shards("town") for s in engine.index.snapshot_documents(sh["snapshot"])]
    assert len([n for n in names if n.startswith("z-run-on.md#part")]) == len(cut) > 1
