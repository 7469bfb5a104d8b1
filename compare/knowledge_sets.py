"""Fixed-size knowledge sets cut from a QA dataset for the CAG vs RAG comparison.

A *knowledge set* is the body of text that CAG preloads into the KV cache and
that RAG indexes: a list of whole documents whose token total stays within a
target size, plus the questions answerable from exactly those documents.
Building sets of several sizes from one corpus (compare.datasets) lets the
harness measure how both approaches scale with the knowledge size.

Budget rule: documents are added whole, in a seeded order, and pooling stops
at the first document (HotpotQA: the first question's group of paragraphs)
that would push the token total past the budget. Nothing is truncated, and
``KnowledgeSet.n_tokens`` (the sum of ``count_tokens(doc.text)``) is always
<= the size asked for. Titles, separators and prompt template tokens are not
counted, so the engine should leave headroom for them.

One size, several sets (:func:`pool_sets`): when the set of the run's seed
holds fewer questions than asked, sets of the further seeds are drawn, each
adding only questions not drawn yet, up to a number of sets per size.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .datasets import Corpus, Doc, QAItem, load_corpus


@dataclass
class KnowledgeSet:
    """Documents totalling ``n_tokens`` (<= the size asked) and questions on them."""

    name: str
    docs: list[Doc]
    questions: list[QAItem]
    n_tokens: int
    seed: int = 0  # the seed of the document order and the question draw


def _pool(
    corpus: Corpus,
    order: list[list[str]],
    budget: int,
    cost: Callable[[str], int],
) -> tuple[list[str], int]:
    """Doc ids chosen for ``budget`` tokens, following the module's budget rule."""
    chosen: list[str] = []
    chosen_set: set[str] = set()
    total = 0
    for group in order:
        new = [d for d in group if d not in chosen_set]
        units = [new] if corpus.atomic_groups else [[d] for d in new]
        for unit in units:
            unit_cost = sum(cost(d) for d in unit)
            if total + unit_cost > budget:
                return chosen, total
            chosen.extend(unit)
            chosen_set.update(unit)
            total += unit_cost
    return chosen, total


def _seeded_order(corpus: Corpus, seed: int) -> list[list[str]]:
    # One shuffle for all sizes, so a smaller set is a prefix of a larger one
    # and a scaling curve compares nested knowledge rather than unrelated draws.
    order = list(corpus.groups)
    random.Random(seed).shuffle(order)
    return order


def _token_cost(corpus: Corpus, count_tokens: Callable[[str], int]) -> Callable[[str], int]:
    """Doc id -> tokens, each document counted once."""
    by_id = {d.doc_id: d for d in corpus.docs}
    token_cache: dict[str, int] = {}

    def cost(doc_id: str) -> int:
        if doc_id not in token_cache:
            token_cache[doc_id] = count_tokens(by_id[doc_id].text)
        return token_cache[doc_id]

    return cost


def _draw(
    corpus: Corpus,
    order: list[list[str]],
    size: int,
    cost: Callable[[str], int],
    n_questions: int,
    seed: int,
    exclude: frozenset[str] = frozenset(),
    name: str | None = None,
) -> KnowledgeSet:
    if size < 1:
        raise ValueError(f"knowledge set size must be positive, got {size}")
    chosen, total = _pool(corpus, order, size, cost)
    if not chosen:
        raise ValueError(
            f"{corpus.name}: no document fits in {size} tokens "
            f"(the first one in seeded order needs more)"
        )
    included = set(chosen)
    answerable = [
        q for q in corpus.questions if set(q.gold_doc_ids) <= included and q.qid not in exclude
    ]
    # Per-size question draw, seeded by (seed, size) so it is reproducible
    # and does not shift when other sizes are added to the list.
    picked = random.Random(f"{seed}:{size}").sample(
        range(len(answerable)), min(n_questions, len(answerable))
    )
    by_id = {d.doc_id: d for d in corpus.docs}
    return KnowledgeSet(
        name or f"{corpus.name}-{size}",
        [by_id[d] for d in chosen],
        [answerable[i] for i in sorted(picked)],
        total,
        seed,
    )


def knowledge_sets_from_corpus(
    corpus: Corpus,
    sizes_tokens: list[int],
    count_tokens: Callable[[str], int],
    n_questions: int,
    seed: int,
) -> list[KnowledgeSet]:
    """Cut ``corpus`` into one knowledge set per size; see :func:`build_knowledge_sets`."""
    if n_questions < 1:
        raise ValueError(f"n_questions must be at least 1, got {n_questions}")
    cost = _token_cost(corpus, count_tokens)
    order = _seeded_order(corpus, seed)
    return [_draw(corpus, order, size, cost, n_questions, seed) for size in sizes_tokens]


def set_name(corpus: Corpus, size: int, seed: int, base_seed: int) -> str:
    """``squad-2000`` for the run's own seed, ``squad-2000-seed3`` for a set pooled from seed 3."""
    return f"{corpus.name}-{size}" if seed == base_seed else f"{corpus.name}-{size}-seed{seed}"


