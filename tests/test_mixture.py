"""Weighted sources (`dlm pack --source PATH:WEIGHT`): repeats, seeded samples, metadata, refusals."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dlm.data.dataset import load_packed_dataset
from dlm.data.mixture import WeightedSource, parse_source
from dlm.data.pack import pack_corpus
from dlm.data.tokenizer import load_tokenizer
from dlm.errors import UserError

EOS = 0


def corpus(root: Path) -> dict[str, list[str]]:
    """Three sources of distinct documents: a directory of .txt files, a .jsonl file, one .txt file."""

    docs = {
        "books": [f"Book {i}: a chapter of prose number {i}.\n" for i in range(4)],
        "web": [f"web page {i} with some text {i * 7}" for i in range(10)],
        "single": ["The one positional document.\n"],
    }
    (root / "books").mkdir(parents=True)
    for index, text in enumerate(docs["books"]):
        (root / "books" / f"b{index}.txt").write_text(text)
    (root / "web.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in docs["web"]))
    (root / "single.txt").write_text(docs["single"][0])
    return docs


def stream(tokenizer_path: Path, documents: list[str]) -> np.ndarray:
    """The tokens `dlm pack` writes for `documents` in this order, before the cut to whole blocks."""

    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.encode_special_tokens = True
    ids: list[int] = []
    for document in documents:
        ids += [*tokenizer.encode(document, add_special_tokens=False).ids, EOS]
    return np.array(ids)


def packed(directory: Path, split: str = "train") -> tuple[np.ndarray, dict]:
    dataset = load_packed_dataset(directory / f"{split}.bin")
    return np.asarray(dataset.tokens).reshape(-1), json.loads((directory / f"{split}.json").read_text())


def pack_mixture(root: Path, tokenizer: Path, output: Path, seed: int = 0, **kwargs) -> None:
    sources = [WeightedSource(str(root / "books"), 2.0), WeightedSource(str(root / "web.jsonl"), 0.5)]
    pack_corpus([root / "single.txt"], tokenizer, 2, output, seed=seed, sources=sources, **kwargs)


def test_weights_repeat_and_sample_documents_in_whole_passes(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    docs = corpus(tmp_path / "in")
    pack_mixture(tmp_path / "in", tiny_tokenizer_path, tmp_path / "out")
    tokens, meta = packed(tmp_path / "out")
    taken = [entry["documents_taken"] for entry in meta["mixture"]]
    assert [(e["input"], e["weight"], e["files"], e["documents"]) for e in meta["mixture"]] == [
        (str(tmp_path / "in" / "single.txt"), 1.0, 1, 1),
        (str(tmp_path / "in" / "books"), 2.0, 4, 4),
        (str(tmp_path / "in" / "web.jsonl"), 0.5, 1, 10),
    ]
    assert taken == [1, 8, 5] and meta["documents"] == sum(taken)
    assert sum(entry["tokens"] for entry in meta["mixture"]) == meta["num_tokens"] + meta["dropped_tokens"]
    # Which half of the web pages: read back from the tokens, then the whole stream is checked exactly.
    text = load_tokenizer(tiny_tokenizer_path).decode(tokens.tolist(), skip_special_tokens=False)
    web = [page for page in docs["web"] if page in text.split("<|endoftext|>")]
    assert len(web) == 5
    # Copies are whole passes over a source: all the books, then all of them again.
    expected = stream(tiny_tokenizer_path, docs["single"] + docs["books"] * 2 + web)
    assert np.array_equal(tokens, expected[: tokens.size]) and tokens.size == meta["num_tokens"]
    books = stream(tiny_tokenizer_path, docs["books"]).size
    assert meta["mixture"][1]["tokens"] == 2 * books


def test_the_seed_decides_the_sampled_documents(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    corpus(tmp_path / "in")
    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        pack_mixture(tmp_path / "in", tiny_tokenizer_path, tmp_path / name, seed=seed)
        runs[name] = (tmp_path / name / "train.bin").read_bytes()
    assert runs["a"] == runs["b"] and runs["a"] != runs["c"]


def test_a_fractional_weight_above_one_adds_a_seeded_share_of_second_copies(
    tmp_path: Path, tiny_tokenizer_path: Path
) -> None:
    docs = corpus(tmp_path / "in")
    source = parse_source(f"{tmp_path / 'in' / 'web.jsonl'}:1.5")
    pack_corpus([], tiny_tokenizer_path, 2, tmp_path / "out", sources=[source])
    tokens, meta = packed(tmp_path / "out")
    text = load_tokenizer(tiny_tokenizer_path).decode(tokens.tolist(), skip_special_tokens=False)
    counts = Counter(text.split("<|endoftext|>"))
    assert sorted(counts[page] for page in docs["web"]) == [1] * 5 + [2] * 5
    assert meta["mixture"][0]["documents_taken"] == 15


def test_validation_comes_first_and_is_never_repeated(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    corpus(tmp_path / "in")
    source = WeightedSource(str(tmp_path / "in" / "web.jsonl"), 3.0)
    pack_corpus([], tiny_tokenizer_path, 2, tmp_path / "out", val_fraction=0.3, seed=2, sources=[source])
    tokenizer = load_tokenizer(tiny_tokenizer_path)
    documents = {}
    for split in ("train", "val"):
        tokens, meta = packed(tmp_path / "out", split)
        documents[split] = Counter(tokenizer.decode(tokens.tolist(), skip_special_tokens=False).split("<|endoftext|>"))
        documents[split].pop("", None)  # after the last end-of-document token
    _, meta = packed(tmp_path / "out")
    train_pages = meta["mixture"][0]["documents"]
    assert train_pages == len(documents["train"]) == 10 - len(documents["val"]) and 0 < train_pages < 10
    assert set(documents["train"]).isdisjoint(documents["val"])
    assert set(documents["val"].values()) == {1} and set(documents["train"].values()) == {3}
    assert meta["mixture"][0]["documents_taken"] == 3 * train_pages


def test_without_sources_the_mixture_is_not_recorded(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    corpus(tmp_path / "in")
    summary = pack_corpus([tmp_path / "in"], tiny_tokenizer_path, 2, tmp_path / "out")
    assert summary.mixture is None and packed(tmp_path / "out")[1]["mixture"] is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("web.jsonl", "has no weight"),
        ("web.jsonl:two", "the weight 'two' is not a number"),
        ("web.jsonl:0", "must be a positive number"),
        ("web.jsonl:-1", "must be a positive number"),
        ("web.jsonl:nan", "must be a positive number"),
        ("web.jsonl:inf", "must be a positive number"),
        ("web.jsonl:1000.5", "the weight is over 1,000"),
        ("web.jsonl:1e30", "the weight is over 1,000"),  # once: a uint32 overflow in apply_weights
        ("web.jsonl:1e308", "the weight is over 1,000"),  # once: range(1e308) passes in read_order
    ],
)
def test_bad_source_specifications_are_refused(text: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        parse_source(text)


def test_the_largest_weight_packs(tmp_path: Path, tiny_tokenizer_path: Path, run_cli) -> None:
    assert parse_source("a:b.txt:1000") == WeightedSource("a:b.txt", 1000.0)
    (tmp_path / "one.txt").write_text("a short document")
    args = ("pack", "-t", tiny_tokenizer_path, "-l", "64", "-o", tmp_path / "out", "--source")
    run_cli(*args, f"{tmp_path / 'one.txt'}:1e30").assert_refused("the weight is over 1,000", "smaller ones")
    assert not (tmp_path / "out").exists()
    result = run_cli(*args, f"{tmp_path / 'one.txt'}:1000", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["mixture"][0]["documents_taken"] == 1000


def test_cli_sources_metadata_notes_and_refusals(tmp_path: Path, tiny_tokenizer_path: Path, run_cli) -> None:
    corpus(tmp_path / "in")
    books, web = tmp_path / "in" / "books", tmp_path / "in" / "web.jsonl"
    args = ("pack", "-t", tiny_tokenizer_path, "-l", "2", "-o", tmp_path / "out")
    result = run_cli(*args, "--source", f"{books}:2", "--source", f"{web}:0.5", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    assert [entry["documents_taken"] for entry in summary["mixture"]] == [8, 5]
    assert json.loads((tmp_path / "out" / "train.json").read_text())["mixture"] == summary["mixture"]
    run_cli(*args, "--source", f"{web}:x").assert_refused("the weight 'x' is not a number", "--source PATH:WEIGHT")
    run_cli(*args, "--source", f"{books}:2", "--source", f"{books / 'b0.txt'}:3").assert_refused(
        str(books / "b0.txt"), "is in two sources with different weights"
    )
    run_cli(*args).assert_refused("no inputs given")
    help_text = run_cli("pack", "--help").stdout
    assert "PATH:WEIGHT" in help_text and "seeded half" in help_text


def test_cli_human_output_lists_each_source(
    tmp_path: Path, tiny_tokenizer_path: Path, run_cli, monkeypatch, narrow_console
) -> None:
    corpus(tmp_path / "in")
    monkeypatch.setattr("dlm.cli.data_cmd.wants_json", lambda flag: False)
    web = tmp_path / "in" / "web.jsonl"
    result = run_cli("pack", "-t", tiny_tokenizer_path, "-l", "2", "-o", tmp_path / "out", "--source", f"{web}:0.5")
    assert result.exit_code == 0, result.stderr
    assert "x0.5: 5 documents of 10 distinct" in result.stdout.replace("\n", " ")
