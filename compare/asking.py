"""The questions of a compare run: the plan (every question in every mode and k, in asking order),
the batches cag rows are decoded in, and asking one question in one mode into its results row
through the one answering entry point (`Engine.answer(Query(...))`), routing recall included.
"""

from __future__ import annotations

from cag.answering.query import Query
from cag.errors import CagError
from cag.runtime.generate import DecodeConfig

from .datasets import QAItem
from .ingested_sets import SetInfo
from .knowledge_sets import KnowledgeSet
from .metrics import answer_in_output, exact_match, f1, f1_first_sentence
from .results import Row, shard_cap
from .run_config import CompareConfig


def plan(ks: KnowledgeSet, cfg: CompareConfig, modes: list[str],
         first_index: int = 0) -> list[tuple[int, QAItem, str, int | None]]:
    """(question index within its size, question, mode, k) in asking order: every mode of a question
    together. `first_index` is the number of questions the size's earlier sets hold, so the full and
    k-sweep samples are the first questions of the size, not of each set."""
    out: list[tuple[int, QAItem, str, int | None]] = []
    for qi, q in enumerate(ks.questions, start=first_index):
        for mode in modes:
            if shard_cap(mode) is not None:  # cag and the sweep's cag@N: every question
                out.append((qi, q, mode, None))
            elif mode == "full":
                if qi < cfg.full_sample:
                    out.append((qi, q, mode, None))
            else:
                ks_q = sorted({cfg.k_main} | (set(cfg.ks) if qi < cfg.k_sample else set()))
                out.extend((qi, q, mode, k) for k in ks_q)
    return out


def batches(todo: list[tuple], n: int):
    """The plan in order, one item at a time, except that a cag-family item (cag, cag@N) takes the
    next n-1 cag-family items along, to be decoded together."""
    rest = list(todo)
    while rest:
        item = rest.pop(0)
        if n > 1 and shard_cap(item[4]) is not None:
            more = [t for t in rest if shard_cap(t[4]) is not None][: n - 1]
            taken = {id(t) for t in more}
            rest = [t for t in rest if id(t) not in taken]
            yield [item, *more]
        else:
            yield [item]


def warm_up(engine, corpus: str, question: str) -> None:
    """One unrecorded short question, so the process's first forward passes (allocator, kernel
    selection) are not charged to whichever mode happens to be asked first."""
    try:
        engine.answer(Query(corpus, question, mode="rag", max_tokens=2, k=1))
    except CagError:
        pass


def ask_row(engine, info: SetInfo, qi: int, q: QAItem, mode: str, k: int | None,
            decoding: DecodeConfig) -> Row:
    """Ask one question in one mode; the row that goes to results.jsonl."""
    retriever = mode.split("-", 1)[1] if mode.startswith("rag-") else "bm25" if mode == "cag+rag" else None
    row = Row(set=info.name, size=info.size, qid=q.qid, mode=mode, prefix_tokens=info.prefix_tokens, q_index=qi,
              question=q.question, golds=q.answers, gold_docs=q.gold_doc_ids, retriever=retriever, k=k)
    engine_mode = mode if mode == "cag+rag" else "rag" if retriever else "cag" if shard_cap(mode) is not None else mode
    try:
        a = engine.answer(Query(info.corpus_of(mode), q.question, mode=engine_mode, max_tokens=decoding.max_tokens,
                                decoding=decoding, k=k or 3, retriever=retriever or "bm25"))
    except CagError as e:  # e.g. a question longer than the room kept for it: recorded, not fatal
        row.error = str(e)
        return row
    row.answer = a.answer
    row.em = exact_match(a.answer, q.answers)
    row.f1 = round(f1(a.answer, q.answers), 4)
    row.f1_first = round(f1_first_sentence(a.answer, q.answers), 4)
    row.answer_in_output = answer_in_output(a.answer, q.answers)
    row.prompt_tokens, row.cached_tokens, row.completion_tokens = a.prompt_tokens, a.cached_tokens, a.completion_tokens
    row.load_ms, row.ttft_ms, row.total_ms = a.load_ms, a.ttft_ms, a.total_ms
    if retriever:
        row.retrieval_ms = a.retrieval_ms
        got = [info.files.get(p["doc_id"], p["doc_id"]) for p in a.passages]
        gold = set(q.gold_doc_ids)
        row.retrieved = [{"doc": d, "index": p["index"], "score": p["score"]} for d, p in zip(got, a.passages)]
        row.retrieval_hit = gold <= set(got)
        row.retrieval_recall = round(len(gold & set(got)) / len(gold), 4) if gold else None
    if mode == "cag+rag" and a.shards and "cag" in info.shard_docs:
        routing_recall(engine, info, "cag", q, a, row)
    elif not retriever and mode in info.shard_docs and a.shards:
        routing_recall(engine, info, mode, q, a, row)
    return row


def routing_recall(engine, info: SetInfo, mode: str, q: QAItem, a, row: Row) -> None:
    """Fill a sharded cag row's routing fields: the shard that answered, the 2 best shards by routing
    (the router the answer used, asked again after the answer so its timing is the answer's own),
    and the share of the question's gold documents in each."""
    from cag.answering.across_shards import route

    shard_docs = info.shard_docs[mode]
    chosen = next((s for s in a.shards if s.get("chosen", True)), a.shards[0])
    _, routes, _ = route(engine.index, engine.remote, engine.lm.tokenizer, info.corpus_of(mode), q.question, 2)
    row.n_shards = len(shard_docs)
    row.shards = [{key: s[key] for key in ("shard", "score", "n_tokens") if key in s} for s in a.shards]
    row.routing_ms = a.routing_ms
    row.routed = [rt.shard for rt in routes]
    gold = set(q.gold_doc_ids)
    if gold:
        row.routing_recall = round(len(gold & shard_docs[chosen["shard"]]) / len(gold), 4)
        best2 = set().union(*(shard_docs[s] for s in row.routed))
        row.routing_recall2 = round(len(gold & best2) / len(gold), 4)
