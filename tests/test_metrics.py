"""Tests for compare.metrics against hand-checked SQuAD v1.1-style cases."""

from __future__ import annotations

import pytest

from cag.compare.metrics import answer_in_output, exact_match, f1, normalize_answer, summarize


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("The Quick, Brown fox!", "quick brown fox"),
        ("an apple a day", "apple day"),
        ("Theater and anthem", "theater and anthem"),  # articles only as whole words
        ("  multiple \t spaces\n here ", "multiple spaces here"),
        ("U.S.A.", "usa"),  # punctuation goes before the article rule...
        ("A.", ""),  # ...so "A." becomes the bare article "a" and is dropped
        ("Levi's Stadium", "levis stadium"),
        ("", ""),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_exact_match():
    assert exact_match("the Eiffel Tower.", ["Eiffel Tower"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel Tower"]) == 0.0
    # Any of several golds counts.
    assert exact_match("Denver", ["Denver Broncos", "denver", "Broncos"]) == 1.0


def test_f1_partial_overlap():
    # pred  -> [denver, broncos, won, title] (4 tokens; "the" dropped)
    # gold  -> [denver, broncos]             (2 tokens)
    # common = 2, precision = 2/4, recall = 2/2, F1 = 2*0.5*1/(0.5+1) = 2/3
    assert f1("Denver Broncos won the title", ["the Denver Broncos"]) == pytest.approx(2 / 3)


def test_f1_counts_repeated_tokens_once_per_gold_occurrence():
    # pred [paris, paris, paris], gold [paris]: common = min(3, 1) = 1,
    # precision = 1/3, recall = 1, F1 = 2*(1/3)/(4/3) = 1/2
    assert f1("Paris paris PARIS", ["Paris"]) == pytest.approx(0.5)
    # pred [paris, paris], gold [paris, paris, london]: common = min(2, 2) = 2,
    # precision = 2/2, recall = 2/3, F1 = 2*1*(2/3)/(5/3) = 4/5
    # (a set-based overlap would give common 1 and F1 0.4).
    assert f1("Paris, Paris", ["Paris Paris London"]) == pytest.approx(0.8)


def test_f1_takes_best_of_several_golds():
    # pred -> [levis, stadium, in, santa, clara] (5 tokens)
    # gold 1 [santa, clara, california]: common 2, P 2/5, R 2/3, F1 = 0.5
    # gold 2 [levis, stadium]:           common 2, P 2/5, R 1,   F1 = 4/7
    pred = "Levi's Stadium in Santa Clara"
    assert f1(pred, ["Santa Clara, California"]) == pytest.approx(0.5)
    assert f1(pred, ["Santa Clara, California", "Levi's Stadium"]) == pytest.approx(4 / 7)
    assert f1("Levi's Stadium", ["Santa Clara", "Levi's Stadium"]) == 1.0


def test_empty_prediction():
    assert exact_match("", ["Denver"]) == 0.0
    assert f1("", ["Denver"]) == 0.0
    assert answer_in_output("", ["Denver"]) == 0.0
    # SQuAD v1.1 quirk kept on purpose: a gold that normalizes to nothing
    # exact-matches an empty prediction, but F1 (no common tokens) is 0.
    assert exact_match("", ["The"]) == 1.0
    assert f1("", ["The"]) == 0.0


def test_answer_in_output():
    sentence = "The game was played at Levi's Stadium in Santa Clara, California."
    assert answer_in_output(sentence, ["santa clara"]) == 1.0
    assert answer_in_output(sentence, ["Denver", "Levi's stadium"]) == 1.0
    assert answer_in_output(sentence, ["San Francisco"]) == 0.0
    # Whole tokens only: "1" is not found inside "1990", "art" not in "party".
    assert answer_in_output("It ended in 1990 at the party.", ["1"]) == 0.0
    assert answer_in_output("It ended in 1990 at the party.", ["art"]) == 0.0
    assert answer_in_output("It ended in 1990 at the party.", ["1990"]) == 1.0
    # A gold that normalizes to nothing must not match everything.
    assert answer_in_output("anything", ["the"]) == 0.0


@pytest.mark.parametrize("metric", [exact_match, f1, answer_in_output])
def test_metrics_require_golds(metric):
    with pytest.raises(ValueError):
        metric("x", [])


def test_summarize():
    stats = summarize(float(v) for v in range(1, 21))  # 1..20
    assert stats["n"] == 20
    assert stats["mean"] == pytest.approx(10.5)
    assert stats["median"] == pytest.approx(10.5)
    # Linear interpolation: position 0.95 * 19 = 18.05 -> 19 + 0.05 * (20 - 19)
    assert stats["p95"] == pytest.approx(19.05)
    assert (stats["min"], stats["max"]) == (1.0, 20.0)


def test_summarize_single_value_and_empty():
    assert summarize([0.25]) == {"n": 1, "mean": 0.25, "median": 0.25, "p95": 0.25, "min": 0.25, "max": 0.25}
    with pytest.raises(ValueError):
        summarize([])
