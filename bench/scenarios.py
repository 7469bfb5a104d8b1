"""Exactness scenarios: a seeded generator of the ways a corpus and a conversation meet cag, and a runner
that checks each against the rule a row's keys and values never depend on how rows were grouped.

A scenario is drawn from one integer seed (`draw`): documents (SQuAD v1.1 dev paragraphs from the shared
datasets, the handbook's paragraphs where they are absent), an edit of the corpus (first, middle or last
document; appended to, rewritten, removed, or a document added), a conversation of 1-8 turns (first
questions under and over 16 tokens, answers of 8-48 tokens, sometimes an earlier turn edited), a shard
size (one context, or shards of a few hundred tokens), a snapshot dtype (bf16, fp16 or int8), whether
each turn is asked beside other questions (a mixed batch), and sometimes a decoder slot shorter than the
knowledge (as a 128K model's 32K slot is for longer knowledge: what fits a slot is prefilled as decode rows,
longer knowledge in blocks, so shards and refreshes cross between the two methods). `run` then checks, on
one loaded model:

- refresh == rebuild: after the edit, the refreshed snapshot of every shard equals, bit for bit, the one
  `cag ingest --force` builds from the same files (same key, so they must be the same snapshot);
- cag == full: every turn's answer from the snapshot equals, token for token, the same messages answered
  with no cache (`mode="full"`), alone and, where drawn, while other questions decode beside it; the
  conversation's earlier turns are sent back as the client would send them (the answers' text).

`bench/bench_exactness.py` runs hundreds of seeds in every weights format and kernel the CPU runs and
writes bench/results/exactness.{json,md}; tests/test_scenarios.py runs a few in the suite. A seed that
ever failed becomes a named test there.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cag.answering.query import Query

from .common import REPO

HANDBOOK = REPO / "corpora" / "handbook"
EDITS = ("append", "rewrite", "remove", "add")
WHERE = ("first", "middle", "last")
FILLER = "Please answer in one short sentence, and name the document the answer comes from if you can."


@dataclass
class Scenario:
    seed: int
    docs: list[tuple[str, str]]  # (file name, text), in the corpus's order
    edit: tuple[str, str] | None  # (where, how) or None: no refresh
    turns: list[str]  # the user's messages, in order
    answer_tokens: list[int]  # max_tokens of each turn
    edit_turn: int | None  # before this turn, the first user message is rewritten (an edited earlier turn)
    shard_tokens: int  # 0: one shard
    kv_dtype: str
    batched: bool  # each turn asked while other questions decode beside it
    slot_tokens: int = 0  # 0: the model's own; else knowledge longer than this is prefilled in blocks, not as rows

    def describe(self) -> dict:
        d = asdict(self)
        d["docs"] = [name for name, _ in self.docs]
        return d


@dataclass
class Mismatch:
    seed: int
    check: str  # refresh==rebuild | cag==full | batched==alone
    detail: str


@dataclass
class Outcome:
    scenario: dict
    checks: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    seconds: float = 0.0


def _paragraphs() -> tuple[list[str], list[str]]:
    """(paragraphs, questions) to draw from: SQuAD dev's where the shared datasets are, else the handbook's."""
    try:
        from cag.compare import datasets

        corpus = datasets.load_squad()
        return [d.text for d in corpus.docs[:400]], [q.question for q in corpus.questions[:2000]]
    except Exception:  # no shared datasets here: the project's own handbook
        import json

        texts = [p.read_text() for p in sorted(HANDBOOK.glob("*.md"))]
        paras = [p.strip() for t in texts for p in t.split("\n\n") if len(p.strip()) > 80]
        qs = [json.loads(line)["question"] for line in (HANDBOOK / "questions.jsonl").read_text().splitlines()]
        return paras, qs


_POOL: tuple[list[str], list[str]] | None = None


def draw(seed: int, kv_dtypes: tuple[str, ...] = ("bfloat16", "float16", "int8"), max_docs: int = 8,
         max_turns: int = 8) -> Scenario:
    """The scenario of `seed` (the same on every machine with the same datasets)."""
    global _POOL
    if _POOL is None:
        _POOL = _paragraphs()
    paras, qs = _POOL
    r = random.Random(seed)
    n_docs = r.randint(2, max_docs)
    docs = [(f"{i:02d}-{r.randrange(10**6):06d}.md", "\n\n".join(r.sample(paras, r.randint(1, 2))) + "\n")
            for i in range(n_docs)]
    n_turns = r.randint(1, max_turns)
    turns = [r.choice(qs) for _ in range(n_turns)]
    if r.random() < 0.5:  # a first question well over 16 tokens (a kept conversation needs 16 to match)
        turns[0] = f"{turns[0]} {FILLER}"
    return Scenario(
        seed=seed, docs=docs,
        edit=(r.choice(WHERE), r.choice(EDITS)) if r.random() < 0.8 else None,
        turns=turns,
        answer_tokens=[r.choice((8, 16, 24, 48)) for _ in turns],
        edit_turn=r.randint(1, n_turns - 1) if n_turns > 1 and r.random() < 0.3 else None,
        shard_tokens=r.choice((0, 0, 384, 640)),
        kv_dtype=r.choice(kv_dtypes),
        batched=r.random() < 0.3,
        slot_tokens=r.choice((256, 512)) if r.random() < 0.25 else 0,
    )


def _write(folder: Path, docs: list[tuple[str, str]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for p in folder.iterdir():
        p.unlink()
    for name, text in docs:
        (folder / name).write_text(text)


def edited(s: Scenario) -> list[tuple[str, str]]:
    """The corpus after the scenario's edit."""
    docs = list(s.docs)
    where, how = s.edit
    i = {"first": 0, "middle": len(docs) // 2, "last": len(docs) - 1}[where]
    name, text = docs[i]
    if how == "append":
        docs[i] = (name, text + "Travel over 500 EUR needs a director.\n")
    elif how == "rewrite":
        words = text.split(" ")
        j = random.Random(s.seed).randrange(len(words))
        docs[i] = (name, " ".join(words[:j] + ["changed"] + words[j + 1 :]))
    elif how == "remove" and len(docs) > 1:
        del docs[i]
    else:  # add (or remove of the only document): a new document, named to sort where the edit points
        docs.insert(i, (name.replace(".md", "-new.md"), "The harbour master is Ilse Brandt. She joined in 2019.\n"))
    return docs


def _tensors(engine, corpus: str) -> dict[str, torch.Tensor]:
    """Every shard's snapshot tensors, by shard and name."""
    from safetensors.torch import load_file

    out = {}
    for row in engine.index.shards(corpus):
        snap = engine.index.snapshot(row["snapshot"])
        for name, t in load_file(snap["path"]).items():
            out[f"shard{row['shard']}.{name}"] = t
    return out


def _ask(engine, messages: list[dict], mode: str, max_tokens: int) -> list[int]:
    return engine.answer(Query("s", None, mode=mode, max_tokens=max_tokens, messages=messages)).token_ids


def _beside(engine, messages: list[dict], max_tokens: int, others: list[str]) -> list[int]:
    """The cag answer to `messages` while `others` decode beside it (threads: the decoder batches them)."""
    out: dict[str, list[int]] = {}
    go = threading.Barrier(len(others) + 1)

    def one(key, msgs, n):
        go.wait()
        out[key] = _ask(engine, msgs, "cag", n)

    threads = [
        threading.Thread(target=one, args=(f"o{i}", [{"role": "user", "content": q}], 12)) for i, q in enumerate(others)
    ]
    threads.append(threading.Thread(target=one, args=("me", messages, max_tokens)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out["me"]


def run(s: Scenario, engine, folder: Path) -> Outcome:
    """Check scenario `s` on `engine` (a fresh CAG_HOME, its kv_dtype the scenario's), the corpus written in
    `folder`."""
    t0 = time.perf_counter()
    with _slot(s.slot_tokens):
        return _run(s, engine, folder, t0)


@contextlib.contextmanager
def _slot(tokens: int):
    """Knowledge of more than `tokens` prefilled in blocks for the scenario's length (0: as the model has it)."""
    from cag.runtime import knowledge_kv

    was = knowledge_kv.MAX_SUFFIX
    knowledge_kv.MAX_SUFFIX = tokens or was
    try:
        yield
    finally:
        knowledge_kv.MAX_SUFFIX = was


def _run(s: Scenario, engine, folder: Path, t0: float) -> Outcome:
    out = Outcome(s.describe())
    _write(folder, s.docs)
    engine.ingest(str(folder), name="s", shard_tokens=s.shard_tokens or None)
    if s.edit is not None:
        _write(folder, edited(s))
        engine.ingest("s")
        refreshed = _tensors(engine, "s")
        engine.ingest("s", force=True)
        rebuilt = _tensors(engine, "s")
        out.checks += 1
        differ = sorted(k for k in rebuilt if k not in refreshed or not torch.equal(refreshed[k], rebuilt[k]))
        if differ or refreshed.keys() != rebuilt.keys():
            out.mismatches.append(
                Mismatch(s.seed, "refresh==rebuild", f"{len(differ)} tensors differ, first {differ[:2]}")
            )
    r = random.Random(s.seed + 1)
    history: list[dict] = []
    for t, (question, n) in enumerate(zip(s.turns, s.answer_tokens)):
        if s.edit_turn == t and history:
            history[0] = {"role": "user", "content": r.choice(s.turns) + " (asked again)"}
        messages = history + [{"role": "user", "content": question}]
        cag = _ask(engine, messages, "cag", n)
        full = _ask(engine, messages, "full", n)
        out.checks += 1
        if cag != full:
            at = next((i for i, (a, b) in enumerate(zip(cag, full)) if a != b), min(len(cag), len(full)))
            out.mismatches.append(Mismatch(s.seed, "cag==full", f"turn {t + 1}: split at answer token {at}"))
        if s.batched:
            out.checks += 1
            if (got := _beside(engine, messages, n, r.sample(s.turns, min(2, len(s.turns))))) != cag:
                out.mismatches.append(Mismatch(s.seed, "batched==alone", f"turn {t + 1}: {got[:8]} vs {cag[:8]}"))
        text = engine.lm.tokenizer.decode(cag, skip_special_tokens=True).strip()
        history = messages + [{"role": "assistant", "content": text or "I do not know."}]
    out.seconds = round(time.perf_counter() - t0, 2)
    return out
