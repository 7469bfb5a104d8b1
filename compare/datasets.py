"""QA datasets and fixed-size knowledge sets for the CAG vs RAG comparison.

A *knowledge set* is the body of text that CAG preloads into the KV cache and
that RAG indexes: a list of whole documents whose token total stays within a
target size, plus the questions answerable from exactly those documents.
Building sets of several sizes from one corpus lets the harness measure how
both approaches scale with the knowledge size.

Formats (see ``shared/datasets/*/SOURCE.md`` for origin and counts):

* ``squad``: official SQuAD v1.1 dev JSON (optionally gzipped). One document
  per paragraph, id ``squad:<article title>:<paragraph index>``.
* ``hotpotqa``: HotpotQA distractor JSON list. One document per context
  paragraph, id ``hotpot:<title>``, deduplicated by title. Gold documents are
  the supporting-fact paragraphs.
* ``jsonl``: user data. Each line is ``{"question", "answers": [...]}`` plus
  either ``"context": str`` (that text is the gold document) or
  ``"doc_ids": [...]`` naming files in a documents folder (doc id = path
  relative to that folder). An optional ``"id"`` names the question.

Budget rule: documents are added whole, in a seeded order, and pooling stops
at the first document (HotpotQA: the first question's group of paragraphs)
that would push the token total past the budget. Nothing is truncated, and
``KnowledgeSet.n_tokens`` (the sum of ``count_tokens(doc.text)``) is always
<= the size asked for. Titles, separators and prompt template tokens are not
counted, so the engine should leave headroom for them.

One size, several sets (:func:`pool_sets`): when the set of the run's seed
holds fewer questions than asked, sets of the further seeds are drawn, each
adding only questions not drawn yet, up to a number of sets per size.

Where the data is (:func:`resolve_dataset`): the words ``squad`` and ``hotpot``
name the shared copies under ``$CAG_DATASETS`` (default ``../shared/datasets``
next to the repository); anything else is a file path.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("squad", "hotpotqa", "jsonl")

SQUAD_DEV_FILE = Path("squad_v1.1_dev") / "dev-v1.1.json.gz"
HOTPOT_DEV_FILE = Path("hotpotqa_dev_distractor") / "hotpot_dev_distractor_v1.first53.json"


@dataclass(frozen=True)
class Doc:
    """One knowledge document; ``doc_id`` is unique within its corpus."""

    doc_id: str
    title: str
    text: str


@dataclass(frozen=True)
class QAItem:
    """A question, its accepted answers, and the documents needed to answer it."""

    qid: str
    question: str
    answers: list[str]
    gold_doc_ids: list[str]


@dataclass
class KnowledgeSet:
    """Documents totalling ``n_tokens`` (<= the size asked) and questions on them."""

    name: str
    docs: list[Doc]
    questions: list[QAItem]
    n_tokens: int
    seed: int = 0  # the seed of the document order and the question draw


@dataclass
class Corpus:
    """A loaded dataset, before it is cut into knowledge sets.

    ``groups`` lists doc ids in the blocks that pooling shuffles as a whole
    (SQuAD: an article's paragraphs; HotpotQA: one question's paragraphs;
    jsonl: each document alone). With ``atomic_groups`` a block is added all
    or nothing, so a HotpotQA question always comes with its distractors;
    otherwise documents are added one at a time in block order.
    """

    name: str
    docs: list[Doc]
    questions: list[QAItem]
    groups: list[list[str]]
    atomic_groups: bool


def datasets_root() -> Path:
    """The shared datasets folder: ``$CAG_DATASETS`` if set, else ``<repo>/../shared/datasets``."""
    override = os.environ.get("CAG_DATASETS")
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


def default_source(fmt: str) -> Path:
    """Path of the shared file for a built-in format."""
    if fmt == "squad":
        return datasets_root() / SQUAD_DEV_FILE
    if fmt == "hotpotqa":
        return datasets_root() / HOTPOT_DEV_FILE
    raise ValueError(f"format {fmt!r} has no default source file; pass source_path")


SHARED_NAMES = {"squad": "squad", "hotpot": "hotpotqa", "hotpotqa": "hotpotqa"}


def resolve_dataset(dataset: str, fmt: str | None, docs: Path | None = None) -> tuple[str, Path | None, dict]:
    """What the user named -> (loader format, path or None for the shared copy, loader options).

    The words ``squad`` and ``hotpot`` (``hotpotqa``) name the shared copies under
    :func:`datasets_root` unless a file of that name exists; anything else is a path whose
    format is ``fmt`` or guessed from its name and first bytes. Raises BadInput.
    """
    from cag.errors import BadInput

    fmt = {"hotpot": "hotpotqa"}.get(fmt, fmt) if fmt else None
    if fmt is not None and fmt not in FORMATS:
        raise BadInput(f"unknown format {fmt!r}; use squad, hotpot or jsonl")
    name = SHARED_NAMES.get(dataset.lower())
    if name and not Path(dataset).exists():
        if fmt and fmt != name:
            raise BadInput(f"dataset {dataset!r} is the shared {name} copy; it cannot be read as {fmt}")
        path = default_source(name)
        if not path.is_file():
            raise BadInput(f"the shared {name} dataset is not at {path} (set CAG_DATASETS to its folder)")
        return name, None, {}
    path = Path(dataset).expanduser()
    if not path.is_file():
        raise BadInput(f"no such dataset file: {dataset} (or use the words squad / hotpot)")
    if fmt is None:
        fmt = guess_format(path)
    opts = {"docs_dir": docs} if fmt == "jsonl" and docs is not None else {}
    return fmt, path, opts


def guess_format(path: Path) -> str:
    """squad (a JSON object with "data"), hotpotqa (a JSON list) or jsonl (by name); BadInput otherwise."""
    from cag.errors import BadInput

    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            head = f.read(1 << 16).lstrip()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read {path}: {e}") from None
    if head.startswith("{") and '"data"' in head:
        return "squad"
    if head.startswith("["):
        return "hotpotqa"
    raise BadInput(f"cannot tell the format of {path}; pass --format squad|hotpot|jsonl")


def _read_json(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return json.load(handle)


def load_squad(path: Path | str | None = None) -> Corpus:
    """Load SQuAD v1.1 JSON: articles -> paragraphs -> qas.

    All gold answer strings are kept in file order, duplicates included, as
    the official evaluation does (``answers[0]`` is the first annotator's).
    """
    path = Path(path) if path is not None else default_source("squad")
    data = _read_json(path)
    docs: list[Doc] = []
    questions: list[QAItem] = []
    groups: list[list[str]] = []
    for article in data["data"]:
        raw_title = article["title"]
        group: list[str] = []
        for p_index, paragraph in enumerate(article["paragraphs"]):
            doc_id = f"squad:{raw_title}:{p_index}"
            docs.append(Doc(doc_id, raw_title.replace("_", " "), paragraph["context"]))
            group.append(doc_id)
            for qa in paragraph["qas"]:
                questions.append(
                    QAItem(qa["id"], qa["question"], [a["text"] for a in qa["answers"]], [doc_id])
                )
        groups.append(group)
    return Corpus("squad", docs, questions, groups, atomic_groups=False)


def _hotpot_doc_id(title: str) -> str:
    return f"hotpot:{title}"


def load_hotpotqa(path: Path | str | None = None) -> Corpus:
    """Load HotpotQA distractor records.

    Paragraph text is the sentences concatenated as given (they carry their own
    leading spaces). A title seen in several records becomes one document;
    the first text seen is kept.
    """
    path = Path(path) if path is not None else default_source("hotpotqa")
    records = _read_json(path)
    docs: list[Doc] = []
    seen: set[str] = set()
    questions: list[QAItem] = []
    groups: list[list[str]] = []
    for record in records:
        group: list[str] = []
        for title, sentences in record["context"]:
            doc_id = _hotpot_doc_id(title)
            if doc_id not in seen:
                seen.add(doc_id)
                docs.append(Doc(doc_id, title, "".join(sentences)))
            if doc_id not in group:
                group.append(doc_id)
        gold = list(dict.fromkeys(_hotpot_doc_id(t) for t, _ in record["supporting_facts"]))
        questions.append(QAItem(record["_id"], record["question"], [record["answer"]], gold))
        groups.append(group)
    return Corpus("hotpotqa", docs, questions, groups, atomic_groups=True)


def _context_doc_id(text: str) -> str:
    # Content hash: stable across runs and shared by questions with the same context.
    return "ctx:" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _folder_docs(docs_dir: Path) -> list[Doc]:
    """Every non-hidden file under ``docs_dir`` (recursively), sorted by relative path."""
    out: list[Doc] = []
    for file in sorted(docs_dir.rglob("*")):
        rel = file.relative_to(docs_dir)
        if not file.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        out.append(Doc(rel.as_posix(), file.stem, file.read_text(encoding="utf-8")))
    return out


def load_jsonl(path: Path | str, docs_dir: Path | str | None = None) -> Corpus:
    """Load user QA data; see the module docstring for the line format.

    ``docs_dir`` defaults to a ``docs`` folder next to the jsonl file and is
    read only if it exists or a question uses ``doc_ids``. Every file in it is
    a document, referenced or not (unreferenced ones act as distractors).
    """
    path = Path(path)
    folder = Path(docs_dir) if docs_dir is not None else path.parent / "docs"
    docs: list[Doc] = _folder_docs(folder) if folder.is_dir() else []
    known = {d.doc_id for d in docs}
    questions: list[QAItem] = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            where = f"{path}:{line_no}"
            answers = record.get("answers")
            if not isinstance(answers, list) or not answers or not record.get("question"):
                raise ValueError(f"{where}: needs 'question' and a non-empty 'answers' list")
            if "context" in record:
                doc_id = _context_doc_id(record["context"])
                if doc_id not in known:
                    known.add(doc_id)
                    docs.append(Doc(doc_id, "", record["context"]))
                gold = [doc_id]
            elif "doc_ids" in record:
                gold = [str(d) for d in record["doc_ids"]]
                missing = [d for d in gold if d not in known]
                if missing:
                    raise ValueError(f"{where}: doc_ids not found in {folder}: {missing}")
            else:
                raise ValueError(f"{where}: needs either 'context' or 'doc_ids'")
            qid = str(record.get("id", f"{path.stem}:{line_no}"))
            questions.append(QAItem(qid, record["question"], [str(a) for a in answers], gold))
    return Corpus(path.stem, docs, questions, [[d.doc_id] for d in docs], atomic_groups=False)


def load_corpus(fmt: str, source_path: Path | str | None = None, **options) -> Corpus:
    """Load a corpus by format name; ``source_path=None`` means the shared file."""
    if fmt == "squad":
        return load_squad(source_path)
    if fmt == "hotpotqa":
        return load_hotpotqa(source_path)
    if fmt == "jsonl":
        if source_path is None:
            raise ValueError("jsonl format needs source_path")
        return load_jsonl(source_path, **options)
    raise ValueError(f"unknown dataset format {fmt!r}; expected one of {FORMATS}")


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
