"""The prompt, tuned on data: variants of the instruction and of cag+rag's quote, each asked on the same questions
of the shared datasets through `cag compare`'s machinery, paired against the prompt cag ships.

    python -m bench.bench_prompt --dataset squad --size 4000 --questions 50 --name prompt-squad

Each variant gets a home of its own under --work (its snapshots: the instruction is in every snapshot's key) and a
compare run of its own under bench/results/NAME/VARIANT; the report pairs every variant with `base` per mode (mean
ΔF1 first sentence and Δanswer in output with 95% bootstrap intervals, compare.stats) and writes
bench/results/NAME/report.md. Variants:

* base: the shipped instruction (cag.model.prompt.INSTRUCTION), the quote before the question;
* phrase: answer with the words of the knowledge alone (a name, number, date or short phrase);
* sentence: one sentence that starts with the answer;
* no-refusal: the shipped instruction without its "say you do not know";
* question-first: cag+rag's question before its quoted passages (a quote then cannot be warmed ahead:
  cag.answering.quotes).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.common import RESULTS
from compare.results import read_rows
from compare.stats import bootstrap

BASE = None  # the shipped instruction
VARIANTS: dict[str, dict] = {
    "base": {},
    "phrase": {"instruction": "You answer questions using only the knowledge below. Reply with the answer alone: the "
                              "name, number, date or short phrase from the knowledge that answers the question."},
    "sentence": {"instruction": "You answer questions using only the knowledge below. Answer in one short sentence "
                                "that starts with the answer, using the exact words of the knowledge."},
    "no-refusal": {"instruction": "You answer questions using only the knowledge below. Answer briefly, with the "
                                  "exact words of the knowledge where possible."},
    "question-first": {"question_first": True},
}


def apply(variant: dict) -> None:
    """Lay prompts out as `variant` says, in this process (every Engine made after it)."""
    from cag.answering import retrieval
    from cag.model import prompt

    if (text := variant.get("instruction")) is not None:
        prompt.INSTRUCTION = text
        prompt.SYSTEM, prompt.OPENINGS = prompt.openings(text)
    if variant.get("question_first"):
        shipped = retrieval.quoted

        def quoted(passages, question):  # the shipped quote, its question moved to the front
            head_and_passages = shipped(passages, question).rpartition("\nQuestion: ")[0]
            return f"Question: {question}\n\n{head_and_passages}"

        retrieval.quoted = quoted


def run_variant(name: str, args, out: Path, work: Path) -> None:
    """One variant's compare run into `out`, its home and corpora under `work` (in a child process: the patches
    stay there)."""
    apply(VARIANTS[name])
    from cag.config import get_settings
    from cag.engine import Engine
    from cag.rag.index import retrieve
    from compare.run_config import CompareConfig
    from compare.runner import run_compare

    os.environ["CAG_HOME"] = str(work / "home")
    engine = Engine(get_settings(), retrieval=retrieve)
    cfg = CompareConfig(dataset=args.dataset, out=out, sizes=[args.size], questions=args.questions,
                        max_sets=args.max_sets, full_sample=0, modes=args.modes.split(","), ks=[1], k_main=1,
                        k_sample=args.questions,
                        max_tokens=32, corpora=work / "corpora", resume=(out / "results.jsonl").exists())
    run_compare(engine, cfg, log=lambda s: print(f"[{name}] {s}", flush=True))


def pair(folder: Path, names: list[str]) -> list[str]:
    """Markdown rows: each variant against base, per mode."""
    rows = {n: [r for r in read_rows(folder / n / "results.jsonl") if r.ok] for n in names}
    by = {n: {(r.mode, r.set, r.qid): r for r in rs} for n, rs in rows.items()}
    out = ["| variant | mode | n | F1 first sentence | answer in output | ΔF1 first sentence vs base | "
           "Δanswer in output vs base |", "|---|---|---:|---:|---:|---:|---:|"]
    for n in names:
        for mode in sorted({m for m, _, _ in by[n]}):
            mine = {k[1:]: r for k, r in by[n].items() if k[0] == mode}
            base = {k[1:]: r for k, r in by["base"].items() if k[0] == mode}
            both = sorted(set(mine) & set(base))
            f1 = bootstrap([mine[q].f1_first for q in mine])
            aio = bootstrap([float(mine[q].answer_in_output) for q in mine])
            d_f1 = bootstrap([mine[q].f1_first - base[q].f1_first for q in both]) if n != "base" else None
            d_aio = bootstrap([float(mine[q].answer_in_output) - float(base[q].answer_in_output) for q in both]) \
                if n != "base" else None
            out.append(f"| {n} | {mode} | {len(mine)} | {_e(f1)} | {_e(aio)} | {_e(d_f1, True)} | {_e(d_aio, True)} |")
    return out


def _e(e, signed: bool = False) -> str:
    if e is None:
        return "–"
    f = (lambda x: f"{x:+.3f}") if signed else (lambda x: f"{x:.3f}")
    return f"{f(e.value)} [{f(e.lo)}, {f(e.hi)}]" if e.lo is not None else f(e.value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="squad")
    ap.add_argument("--size", type=int, default=4000, help="knowledge tokens (one snapshot: within the context)")
    ap.add_argument("--questions", type=int, default=50)
    ap.add_argument("--max-sets", type=int, default=10, help="sets pooled to reach --questions (cag compare's)")
    ap.add_argument("--modes", default="cag,cag+rag,rag-bm25")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--name", default="prompt")
    ap.add_argument("--work", type=Path, default=Path("/tmp/cag-bench-prompt"),
                    help="snapshots and set folders (one home per variant; large, not results)")
    args = ap.parse_args()
    names = args.variants.split(",")
    if "base" not in names or any(n not in VARIANTS for n in names):
        ap.error(f"variants: base and any of {', '.join(VARIANTS)}")
    folder = RESULTS / args.name
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:  # one child process per variant: the prompt patches stay in it
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            try:
                run_variant(n, args, folder / n, args.work / args.name / n)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        print(f"[{n}] done in {time.perf_counter() - t0:.0f} s", flush=True)
    lines = [f"# Prompt variants: {args.dataset}, {args.size} tokens, {args.questions} questions", "",
             f"`python -m bench.bench_prompt --dataset {args.dataset} --size {args.size} --questions "
             f"{args.questions} --max-sets {args.max_sets} --modes {args.modes} --variants {args.variants} --name "
             f"{args.name}`; "
             f"{time.strftime('%Y-%m-%d')}; cag+rag and rag with k = 1; every variant's run under its folder.", "",
             "Variants: " + "; ".join(f"**{n}** {json.dumps(VARIANTS[n]) if VARIANTS[n] else '(shipped)'}"
                                      for n in names), "", *pair(folder, names)]
    (folder / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
