"""QA datasets for the CAG vs RAG comparison, loaded into a `Corpus`: documents, questions, and the
blocks of documents that compare.knowledge_sets cuts into knowledge sets.

Formats (see ``shared/datasets/*/SOURCE.md`` for origin and counts; compare.dataset_sources says
where the shared copies are and guesses a file's format):

* ``squad``: official SQuAD v1.1 dev JSON (optionally gzipped). One document
  per paragraph, id ``squad:<article title>:<paragraph index>``.
* ``hotpotqa``: HotpotQA distractor JSON list. One document per context
  paragraph, id ``hotpot:<title>``, deduplicated by title. Gold documents are
  the supporting-fact paragraphs.
* ``jsonl``: user data. Each line is ``{"question", "answers": [...]}`` plus
  either ``"context": str`` (that text is the gold document) or
  ``"doc_ids": [...]`` naming files in a documents folder (doc id = path
  relative to that folder). An optional ``"id"`` names the question.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .dataset_sources import FORMATS, default_source


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
