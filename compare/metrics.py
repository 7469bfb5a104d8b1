"""Answer-quality metrics and latency summaries for the CAG vs RAG comparison.

Exact match and F1 follow the official SQuAD v1.1 evaluation definitions
(normalization, token-level F1, max over the gold answers), written out here so
scores are comparable with published SQuAD numbers. ``answer_in_output`` is a
looser check for generative models, which tend to answer in a full sentence
("The game was played in Santa Clara.") where EM would score 0. It is also
too loose: "born in 1952, while his brother was born in 1953" finds gold
"1952", and a model that lists candidates scores on each of them.
``f1_first_sentence`` is the stricter reading the reports carry next to it:
token F1 of the output's first sentence only, so a hedge inside that sentence
costs precision, and a right answer that comes only after a wrong first
sentence earns (almost) nothing; text after the first sentence (the model's
ramble up to the token limit) is not held against it.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

import numpy as np

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalization: lowercase, drop ASCII punctuation, drop the
    articles a/an/the, collapse whitespace. Applied in that order, as the
    official script does (so "The" is lowercased before the article rule)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _require_golds(golds: list[str]) -> None:
    if not golds:
        raise ValueError("at least one gold answer is required")


def exact_match(prediction: str, golds: list[str]) -> float:
    """1.0 if the normalized prediction equals any normalized gold answer, else 0.0."""
    _require_golds(golds)
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def _f1_single(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    # Overlap counts repeated tokens at most min(times in pred, times in gold).
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0  # also covers an empty prediction or gold, as SQuAD v1.1 does
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(prediction: str, golds: list[str]) -> float:
    """Token-level F1 of normalized prediction vs gold, maximized over the golds."""
    _require_golds(golds)
    pred_tokens = normalize_answer(prediction).split()
    return max(_f1_single(pred_tokens, normalize_answer(g).split()) for g in golds)


def answer_in_output(prediction: str, golds: list[str]) -> float:
    """1.0 if some normalized gold appears in the normalized prediction, else 0.0.

    The match is on whole normalized tokens (a contiguous token run), not raw
    characters: otherwise gold "1" would be found inside "1990" and gold "art"
    inside "party". Golds that normalize to nothing never match.
    """
    _require_golds(golds)
    padded = f" {normalize_answer(prediction)} "
    for gold in golds:
        norm = normalize_answer(gold)
        if norm and f" {norm} " in padded:
            return 1.0
    return 0.0


# Words whose trailing period does not end a sentence.
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr st jr sr prof gen col lt mt vs etc eg ie no inc ltd co approx fig ca".split()
)
_SENTENCE_END = re.compile(r"[.!?](?=[\"'”’)\]]*(?:\s|$))|\n")
_WORD_BEFORE = re.compile(r"([\w.]*)$")


def first_sentence(text: str) -> str:
    """The text up to its first sentence end: ``.``, ``!`` or ``?`` before a space or
    the end, or a line break.

    A period after an initial ("Henry J. Kaiser"), a dotted abbreviation ("U.S.") or a
    common abbreviation ("St.", "Dr.") does not end the sentence, nor does one inside a
    number ("7.15"). A line break after an empty start or after a colon ("The answer
    is:\n\nKaiser") does not end it either: the answer follows on the next line.
    """
    text = text.strip()
    for m in _SENTENCE_END.finditer(text):
        head = text[: m.start()]
        if m.group() == "\n":
            if not head.strip() or head.rstrip().endswith(":"):
                continue
            return head.strip()
        if m.group() == ".":
            before = _WORD_BEFORE.search(head)
            assert before is not None  # it matches an empty word too
            word = before.group(1)
            if (len(word) == 1 and word.isupper()) or "." in word or word.lower() in _ABBREVIATIONS:
                continue
        return text[: m.end()]
    return text


def f1_first_sentence(prediction: str, golds: list[str]) -> float:
    """Token F1 (as :func:`f1`) of the prediction's first sentence (:func:`first_sentence`)."""
    return f1(first_sentence(prediction), golds)


def summarize(values: Iterable[float]) -> dict[str, float]:
    """Count, mean, median, 95th percentile (linear interpolation), min and max.

    Meant for per-question latencies and scores; p95 shows the tail that a
    mean hides (e.g. one slow cache rebuild among fast queries).
    """
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        raise ValueError("summarize needs at least one value")
    return {
        "n": int(arr.size),
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p95": float(np.percentile(arr, 95)),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }
