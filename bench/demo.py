"""`make demo`: ask one question of the handbook with the snapshot (cag) and without it (full),
and print both answers and timings side by side."""

from __future__ import annotations

import sys

from cag.answering.query import Query
from cag.config import get_settings
from cag.engine import Engine


def main() -> None:
    question = sys.argv[1] if len(sys.argv) > 1 else "What is the name of the company VPN?"
    engine = Engine(get_settings())
    rows = [engine.answer(Query("handbook", question, mode=m, max_tokens=48)) for m in ("cag", "full")]
    print(f"\nQ: {question}\n")
    print(f"{'mode':<6} {'load ms':>8} {'ttft ms':>9} {'total ms':>9} {'cached':>7}  answer")
    for a in rows:
        print(
            f"{a.mode:<6} {a.load_ms:>8.0f} {a.ttft_ms:>9.0f} {a.total_ms:>9.0f} {a.cached_tokens:>7}  "
            f"{' '.join(a.answer.split())}"
        )
    same = rows[0].token_ids == rows[1].token_ids
    print(
        f"\nidentical tokens: {same}; time to first token {rows[1].ttft_ms / max(rows[0].ttft_ms, 1e-9):.0f}x faster "
        "with the snapshot"
    )


if __name__ == "__main__":
    main()