# A size gives up after this many further seeds in a row that add no usable question.
POOL_PATIENCE = 10


@dataclass
class SizePool:
    """The knowledge sets pooled for one size, and why it holds fewer questions than asked."""

    size: int
    asked: int
    sets: list[KnowledgeSet]  # the accepted sets, in seed order
    seeds_tried: int
    shortfall: str | None = None  # None when ``asked`` questions were reached

    @property
    def n_questions(self) -> int:
        return sum(len(s.questions) for s in self.sets)


def pool_sets(
    corpus: Corpus,
    size: int,
    count_tokens: Callable[[str], int],
    n_questions: int,
    seed: int,
    max_sets: int,
    accept: Callable[[KnowledgeSet], bool] = lambda ks: True,
) -> SizePool:
    """Knowledge sets of one size until they hold ``n_questions`` distinct questions.

    The set of ``seed`` comes first (the same set :func:`knowledge_sets_from_corpus`
    cuts, nested with the other sizes). When it holds fewer questions than asked
    (a HotpotQA question brings ~10 paragraphs, so a 2,000-token set holds one),
    sets of the further seeds ``seed+1, seed+2, ...`` are drawn, each keeping only
    questions no earlier set of this size has, until the questions are reached,
    ``max_sets`` sets are accepted, a set holds the whole corpus (no other seed can
    add anything), or ``POOL_PATIENCE`` seeds in a row add no question.

    ``accept(set)`` is asked about each set with new questions (the runner measures
    and ingests it there) and returns False for a set that cannot be used (e.g. its
    real prefix does not fit the context). The seed's own set is always offered, even
    without questions, so the caller can report it; when it cannot be drawn (no
    document fits) or is refused, the size stops there with ``shortfall`` saying why:
    the further seeds would be sets of the same size. A further set that is refused
    or adds no question counts towards the patience.
    """
    if n_questions < 1:
        raise ValueError(f"n_questions must be at least 1, got {n_questions}")
    if max_sets < 1:
        raise ValueError(f"max_sets must be at least 1, got {max_sets}")
    cost = _token_cost(corpus, count_tokens)
    pool = SizePool(size, n_questions, [], 0)
    taken: set[str] = set()
    misses = 0
    while len(taken) < n_questions and len(pool.sets) < max_sets and misses < POOL_PATIENCE:
        s = seed + pool.seeds_tried
        pool.seeds_tried += 1
        try:
            ks = _draw(corpus, _seeded_order(corpus, s), size, cost, n_questions - len(taken), s,
                       frozenset(taken), set_name(corpus, size, s, seed))
        except ValueError as e:  # not even the first document of this order fits
            if s == seed:
                pool.shortfall = str(e)
                return pool
            misses += 1
            continue
        first = s == seed
        if not ks.questions and not first:
            misses += 1
            continue
        if not accept(ks):
            if first:  # the size is skipped: its further seeds are sets of the same size
                pool.shortfall = f"{ks.name} cannot be run"
                return pool
            misses += 1
            continue
        if ks.questions:
            pool.sets.append(ks)
            taken.update(q.qid for q in ks.questions)
            misses = 0
        else:
            misses += 1
        if len(ks.docs) == len(corpus.docs):
            break  # the whole corpus is in: no other seed can add a question
    got = len(taken)
    if got >= n_questions:
        return pool
    if len(pool.sets) >= max_sets:
        pool.shortfall = (f"{got} of {n_questions} questions from {len(pool.sets)} sets, "
                          "the most pooled per size (--max-sets)")
    else:
        pool.shortfall = (f"{got} of {n_questions} questions: the dataset holds no more at this size "
                          f"({pool.seeds_tried} seeds tried)")
    return pool


def build_knowledge_sets(
    fmt: str,
    source_path: Path | str | None,
    sizes_tokens: list[int],
    count_tokens: Callable[[str], int],
    n_questions: int,
    seed: int,
    **options,
) -> list[KnowledgeSet]:
    """One knowledge set per entry of ``sizes_tokens``, in the same order.

    Pooling (deterministic given ``seed``; the same order serves every size,
    so sets are nested):

    * squad: articles in seeded order, each article's paragraphs in file order,
      whole paragraphs only. A question is kept if its paragraph is in.
    * hotpotqa: questions in seeded order, each adding all its (up to 10)
      paragraphs, distractors included, as in the CAG paper; paragraphs already
      present cost nothing. A question is kept if its supporting paragraphs are in.
    * jsonl: documents (folder files and distinct context strings) in seeded
      order. A question is kept if all its gold documents are in.

    Pooling stops at the first document or group that would exceed the size
    (never truncating a document), so ``n_tokens <= size``. From the answerable
    questions up to ``n_questions`` are sampled with a seeded RNG and listed in
    corpus order. Raises ValueError if not even the first document fits.
    ``options`` go to the loader (jsonl: ``docs_dir``).
    """
    corpus = load_corpus(fmt, source_path, **options)
    return knowledge_sets_from_corpus(corpus, sizes_tokens, count_tokens, n_questions, seed)
