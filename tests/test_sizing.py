"""Sizing warnings: a vocabulary, a model or a step count too large for the training text.

`dlm tokenizer train` counts how often each learned token occurs in its corpus; `dlm validate` counts
them in train.bin and compares parameters and epochs with the training tokens. Each warns (a
`warning:` line, a `warning` row) and never changes an exit code.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dlm.assets import shakespeare_files
from dlm.data.tokenizer import MIN_VOCAB_SIZE, VocabularyFit, train_tokenizer, vocabulary_fit

# All's Well That Ends Well: 134 kB of text. 2048 tokens leave 62% of the learned ones rare in it,
# 1024 tokens 14%.
PLAY = shakespeare_files("train")[:1]
PLAY_WARNING = (
    "2048 tokens for 134 kB of text: 62% of the 1,789 learned tokens occur fewer than 10 times in it, too rare "
    "to learn; about 512\u20131024 tokens suit this size (retrain with --vocab-size 1024, or train on more text)"
)


def test_a_learned_token_seen_fewer_than_ten_times_is_rare() -> None:
    counts = np.zeros(MIN_VOCAB_SIZE + 4, dtype=np.int64)
    counts[:MIN_VOCAB_SIZE] = 0  # unused bytes and specials never count
    counts[MIN_VOCAB_SIZE:] = [9, 10, 10, 10]
    fit = vocabulary_fit(counts, MIN_VOCAB_SIZE + 4)
    assert (fit.learned, fit.rare, fit.rare_share, fit.too_large) == (4, 1, 0.25, True)
    counts[MIN_VOCAB_SIZE] = 10
    assert vocabulary_fit(counts, MIN_VOCAB_SIZE + 4).too_large is False
    # A token id the text never reaches counts 0 times.
    assert vocabulary_fit(counts[: MIN_VOCAB_SIZE + 2], MIN_VOCAB_SIZE + 4).rare == 2


@pytest.mark.parametrize(
    ("fit", "sizes"),
    [
        (VocabularyFit(8192, 7933, 4388), (2048, 4096)),  # 1.3 MB of Shakespeare
        (VocabularyFit(4096, 3837, 3000), (1024, 2048)),
        (VocabularyFit(6000, 5741, 1500), (2048, 4096)),  # never the size it warns about, nor above it
        (VocabularyFit(512, 253, 200), (MIN_VOCAB_SIZE, MIN_VOCAB_SIZE)),
    ],
)
def test_suggested_sizes_are_powers_of_two_around_the_frequent_tokens(fit: VocabularyFit, sizes: tuple) -> None:
    assert fit.suggested_sizes() == sizes


def test_tokenizer_train_warns_when_the_vocabulary_is_too_large(tmp_path: Path, run_cli) -> None:
    output = tmp_path / "tokenizer.json"
    result = run_cli("tokenizer", "train", *PLAY, "--vocab-size", "2048", "--output", output, "--json")
    assert result.exit_code == 0 and output.is_file()
    assert result.stderr.splitlines() == [f"warning: {PLAY_WARNING}"]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["warning"] == PLAY_WARNING
    assert summary["vocab_fit"] == {
        "vocab_size": 2048,
        "learned_tokens": 1789,
        "rare_tokens": 1105,
        "rare_below": 10,
        "rare_share": 1105 / 1789,
        "too_large": True,
        "suggested_vocab_sizes": [512, 1024],
    }


def test_tokenizer_train_warning_is_one_line_beside_the_human_output(
    tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch, narrow_console: int
) -> None:
    monkeypatch.setattr("dlm.cli.data_cmd.wants_json", lambda flag: False)
    result = run_cli("tokenizer", "train", *PLAY, "--vocab-size", "2048", "--output", tmp_path / "t.json")
    assert result.exit_code == 0
    assert result.stderr.splitlines() == [f"warning: {PLAY_WARNING}"]
    assert "vocab_size = 2048" in result.stdout


def test_a_vocabulary_that_suits_the_text_does_not_warn(tmp_path: Path, run_cli) -> None:
    result = run_cli("tokenizer", "train", *PLAY, "--vocab-size", "1024", "--output", tmp_path / "t.json", "--json")
    assert result.exit_code == 0 and result.stderr == ""
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["warning"] is None
    assert summary["vocab_fit"]["rare_tokens"] == 110 and summary["vocab_fit"]["too_large"] is False
    assert summary["vocab_fit"]["suggested_vocab_sizes"] is None


def test_a_corpus_above_the_counting_limit_is_not_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dlm.data.tokenizer.COUNTED_BYTES_LIMIT", 1000)
    summary = train_tokenizer(PLAY, 2048, tmp_path / "t.json")
    assert summary.vocab_fit is None and summary.warning is None
