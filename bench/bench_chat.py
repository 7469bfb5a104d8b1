"""Conversations: time to first token per turn with the kept conversation, against recomputing the
history over the snapshot and against `full` (no cache), side by side in one run; memory per kept
conversation; concurrent conversations' aggregate throughput.

Corpus: SQuAD v1.1 dev paragraphs packed into one folder of about --corpus-tokens tokens (shared
datasets); each conversation asks --turns of its questions in turn, sending the history (the
answers it got) every time, as a chat client does. Per turn, three answers over the same messages:
  kept       the server as it runs: the previous turn's prompt is kept, only new tokens prefilled;
  recompute  kept conversations cleared first: the whole history prefilled over the snapshot;
  full       the knowledge and the whole conversation prefilled, no snapshot.
All three give the same tokens (checked). A second set forces answers of --long-answer tokens so
the history reaches ~2K tokens by the last turn. Then --concurrent conversations at once against
one alone: completion tokens per second of wall time.
Writes bench/results/chat.json and .md.  Run: `python -m bench.bench_chat`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine
from cag.runtime.generate import DecodeConfig

from .bench_weights_quality import squad_folders
from .common import machine, write


def turn(engine: Engine, messages: list[dict], mode: str, max_tokens: int, min_tokens: int = 0):
    return engine.answer(
        Query(
            "chat",
            None,
            mode=mode,
            max_tokens=max_tokens,
            messages=messages,
            decoding=DecodeConfig(min_tokens=min_tokens),
        )
    )


def conversation(
    engine: Engine, questions: list[str], max_tokens: int, min_tokens: int = 0, compare: bool = True
) -> list[dict]:
    """One conversation; per turn the three ways' TTFT (ms), token counts and agreement."""
    messages, rows = [], []
    for i, q in enumerate(questions):
        messages.append({"role": "user", "content": q})
        kept = turn(engine, messages, "cag", max_tokens, min_tokens)
        row = {
            "turn": i + 1,
            "prompt_tokens": kept.prompt_tokens,
            "history_tokens": kept.prompt_tokens - (kept.cached_tokens - kept.conversation_tokens),
            "reused_tokens": kept.conversation_tokens,
            "kept_ttft_ms": kept.ttft_ms,
            "completion_tokens": kept.completion_tokens,
        }
        if compare:
            engine.kept.clear()  # the next turn finds nothing: the history is prefilled again
            again = turn(engine, messages, "cag", max_tokens, min_tokens)
            full = turn(engine, messages, "full", max_tokens, min_tokens)
            row |= {"recompute_ttft_ms": again.ttft_ms, "full_ttft_ms": full.ttft_ms,
                    "same_tokens": kept.token_ids == again.token_ids == full.token_ids}
            # the kept conversation of this turn again, as the server holds it for the next one
            turn(engine, messages, "cag", max_tokens, min_tokens)
        rows.append(row)
        messages.append({"role": "assistant", "content": kept.answer or "..."})
    return rows


