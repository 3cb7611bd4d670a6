"""The sample-quality figures: which words a sample wrote, whether they exist, how dense they are."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from dlm.evaluation.sample_quality import SampleQuality, corpus_words, pooled, sample_quality, words
from dlm.sampling.prompting import template_fixed_text


def test_words_are_runs_of_letters_in_lower_case_with_inner_apostrophes() -> None:
    text = "ROMEO: O'er the\n\n  hills, 'tis 42 fair_Verona... café!"
    assert words(text) == ["romeo", "o'er", "the", "hills", "tis", "fair", "verona", "café"]
    assert words("\n\n ,.;\n") == []  # blank lines and punctuation: no words at all


def test_only_the_words_the_model_wrote_are_scored() -> None:
    vocabulary = frozenset({"romeo", "fair", "verona", "the", "night"})
    template = "ROMEO: [MASK*6] fair Verona"
    assert template_fixed_text(template) == "ROMEO:   fair Verona"
    quality = sample_quality("ROMEO: the night noweasant fair Verona", template_fixed_text(template), 6, vocabulary)
    assert quality == SampleQuality(words=3, known_words=2, generated_tokens=6)
    assert quality.known_share == pytest.approx(2 / 3) and quality.words_per_token == pytest.approx(0.5)
    # A word the prompt already has counts again when the model writes it a second time.
    again = sample_quality("ROMEO: Romeo, Romeo", "ROMEO:", 4, vocabulary)
    assert (again.words, again.known_words) == (2, 2)
    blank = sample_quality("ROMEO:\n\n\n,\n", "ROMEO:", 8, vocabulary)
    assert (blank.words, blank.known_share, blank.words_per_token) == (0, 0.0, 0.0)
    assert blank.to_dict() == {
        "words": 0,
        "known_words": 0,
        "generated_tokens": 8,
        "known_word_share": 0.0,
        "words_per_token": 0.0,
    }


def test_pooled_figures_sum_words_and_tokens() -> None:
    total = pooled([SampleQuality(3, 2, 6), SampleQuality(5, 5, 10)])
    assert total == SampleQuality(8, 7, 16) and total.known_share == pytest.approx(7 / 8)


def test_corpus_words_read_any_corpus_format_and_count_tokens(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    from dlm.data.tokenizer import load_tokenizer

    plain, packed = tmp_path / "a.txt", tmp_path / "b.txt.gz"
    plain.write_text("To be, or not to be:\nthat is the question.\n", encoding="utf-8")
    packed.write_bytes(gzip.compress(b"Whether 'tis nobler\n"))
    tokenizer = load_tokenizer(tiny_tokenizer_path)
    found = corpus_words([plain, packed], tokenizer)
    assert found.vocabulary == {"to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"}
    assert found.words == 13
    texts = [plain.read_text(encoding="utf-8"), "Whether 'tis nobler\n"]
    tokens = sum(len(tokenizer.encode(text, add_special_tokens=False).ids) for text in texts)
    assert found.tokens == tokens and found.words_per_token == pytest.approx(13 / tokens)
    assert corpus_words([plain]).tokens == 0  # no tokenizer: words only
