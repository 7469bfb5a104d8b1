"""A checked question's Answer: its text and token counts, timings and where it was decoded, logged to the
index (a log that cannot be written is a warning on the answer, never its failure)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from cag.answering.questions import Question
from cag.results import Answer
from cag.runtime import describe
from cag.runtime.generate import DecodeConfig, Generated, stop_at

if TYPE_CHECKING:
    from cag.model.loading import LoadedModel
    from cag.store.index import Index

NOT_LOGGED = ("stale", "stale_reasons", "passages", "decode_tok_s", "shards", "routing_ms", "conversation_tokens")


def finish(index: Index, lm: LoadedModel, q: Question, gen: Generated, n_prefix: int, cached: int, load_ms: float,
           snapshot: str | None, **extra) -> Answer:
    """The Answer to `q` from `gen`, decoded after a prefix of `n_prefix` tokens (`cached` of them not computed
    for it), and its row in the query log."""
    ans = Answer(answer=gen.text, mode=q.mode.value, corpus=q.corpus, snapshot=snapshot, stale=bool(q.reasons),
                 stale_reasons=q.reasons, prompt_tokens=n_prefix + len(q.suffix), cached_tokens=cached,
                 completion_tokens=len(gen.ids), load_ms=round(load_ms, 2), ttft_ms=round(gen.ttft_ms, 2),
                 total_ms=round((time.perf_counter() - q.t_start) * 1e3, 2), decode_tok_s=gen.decode_tok_s,
                 token_ids=gen.ids, conversation_tokens=gen.reused, decode=describe.decode_path(lm), **extra)
    row = ans.to_dict()
    for k in NOT_LOGGED:
        row.pop(k)
    if (failed := index.log_query(dict(row, question=q.text))) is not None:
        ans.warnings.append(failed)  # the answer stands (a read-only index, a full disk)
    return ans


def stopped(a: Answer, tokenizer, decoding: DecodeConfig | None) -> Answer:
    """`a` with `stopped` set where a stop sequence ended it (the decoder cut the text there and decoded no further)."""
    if decoding is not None and decoding.stop:
        a.stopped = stop_at(tokenizer.decode(a.token_ids, skip_special_tokens=True), decoding.stop) is not None
    return a
