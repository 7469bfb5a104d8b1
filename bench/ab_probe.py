"""The probe bench/bench_ab.py runs in each checkout it compares: run as a script with the tree to measure
first on PYTHONPATH, so `cag` and `bench.common` are that tree's. Prints one JSON line.

    PYTHONPATH=<tree> python bench/ab_probe.py 4000 3
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from cag.answering.query import Query

QUESTIONS = ["What does the author say about startups?", "Why do founders fail?", "What is the best way to get ideas?",
             "How should you pick a cofounder?", "What matters most in a startup's early days?"]
TURNS = [
    "What does the author say about working on hard problems, and why does it matter to him?",
    "And what about money?",
    "Who should read this?",
    "What did he do before that?",
    "Why?",
    "Summarize it in one line.",
]


def probe(corpus_tokens: int, questions: int) -> dict:
    """The figures of this checkout (imported from the working directory, the tree being measured)."""
    from bench.common import essay_corpus
    from cag.config import get_settings
    from cag.engine import Engine

    home = Path(tempfile.mkdtemp(prefix="cag-ab-"))
    engine = Engine(get_settings(home=home))
    folder = essay_corpus(home / "essays", corpus_tokens, lambda t: len(engine.lm.tokenizer(t)["input_ids"]))
    r = engine.ingest(str(folder), name="essays")
    out = {"weights": engine.lm.weights, "kernels": engine.lm.kernels, "tokens": r.n_tokens,
           "prefill_tok_s": round(r.n_tokens / (r.prefill_ms / 1e3), 1)}
    engine.answer(Query("essays", "Warm up.", max_tokens=2))
    ttft = [engine.answer(Query("essays", q, max_tokens=4)).ttft_ms for q in QUESTIONS[:questions]]
    out["ttft_ms"] = round(sum(ttft) / len(ttft), 1)
    out["decode_tok_s"] = engine.answer(
        Query("essays", "Tell me everything about the essays.", max_tokens=64)
    ).decode_tok_s
    history, turns = [], []
    for q in TURNS:
        messages = history + [{"role": "user", "content": q}]
        a = engine.answer(Query("essays", None, messages=messages, max_tokens=48))
        turns.append(a.ttft_ms)
        history = messages + [{"role": "assistant", "content": a.answer}]
    out["turn1_ttft_ms"], out["turn6_ttft_ms"] = round(turns[0], 1), round(turns[-1], 1)
    return out | stall(engine, folder)


def stall(engine, folder: Path, long_tokens: int = 2000) -> dict:
    """TTFT of a short question (~8 tokens) alone, and asked while a `long_tokens`-token conversation is
    being prefilled (issue: one long prompt held up every other request); the long one's TTFT beside."""
    import threading
    import time

    tok = engine.lm.tokenizer
    text = " ".join(p.read_text() for p in sorted(folder.iterdir()))
    long_text = tok.decode(tok(text)["input_ids"][:long_tokens])
    short = "Who wrote these essays?"
    alone = min(engine.answer(Query("essays", short, max_tokens=4)).ttft_ms for _ in range(2))
    got: dict = {}
    t = threading.Thread(
        target=lambda: got.update(
            long=engine.answer(
                Query(
                    "essays",
                    None,
                    messages=[{"role": "user", "content": long_text + "\n\nSummarize this."}],
                    max_tokens=4,
                )
            )
        )
    )
    t.start()
    time.sleep(0.5)  # the long prompt's prefill is under way
    during = engine.answer(Query("essays", short, max_tokens=4)).ttft_ms
    t.join()
    return {"short_alone_ttft_ms": round(alone, 1), "short_during_long_ttft_ms": round(during, 1),
            "long_ttft_ms": round(got["long"].ttft_ms, 1)}



if __name__ == "__main__":
    print(json.dumps(probe(int(sys.argv[1]), int(sys.argv[2]))))
