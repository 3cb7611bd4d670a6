"""Tokenizer training and loading: exact vocabulary, fixed special ids, lossless round trips."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from dlm.data.tokenizer import (
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    load_tokenizer,
    special_token_id,
    tokenizer_sha256,
    train_tokenizer,
)
from dlm.errors import UserError

AWKWARD_TEXTS = [
    "plain ASCII, with punctuation!?",
    "trailing spaces  \n  leading spaces\n\n\n\ttabs\tand\r\nCRLF\r\n",
    "accents: é à ü ñ; CJK: 日本語の文章; emoji: 🙂👍🏽; RTL: שלום",
    "control \x00\x01\x7f characters and a lone \u2028 separator",
    "<|endoftext|> written as text",  # special-token text encodes as the special id, decodes back
    "",
]


def write_corpus(directory: Path) -> Path:
    """A small corpus spread over .txt, .md and .jsonl.gz files in nested directories."""

    (directory / "nested").mkdir(parents=True)
    (directory / "a.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 40)
    (directory / "nested" / "b.md").write_text("# Title\n\nSome *markdown* text, é and 日本.\n" * 40)
    with gzip.open(directory / "nested" / "c.jsonl.gz", "wt", encoding="utf-8") as handle:
        for index in range(30):
            handle.write(json.dumps({"text": f"record {index}: lorem ipsum dolor sit amet"}) + "\n")
    return directory


def test_special_tokens_have_fixed_ids(tiny_tokenizer_path: Path) -> None:
    tokenizer = load_tokenizer(tiny_tokenizer_path)
    assert list(SPECIAL_TOKENS) == ["eos", "mask", "pad"]
    assert [special_token_id(tokenizer, name) for name in SPECIAL_TOKENS] == [0, 1, 2]
    assert tokenizer.token_to_id("<|endoftext|>") == 0 and tokenizer.token_to_id("<|mask|>") == 1
    with pytest.raises(ValueError, match="unknown special token"):
        special_token_id(tokenizer, "bos")


def test_vocabulary_is_exactly_the_requested_size(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    assert load_tokenizer(tiny_tokenizer_path).get_vocab_size(with_added_tokens=True) == 512
    summary = train_tokenizer([write_corpus(tmp_path / "corpus")], 300, tmp_path / "t.json")
    assert summary.vocab_size == 300 and summary.files == 3 and summary.documents == 2 + 30
    assert load_tokenizer(tmp_path / "t.json").get_vocab_size(with_added_tokens=True) == 300
    assert summary.config_lines == ["vocab_size = 300", "mask_token_id = 1"]
    assert summary.sha256 == hashlib.sha256((tmp_path / "t.json").read_bytes()).hexdigest()


@pytest.mark.parametrize("text", AWKWARD_TEXTS)
def test_every_string_round_trips_without_unknown_tokens(tiny_tokenizer_path: Path, text: str) -> None:
    tokenizer = load_tokenizer(tiny_tokenizer_path)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert all(0 <= i < 512 for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_encoding_line_pieces_equals_encoding_the_whole_text(tiny_tokenizer_path: Path) -> None:
    # Packing encodes newline-aligned pieces separately; the model must see the same tokens as
    # `encode(document)` at sampling time, including around whitespace next to line breaks.
    tokenizer = load_tokenizer(tiny_tokenizer_path)
    text = "Enter  \n   KING.  What, ho!\n\n  \tExit\r\n  all.\n" * 3
    lines = text.splitlines(keepends=True)
    pieces = [tokenizer.encode(line, add_special_tokens=False).ids for line in lines]
    assert [i for piece in pieces for i in piece] == tokenizer.encode(text).ids


def test_tokenizer_sha256_is_the_file_hash(tiny_tokenizer_path: Path) -> None:
    expected = hashlib.sha256(tiny_tokenizer_path.read_bytes()).hexdigest()
    assert tokenizer_sha256(tiny_tokenizer_path) == expected


def test_load_refuses_a_tokenizer_without_our_special_tokens(tmp_path: Path) -> None:
    foreign = Tokenizer(models.BPE())
    foreign.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    foreign.add_special_tokens(["<s>", "</s>"])
    path = tmp_path / "foreign.json"
    foreign.save(str(path))
    with pytest.raises(UserError, match="lacks dlm's special tokens") as caught:
        load_tokenizer(path)
    assert str(path) in str(caught.value)
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(UserError, match=r"not a tokenizer\.json"):
        load_tokenizer(tmp_path / "garbage.json")
    with pytest.raises(UserError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "absent.json")


def test_progress_reports_bytes_up_to_the_total(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    corpus = write_corpus(tmp_path / "corpus")
    train_tokenizer([corpus], 280, tmp_path / "t.json", progress=lambda d, t: calls.append((d, t)))
    total = sum(p.stat().st_size for p in corpus.rglob("*") if p.is_file())
    assert calls and calls[-1] == (total, total)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def test_cli_prints_vocab_special_ids_and_config_lines(tmp_path: Path, run_cli) -> None:
    output = tmp_path / "out" / "tokenizer.json"
    result = run_cli("tokenizer", "train", write_corpus(tmp_path / "corpus"), "-n", "290", "-o", output)
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["vocab_size"] == 290
    assert summary["special_token_ids"] == {"eos": 0, "mask": 1, "pad": 2}
    assert summary["config_lines"] == ["vocab_size = 290", "mask_token_id = 1"]
    assert output.is_file()


def test_cli_refuses_a_vocabulary_too_small_for_the_specials(tmp_path: Path, run_cli) -> None:
    output = tmp_path / "t.json"
    corpus = write_corpus(tmp_path / "corpus")
    result = run_cli("tokenizer", "train", corpus, "-n", str(MIN_VOCAB_SIZE - 1), "-o", output)
    result.assert_refused("too small", str(MIN_VOCAB_SIZE))
    assert not output.exists() and list(tmp_path.iterdir()) == [tmp_path / "corpus"]


def test_cli_refuses_a_vocabulary_the_corpus_cannot_fill(tmp_path: Path, run_cli) -> None:
    (tmp_path / "small.txt").write_text("abab abab abab\n")
    output = tmp_path / "t.json"
    result = run_cli("tokenizer", "train", tmp_path / "small.txt", "-n", "5000", "-o", output)
    result.assert_refused("supports only", "5000")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.txt"]


def test_cli_refuses_to_overwrite_without_the_flag(tmp_path: Path, run_cli) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    output = tmp_path / "t.json"
    output.write_text("keep me")
    run_cli("tokenizer", "train", corpus, "-n", "270", "-o", output).assert_refused("already exists")
    assert output.read_text() == "keep me"
    assert run_cli("tokenizer", "train", corpus, "-n", "270", "-o", output, "--overwrite").exit_code == 0
    assert load_tokenizer(output).get_vocab_size(with_added_tokens=True) == 270


def test_cli_human_output_shows_the_lines_to_paste(tmp_path: Path, run_cli, monkeypatch, narrow_console) -> None:
    monkeypatch.setattr("dlm.cli.data_cmd.wants_json", lambda flag: False)
    output = tmp_path / "a-directory-name-long-enough-that-the-path-alone-fills-a-terminal-line" / "t.json"
    output.parent.mkdir()
    assert len(str(output)) > narrow_console
    result = run_cli("tokenizer", "train", write_corpus(tmp_path / "corpus"), "-n", "280", "-o", output)
    assert result.exit_code == 0, result.stderr
    # The path a person copies stays whole on its line, however narrow the terminal.
    assert f"wrote {output}: vocab size 280, special ids eos 0, mask 1, pad 2\n" in result.stdout
    assert "  vocab_size = 280\n" in result.stdout and "  mask_token_id = 1\n" in result.stdout