def concurrent(engine: Engine, plans: list[list[str]], max_tokens: int) -> tuple[float, int]:
    """Wall time and completion tokens of these conversations run at once (one thread each)."""
    tokens = [0] * len(plans)

    def run(i):
        messages = []
        for q in plans[i]:
            messages.append({"role": "user", "content": q})
            a = turn(engine, messages, "cag", max_tokens)
            tokens[i] += a.completion_tokens
            messages.append({"role": "assistant", "content": a.answer or "..."})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus-tokens", type=int, default=4000)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--long-answer", type=int, default=330, help="answer tokens a turn in the long-history set")
    ap.add_argument("--concurrent", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(get_settings(home=Path(tmp) / "home", models_dir_override=get_settings().models_dir))
        (name, items), *_ = squad_folders(Path(tmp), 60, args.corpus_tokens)
        r = engine.ingest(str(Path(tmp) / name), name="chat")
        questions = [q for q, _ in items]
        print(f"corpus: {r.n_tokens} tokens, {len(questions)} questions", flush=True)
        plans = [
            [questions[(c * args.turns + t) % len(questions)] for t in range(args.turns)]
            for c in range(max(args.conversations, args.concurrent))
        ]
        turn(engine, [{"role": "user", "content": questions[0]}], "cag", 2)  # first forwards outside the timings
        engine.kept.clear()
        short = [conversation(engine, p, args.max_tokens) for p in plans[: args.conversations]]
        engine.kept.clear()
        per_conv = []
        for p in plans[: args.conversations]:
            before = engine.kept.nbytes
            conversation(engine, p, args.max_tokens, compare=False)
            per_conv.append(engine.kept.nbytes - before)
        kept_tokens = engine.kept.snapshot()
        long = conversation(engine, plans[0], args.long_answer, args.long_answer)
        engine.kept.clear()
        one_s, one_tok = concurrent(engine, plans[:1], args.max_tokens)
        engine.kept.clear()
        many_s, many_tok = concurrent(engine, plans[: args.concurrent], args.max_tokens)
        lm = engine.lm
    med = lambda rows, key, t: statistics.median(r[key] for conv in rows for r in conv if r["turn"] == t)  # noqa: E731
    T = args.turns
    summary = {
        "turn_last_over_first_kept": med(short, "kept_ttft_ms", T) / med(short, "kept_ttft_ms", 1),
        "long_history_tokens": long[-1]["history_tokens"],
        "long_recompute_over_kept": long[-1]["recompute_ttft_ms"] / long[-1]["kept_ttft_ms"],
        "all_same_tokens": all(r["same_tokens"] for conv in short + [long] for r in conv),
        "bytes_per_kept_conversation": statistics.median(per_conv),
        "kept_bytes_per_token": lm.kv_bytes(1, lm.attn_dtype),
        "one_tok_s": one_tok / one_s, "concurrent_tok_s": many_tok / many_s,
        "concurrent_over_one": (many_tok / many_s) / (one_tok / one_s),
    }
    payload = {"machine": machine(), "model": lm.name, "weights": lm.weights,
               "kernels": lm.kernels, "corpus_tokens": r.n_tokens, "args": vars(args), "short": short, "long": long,
               "kept": kept_tokens, "summary": summary}
    lines = [
        "# Conversations: TTFT per turn, kept vs recomputed vs full\n",
        f"Machine: {machine()}; model {lm.name}, kernels {lm.kernels}; corpus {r.n_tokens} tokens (SQuAD v1.1 dev "
        f"paragraphs); `python -m bench.bench_chat` ({time.strftime('%Y-%m-%d')}).\n",
        f"## {args.conversations} conversations of {T} turns, answers of at most {args.max_tokens} tokens "
        "(median ms)\n",
        "| turn | history tokens | reused | kept TTFT | recompute TTFT | full TTFT | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in range(1, T + 1):
        rows = [r for conv in short for r in conv if r["turn"] == t]
        lines.append(
            f"| {t} | {statistics.median(r['history_tokens'] for r in rows):.0f} | "
            f"{statistics.median(r['reused_tokens'] for r in rows):.0f} | {med(short, 'kept_ttft_ms', t):.1f} | "
            f"{med(short, 'recompute_ttft_ms', t):.1f} | {med(short, 'full_ttft_ms', t):.1f} | "
            f"{all(r['same_tokens'] for r in rows)} |"
        )
    lines += [
        f"\n## One conversation with answers of {args.long_answer} tokens\n",
        "| turn | history tokens | reused | kept TTFT | recompute TTFT | full TTFT | same tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['turn']} | {r['history_tokens']} | {r['reused_tokens']} | {r['kept_ttft_ms']:.1f} | "
        f"{r['recompute_ttft_ms']:.1f} | {r['full_ttft_ms']:.1f} | {r['same_tokens']} |"
        for r in long
    ]
    s = summary
    lines += [
        "\n## Against the targets\n",
        "| measure | value | target |",
        "|---|---|---|",
        f"| turn {T} TTFT / turn 1 TTFT, kept | {s['turn_last_over_first_kept']:.2f}x | <= 1.3x |",
        f"| recompute / kept TTFT at {s['long_history_tokens']} history tokens | {s['long_recompute_over_kept']:.2f}x "
        "| >= 3x |",
        f"| {args.concurrent} concurrent conversations / one, completion tok/s | {s['concurrent_over_one']:.2f}x "
        f"({s['concurrent_tok_s']:.1f} vs {s['one_tok_s']:.1f}) | >= 3x |",
        f"| kept bytes per conversation ({T} turns) | {s['bytes_per_kept_conversation'] / 1e6:.2f} MB "
        f"({s['kept_bytes_per_token'] / 1e3:.1f} KB a token) | - |",
        f"| kept, recomputed and full give the same tokens | {s['all_same_tokens']} | every turn |",
    ]
    write("chat", payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
