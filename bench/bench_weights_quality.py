"""Answer quality per CAG_WEIGHTS format, against fp32, on the same snapshots (one run).

Questions: corpora/handbook's gold questions and the first N SQuAD v1.1 dev questions (one per
paragraph; paragraphs packed into knowledge folders of about 1,500 tokens). Every format answers
every question from the same snapshots (prefill never uses the packed weights). Reported per
format: how often the first 32 tokens equal fp32's, F1 and answer-in-output with 95% bootstrap
intervals (compare.stats), and on the handbook how often `cag` equals `full` within the format.
Writes bench/results/weights-quality.json and .md.  Run: `python -m bench.bench_weights_quality`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from cag.answering.query import Query
from cag.compare import metrics, stats
from cag.compare.datasets import load_squad
from cag.config import get_settings
from cag.engine import Engine

from .common import REPO, machine, write


def squad_folders(root: Path, n_questions: int, tokens_per_folder: int = 1500) -> list[tuple[str, list]]:
    """(folder name, [(question, answers)]) with one question per paragraph, ~1.5K tokens a folder."""
    corpus = load_squad()
    first_q = {}
    for q in corpus.questions:
        first_q.setdefault(q.gold_doc_ids[0], q)
    out, folder, items, size = [], None, [], 0
    for doc in corpus.docs:
        if doc.doc_id not in first_q:
            continue
        if folder is None or size > tokens_per_folder * 4:  # ~4 characters a token
            if folder is not None:
                out.append((folder.name, items))
            folder, items, size = root / f"squad{len(out)}", [], 0
            folder.mkdir(parents=True)
        (folder / f"{len(items):03d}.txt").write_text(doc.text)
        q = first_q[doc.doc_id]
        items.append((q.question, q.answers))
        size += len(doc.text)
        if sum(len(i) for _, i in out) + len(items) >= n_questions:
            break
    out.append((folder.name, items))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", default="fp32,bf16,int8,int4")
    ap.add_argument("--squad", type=int, default=100)
    ap.add_argument("--handbook", type=int, default=0, help="only the first N handbook questions (0: all)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--name", default="weights-quality", help="results file name in bench/results (a partial run: another name)"
    )
    args = ap.parse_args()
    formats = args.formats.split(",")
    handbook = [
        json.loads(line)
        for line in (REPO / "corpora/handbook/questions.jsonl").read_text().splitlines()
        if line.strip()
    ][: args.handbook or None]
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        sets = [("handbook", [(q["question"], q["answers"]) for q in handbook])] + squad_folders(Path(tmp), args.squad)
        engines = {
            f: Engine(get_settings(home=home, weights=f, models_dir_override=get_settings().models_dir))
            for f in formats
        }
        first = engines[formats[0]]
        for name, _ in sets:
            first.ingest(str(REPO / "corpora/handbook") if name == "handbook" else str(Path(tmp) / name), name=name)
        answers: dict[str, list] = {f: [] for f in formats}
        cag_eq_full: dict[str, list[bool]] = {f: [] for f in formats}
        for f, engine in engines.items():
            for name, items in sets:
                for q, golds in items:
                    a = engine.answer(Query(name, q, max_tokens=args.max_tokens))
                    answers[f].append((a.token_ids, a.answer, golds, name == "handbook", a.decode_tok_s))
                    if name == "handbook":
                        full = engine.answer(Query(name, q, max_tokens=args.max_tokens, mode="full"))
                        cag_eq_full[f].append(full.token_ids == a.token_ids)
            engine.evict()
            print(f, "done", flush=True)
    ref = answers["fp32"] if "fp32" in answers else answers[formats[0]]
    rows = []
    for f in formats:
        same = [a[0] == r[0] for a, r in zip(answers[f], ref)]
        row = {"weights": f, "kernels": engines[f].lm.kernels, "n": len(same), "same_as_fp32": sum(same) / len(same),
               "same_handbook": sum(s for s, a in zip(same, answers[f]) if a[3]) / sum(a[3] for a in answers[f]),
               "cag_equals_full_handbook": sum(cag_eq_full[f]) / len(cag_eq_full[f])}
        for metric, fn in (("f1", metrics.f1), ("in_output", metrics.answer_in_output)):
            est = stats.bootstrap([fn(a[1], a[2]) for a in answers[f]])
            row[metric] = est.as_dict()
        rows.append(row)
        print(row, flush=True)
    fmt = lambda e: f"{e['value']:.3f}" + (f" [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}]" if e["ci95"] else "")  # noqa: E731
    head = (
        f"Machine: {machine()}. SmolLM2-135M, fp16 snapshots, greedy, {args.max_tokens} tokens; {len(handbook)} "
        f"handbook + {rows[0]['n'] - len(handbook)} SQuAD questions.\n\n"
        "| weights | first 32 tokens = fp32 (all / handbook) | F1 [95% CI] | answer in output [95% CI] | cag == full "
        "(handbook) |\n"
        "|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['weights']} ({r['kernels']} kernels) | {100 * r['same_as_fp32']:.0f}% / {100 * r['same_handbook']:.0f}% "
        f"| {fmt(r['f1'])} | {fmt(r['in_output'])} | {100 * r['cag_equals_full_handbook']:.0f}% |\n"
        for r in rows
    )
    write(args.name, {"machine": machine(), "rows": rows}, head + body)


if __name__ == "__main__":
    main()
