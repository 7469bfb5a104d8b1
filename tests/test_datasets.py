"""Tests for compare.datasets, compare.dataset_sources and compare.knowledge_sets: loaders on the real
shared files, knowledge-set budgets and determinism, and the jsonl user format.

Token counting uses whitespace word counts as a stand-in for a tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cag.compare.dataset_sources import HOTPOT_DEV_FILE, SQUAD_DEV_FILE, datasets_root
from cag.compare.datasets import Corpus, Doc, QAItem, load_hotpotqa, load_jsonl, load_squad
from cag.compare.knowledge_sets import build_knowledge_sets, knowledge_sets_from_corpus


def words(text: str) -> int:
    return len(text.split())


needs_squad = pytest.mark.skipif(
    not (datasets_root() / SQUAD_DEV_FILE).is_file(),
    reason=f"shared SQuAD v1.1 dev file not found under {datasets_root()} (set CAG_DATASETS)",
)
needs_hotpot = pytest.mark.skipif(
    not (datasets_root() / HOTPOT_DEV_FILE).is_file(),
    reason=f"shared HotpotQA sample not found under {datasets_root()} (set CAG_DATASETS)",
)


@pytest.fixture(scope="module")
def squad() -> Corpus:
    return load_squad()


@pytest.fixture(scope="module")
def hotpot() -> Corpus:
    return load_hotpotqa()


def check_set(ks, size: int, corpus_ids: set[str]) -> None:
    """Invariants every knowledge set must satisfy."""
    ids = [d.doc_id for d in ks.docs]
    assert len(ids) == len(set(ids)), "documents repeated"
    assert set(ids) <= corpus_ids
    assert ks.n_tokens == sum(words(d.text) for d in ks.docs)
    assert ks.n_tokens <= size
    for q in ks.questions:
        assert set(q.gold_doc_ids) <= set(ids), f"{q.qid}: gold doc missing from {ks.name}"


def test_datasets_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("CAG_DATASETS", str(tmp_path))
    assert datasets_root() == tmp_path
    monkeypatch.delenv("CAG_DATASETS")
    assert datasets_root() == Path(__file__).resolve().parents[2] / "shared" / "datasets"


# ---------------------------------------------------------------- SQuAD


@needs_squad
def test_squad_counts_match_source_md(squad):
    # shared/datasets/squad_v1.1_dev/SOURCE.md: 48 articles, 2,067 paragraphs,
    # 10,570 questions, 34,726 gold answer spans.
    assert len(squad.groups) == 48
    assert len(squad.docs) == 2067
    assert len(squad.questions) == 10570
    assert sum(len(q.answers) for q in squad.questions) == 34726
    assert len({d.doc_id for d in squad.docs}) == 2067
    assert len({q.qid for q in squad.questions}) == 10570
    assert squad.docs[0].doc_id == "squad:Super_Bowl_50:0"
    assert squad.docs[0].title == "Super Bowl 50"
    assert all(len(q.gold_doc_ids) == 1 for q in squad.questions)


@needs_squad
def test_squad_knowledge_sets_respect_budget(squad):
    sizes = [400, 3000, 20000]
    sets = build_knowledge_sets("squad", None, sizes, words, n_questions=25, seed=7)
    assert [ks.name for ks in sets] == ["squad-400", "squad-3000", "squad-20000"]
    ids = {d.doc_id for d in squad.docs}
    for ks, size in zip(sets, sizes):
        check_set(ks, size, ids)
        assert ks.docs and ks.questions
        assert len(ks.questions) <= 25
    assert len(sets[-1].questions) == 25
    # One seeded order serves all sizes: smaller sets are prefixes of larger ones.
    for small, large in zip(sets, sets[1:]):
        assert large.docs[: len(small.docs)] == small.docs
    # Whole paragraphs in file order within an article.
    first_article = sets[-1].docs[0].doc_id.rsplit(":", 1)[0]
    indexes = [int(d.doc_id.rsplit(":", 1)[1]) for d in sets[-1].docs if d.doc_id.startswith(first_article + ":")]
    assert indexes == list(range(len(indexes)))


@needs_squad
def test_squad_knowledge_sets_are_deterministic(squad):
    a = build_knowledge_sets("squad", None, [2500], words, n_questions=10, seed=3)
    b = build_knowledge_sets("squad", None, [2500], words, n_questions=10, seed=3)
    c = build_knowledge_sets("squad", None, [2500], words, n_questions=10, seed=4)
    assert a == b
    assert [d.doc_id for d in a[0].docs] != [d.doc_id for d in c[0].docs]


@needs_squad
def test_adding_sizes_does_not_change_other_sets(squad):
    alone = build_knowledge_sets("squad", None, [5000], words, n_questions=8, seed=1)
    together = build_knowledge_sets("squad", None, [1000, 5000], words, n_questions=8, seed=1)
    assert alone[0] == together[1]


# ---------------------------------------------------------------- HotpotQA


@needs_hotpot
def test_hotpot_loader(hotpot):
    # SOURCE.md: 53 records, the first is _id 5a8b57f25542995d1e6f1371.
    assert len(hotpot.questions) == 53
    assert hotpot.questions[0].qid == "5a8b57f25542995d1e6f1371"
    assert hotpot.atomic_groups
    # 52 records with 10 paragraphs and one with 2 -> 522 references, one
    # title shared by two records -> 521 distinct documents after dedup.
    assert sorted(len(g) for g in hotpot.groups) == [2] + [10] * 52
    assert len(hotpot.docs) == 521
    assert len({d.doc_id for d in hotpot.docs}) == 521
    ids = {d.doc_id for d in hotpot.docs}
    for q, group in zip(hotpot.questions, hotpot.groups):
        assert len(q.answers) == 1 and q.answers[0]
        assert 1 <= len(q.gold_doc_ids) <= len(group)
        assert set(q.gold_doc_ids) <= set(group) <= ids
    assert all(d.doc_id == f"hotpot:{d.title}" and d.text for d in hotpot.docs)


@needs_hotpot
def test_hotpot_knowledge_sets_pool_whole_questions(hotpot):
    sizes = [2000, 8000]
    sets = build_knowledge_sets("hotpotqa", None, sizes, words, n_questions=100, seed=0)
    ids = {d.doc_id for d in hotpot.docs}
    for ks, size in zip(sets, sizes):
        check_set(ks, size, ids)
        included = {d.doc_id for d in ks.docs}
        # Distractors come along: every question whose group was pooled is
        # complete, so the set is a union of whole groups.
        complete = [g for g in hotpot.groups if set(g) <= included]
        assert set().union(*map(set, complete)) == included
        assert len(ks.questions) >= len(complete) > 0
    assert len(sets[1].questions) > len(sets[0].questions)


# ---------------------------------------------------------------- budget rule


def tiny_corpus(atomic: bool, groups: list[list[str]], sizes: dict[str, int]) -> Corpus:
    docs = [Doc(d, d, " ".join(["w"] * n)) for d, n in sizes.items()]
    questions = [QAItem(f"q-{d}", f"about {d}?", ["w"], [d]) for d in sizes]
    return Corpus("tiny", docs, questions, groups, atomic_groups=atomic)


def test_pooling_stops_at_first_doc_that_does_not_fit():
    # One group, so the seeded shuffle cannot reorder: a(3) + b(4) = 7; c(5)
    # would make 12 > 8, so pooling stops there and d(1) is NOT added even
    # though it would fit (stop rule, not skip rule).
    corpus = tiny_corpus(False, [["a", "b", "c", "d"]], {"a": 3, "b": 4, "c": 5, "d": 1})
    [ks] = knowledge_sets_from_corpus(corpus, [8], words, n_questions=10, seed=0)
    assert [d.doc_id for d in ks.docs] == ["a", "b"]
    assert ks.n_tokens == 7
    assert [q.qid for q in ks.questions] == ["q-a", "q-b"]


def test_atomic_groups_share_paragraphs_and_are_all_or_nothing():
    sizes = {"a": 2, "b": 2, "c": 2}
    corpus = tiny_corpus(True, [["a", "b"], ["b", "c"]], sizes)
    # Budget 6: both groups fit because the shared "b" is counted once.
    [full] = knowledge_sets_from_corpus(corpus, [6], words, n_questions=10, seed=0)
    assert sorted(d.doc_id for d in full.docs) == ["a", "b", "c"] and full.n_tokens == 6
    # Budget 5: the second group would add 2 -> 6 > 5, so only one group is in.
    [part] = knowledge_sets_from_corpus(corpus, [5], words, n_questions=10, seed=0)
    assert part.n_tokens == 4 and len(part.docs) == 2
    # Budget 3: not even one group fits.
    with pytest.raises(ValueError, match="no document fits"):
        knowledge_sets_from_corpus(corpus, [3], words, n_questions=10, seed=0)


def test_question_sampling_is_seeded_and_in_corpus_order():
    sizes = {f"d{i}": 1 for i in range(30)}
    corpus = tiny_corpus(False, [[d] for d in sizes], sizes)
    [a] = knowledge_sets_from_corpus(corpus, [100], words, n_questions=5, seed=11)
    [b] = knowledge_sets_from_corpus(corpus, [100], words, n_questions=5, seed=11)
    [c] = knowledge_sets_from_corpus(corpus, [100], words, n_questions=5, seed=12)
    assert len(a.questions) == 5 and a.questions == b.questions
    assert a.questions != c.questions
    order = [q.qid for q in corpus.questions]
    positions = [order.index(q.qid) for q in a.questions]
    assert positions == sorted(positions)


# ---------------------------------------------------------------- jsonl


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_jsonl_round_trip(tmp_path):
    docs_dir = tmp_path / "docs"
    (docs_dir / "sub").mkdir(parents=True)
    (docs_dir / "alpha.txt").write_text("Alpha facts live here.", encoding="utf-8")
    (docs_dir / "sub" / "beta.md").write_text("Beta facts are nested.", encoding="utf-8")
    (docs_dir / ".hidden").write_text("not a document", encoding="utf-8")
    (docs_dir / "unused.txt").write_text("A distractor nobody asks about.", encoding="utf-8")
    shared_context = "Gamma is described in this inline context."
    qa = tmp_path / "qa.jsonl"
    write_jsonl(
        qa,
        [
            {"id": "q1", "question": "Where do alpha facts live?", "answers": ["here"], "doc_ids": ["alpha.txt"]},
            {
                "question": "Alpha and beta?",
                "answers": ["both", "alpha and beta"],
                "doc_ids": ["alpha.txt", "sub/beta.md"],
            },
            {"question": "What is gamma?", "answers": ["described"], "context": shared_context},
            {"question": "Is gamma inline?", "answers": ["yes"], "context": shared_context},
        ],
    )
    corpus = load_jsonl(qa)
    ids = [d.doc_id for d in corpus.docs]
    assert ids[:3] == ["alpha.txt", "sub/beta.md", "unused.txt"]
    assert len(ids) == 4 and ids[3].startswith("ctx:")  # one doc for the shared context
    assert corpus.docs[3].text == shared_context
    assert [q.qid for q in corpus.questions] == ["q1", "qa:2", "qa:3", "qa:4"]
    assert corpus.questions[1].answers == ["both", "alpha and beta"]
    assert corpus.questions[1].gold_doc_ids == ["alpha.txt", "sub/beta.md"]
    assert corpus.questions[2].gold_doc_ids == corpus.questions[3].gold_doc_ids == [ids[3]]
    # Content-hashed ids are stable across loads.
    assert [d.doc_id for d in load_jsonl(qa).docs] == ids

    # A budget above the total keeps everything; a tight one keeps less.
    total = sum(words(d.text) for d in corpus.docs)
    [everything] = build_knowledge_sets("jsonl", qa, [total], words, n_questions=10, seed=0)
    assert everything.n_tokens == total and len(everything.questions) == 4
    [small] = build_knowledge_sets("jsonl", qa, [9], words, n_questions=10, seed=0)
    check_set(small, 9, set(ids))
    assert len(small.docs) < 4


def test_jsonl_explicit_docs_dir(tmp_path):
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "x.txt").write_text("X marks it.", encoding="utf-8")
    qa = tmp_path / "q.jsonl"
    write_jsonl(qa, [{"question": "What marks it?", "answers": ["X"], "doc_ids": ["x.txt"]}])
    with pytest.raises(ValueError, match="not found"):
        load_jsonl(qa)  # default ./docs does not exist
    corpus = load_jsonl(qa, docs_dir=folder)
    assert [d.doc_id for d in corpus.docs] == ["x.txt"]


@pytest.mark.parametrize(
    "record, message",
    [
        ({"question": "q?", "answers": [], "context": "c"}, "answers"),
        ({"question": "q?", "answers": ["a"]}, "context"),
        ({"answers": ["a"], "context": "c"}, "question"),
    ],
)
def test_jsonl_rejects_malformed_lines(tmp_path, record, message):
    qa = tmp_path / "bad.jsonl"
    write_jsonl(qa, [record])
    with pytest.raises(ValueError, match=message):
        load_jsonl(qa)


def test_unknown_format():
    with pytest.raises(ValueError, match="unknown dataset format"):
        build_knowledge_sets("csv", "x", [10], words, n_questions=1, seed=0)


# ---------------------------------------------------------------- pooling further seeds


def one_question_groups(n: int) -> Corpus:
    """HotpotQA-like: each question brings its own group of three 4-word paragraphs (12 tokens)."""
    docs, questions, groups = [], [], []
    for i in range(n):
        ids = [f"g{i}-p{j}" for j in range(3)]
        docs += [Doc(d, d, f"{d} w w w") for d in ids]
        questions.append(QAItem(f"q{i}", f"about {i}?", ["w"], [ids[0]]))
        groups.append(ids)
    return Corpus("hot", docs, questions, groups, atomic_groups=True)


def test_pool_sets_draws_further_seeds_until_the_questions_are_reached():
    from cag.compare.knowledge_sets import pool_sets

    corpus = one_question_groups(30)
    pool = pool_sets(corpus, 12, words, n_questions=5, seed=4, max_sets=10)
    assert pool.shortfall is None and pool.n_questions == 5 and len(pool.sets) == 5
    # the first set is the run's own (the same as without pooling), the others name their seed
    [own] = knowledge_sets_from_corpus(corpus, [12], words, n_questions=5, seed=4)
    assert pool.sets[0] == own and own.name == "hot-12" and own.seed == 4
    assert [s.name for s in pool.sets[1:]] == [f"hot-12-seed{s.seed}" for s in pool.sets[1:]]
    assert all(4 < a.seed < b.seed for a, b in zip(pool.sets[1:], pool.sets[2:]))
    qids = [q.qid for s in pool.sets for q in s.questions]
    assert len(qids) == len(set(qids)) == 5  # no question drawn twice
    for s in pool.sets:
        check_set(s, 12, {d.doc_id for d in corpus.docs})
    assert pool_sets(corpus, 12, words, n_questions=5, seed=4, max_sets=10) == pool  # deterministic


def test_pool_sets_says_why_a_size_stays_short():
    from cag.compare.knowledge_sets import POOL_PATIENCE, pool_sets

    corpus = one_question_groups(30)
    capped = pool_sets(corpus, 12, words, n_questions=5, seed=0, max_sets=2)
    assert capped.n_questions == 2 and capped.shortfall.startswith("2 of 5 questions from 2 sets")
    # only 3 questions exist: the dataset runs dry and the search gives up after POOL_PATIENCE idle seeds
    dry = pool_sets(one_question_groups(3), 12, words, n_questions=5, seed=0, max_sets=10)
    assert dry.n_questions == 3 and "no more at this size" in dry.shortfall
    assert dry.seeds_tried <= 3 + POOL_PATIENCE + 10
    # a set holding the whole corpus ends the search at once: no seed can add to it
    whole = pool_sets(one_question_groups(3), 10_000, words, n_questions=5, seed=0, max_sets=10)
    assert whole.seeds_tried == 1 and whole.n_questions == 3 and "1 seeds tried" in whole.shortfall
    # the size's own set refused (e.g. too large for the context): the size stops there
    offered = []
    refused = pool_sets(corpus, 12, words, n_questions=5, seed=0, max_sets=10,
                        accept=lambda ks: offered.append(ks.name) or False)
    assert offered == ["hot-12"] and refused.sets == [] and refused.shortfall == "hot-12 cannot be run"
    # a further set refused is passed over
    later = pool_sets(corpus, 12, words, n_questions=3, seed=0, max_sets=10,
                      accept=lambda ks: ks.seed != 1)
    assert later.n_questions == 3 and 1 not in [s.seed for s in later.sets]
    # not even one document fits
    tiny = pool_sets(corpus, 3, words, n_questions=5, seed=0, max_sets=10)
    assert tiny.sets == [] and "no document fits in 3 tokens" in tiny.shortfall


def test_resolve_dataset(tmp_path, monkeypatch):
    from cag.compare.dataset_sources import resolve_dataset
    from cag.errors import BadInput

    monkeypatch.setenv("CAG_DATASETS", str(tmp_path / "none"))
    with pytest.raises(BadInput, match="set CAG_DATASETS"):
        resolve_dataset("squad", None)
    monkeypatch.setenv("CAG_DATASETS", str(tmp_path))
    (tmp_path / HOTPOT_DEV_FILE).parent.mkdir(parents=True)
    (tmp_path / HOTPOT_DEV_FILE).write_text("[]")
    assert resolve_dataset("HotPot", None) == ("hotpotqa", None, {})
    with pytest.raises(BadInput, match="cannot be read as squad"):
        resolve_dataset("hotpot", "squad")
    squad_like = tmp_path / "mine.json"
    squad_like.write_text('{"version": "1.1", "data": []}')
    assert resolve_dataset(str(squad_like), None) == ("squad", squad_like, {})
    lst = tmp_path / "list.json"
    lst.write_text("[]")
    assert resolve_dataset(str(lst), "hotpot")[0] == "hotpotqa" and resolve_dataset(str(lst), None)[0] == "hotpotqa"
    qa = tmp_path / "qa.jsonl"
    qa.write_text("")
    assert resolve_dataset(str(qa), None, tmp_path / "docs") == ("jsonl", qa, {"docs_dir": tmp_path / "docs"})
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(BadInput, match="cannot tell the format"):
        resolve_dataset(str(other), None)
    with pytest.raises(BadInput, match="unknown format"):
        resolve_dataset(str(other), "csv")
