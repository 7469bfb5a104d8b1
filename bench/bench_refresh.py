"""Refresh benchmark (issue: freshness). A corpus of N documents (~6K tokens, essays split in
parts): full rebuild vs incremental refresh after editing the last document, a middle one, and
adding one. Target: refresh time <= 1.2 x (prefilled / total tokens) x full rebuild time.
Writes bench/results/refresh.json and refresh.md.  Run: `python -m bench.bench_refresh`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from cag.config import get_settings
from cag.engine import Engine

from .common import essay_corpus, machine, write


def split_into_docs(src: Path, dst: Path, n_docs: int) -> list[Path]:
    lines = "\n".join(p.read_text() for p in sorted(src.glob("*.txt"))).splitlines()
    dst.mkdir(parents=True, exist_ok=True)
    per = len(lines) // n_docs + 1
    paths = []
    for i in range(n_docs):
        p = dst / f"part-{i:02d}.md"
        p.write_text("\n".join(lines[i * per : (i + 1) * per]))
        paths.append(p)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--docs", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        engine = Engine(get_settings(home=tmp / "home", models_dir_override=get_settings().models_dir))
        lm = engine.lm
        count = lambda t: len(lm.tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
        docs = split_into_docs(essay_corpus(tmp / "essays", args.tokens, count), tmp / "corpus", args.docs)
        engine.ingest(str(tmp / "corpus"), name="bench")  # warm-up build (first forward costs extra)

        def run(label: str, change, force: bool = False) -> dict:
            change()
            t = time.perf_counter()
            r = engine.ingest("bench", force=force)
            wall = (time.perf_counter() - t) * 1e3
            return {"case": label, "wall_ms": wall, "prefill_ms": r.prefill_ms, "n_tokens": r.n_tokens,
                    "reused_tokens": r.reused_tokens, "prefilled_tokens": r.prefilled_tokens, "status": r.status}

        def edit(p: Path):
            return lambda: p.write_text(p.read_text() + "\nEdited: one more line at the end.")

        rows = [run("full rebuild", lambda: None, force=True)]
        full_ms = rows[0]["wall_ms"]
        rows.append(run("edit last document", edit(docs[-1])))
        rows.append(run("edit a middle document", edit(docs[len(docs) // 2])))
        rows.append(run("add a document", lambda: (tmp / "corpus" / "zz-new.md").write_text(
            "A short new note appended to the corpus.\n" * 20)))
        rows.append(run("full rebuild (after)", lambda: None, force=True))
        full_ms = (full_ms + rows[-1]["wall_ms"]) / 2
        for r in rows:
            r["expected_ms"] = r["prefilled_tokens"] / r["n_tokens"] * full_ms
            r["ratio_to_expected"] = r["wall_ms"] / r["expected_ms"] if r["expected_ms"] else 0.0
        table = (
            f"Machine: {machine()}. Model: {lm.name}. {len(docs)} documents, ~{args.tokens} tokens. Times are the "
            "whole `ingest` call (scan, hash, tokenize, load old snapshot, prefill, save, index).\n\n"
            "| case | tokens | reused | prefilled | time ms | expected ms (prefilled/total x full) | ratio (target <= "
            "1.2) |\n"
            "|---|---|---|---|---|---|---|\n"
            + "".join(
                f"| {r['case']} | {r['n_tokens']} | {r['reused_tokens']} | {r['prefilled_tokens']} | "
                f"{r['wall_ms']:.0f} | {r['expected_ms']:.0f} | {r['ratio_to_expected']:.2f} |\n"
                for r in rows
            )
        )
        write("refresh", {"machine": machine(), "rows": rows}, table)


if __name__ == "__main__":
    main()
