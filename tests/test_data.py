"""Packing, the memory-mapped dataset and the batch sampler, and every bad input of `dlm pack`."""

from __future__ import annotations

import gzip
import hashlib
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from dlm.data.corpus import discover_inputs
from dlm.data.dataset import DeterministicBatchSampler, PackedDataset, load_packed_dataset
from dlm.data.pack import pack_corpus
from dlm.data.tokenizer import load_tokenizer
from dlm.errors import UserError, UserNote

EOS = 0


def decode_documents(tokenizer: Tokenizer, ids: np.ndarray) -> list[str]:
    """The text of every document that ends (with the end-of-document token) inside `ids`."""

    ends = np.flatnonzero(ids == EOS)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[s:e].tolist(), skip_special_tokens=False) for s, e in zip(starts, ends, strict=True)]


def all_tokens(path: Path) -> np.ndarray:
    dataset = load_packed_dataset(path)
    return np.asarray(dataset.tokens).reshape(-1)


def awkward_corpus(directory: Path) -> tuple[list[Path], list[str]]:
    """Files of every supported kind, and the documents they hold in packing order."""

    directory.mkdir(parents=True, exist_ok=True)
    line = "  Enter KING,  with é, 日本語 and 🙂; tabs\tand trailing spaces   \n"
    big = "".join(f"{i:05d}{line}" if i % 7 else "\n\r\n" for i in range(2000))  # ~150 KB: many pieces
    texts = {"big.txt": big, "notes.md": "# Title\n\n*emphasis* <|mask|> <|endoftext|>\n", "tail.txt": "no newline"}
    for name, text in texts.items():
        (directory / name).write_text(text, encoding="utf-8", newline="")
    with gzip.open(directory / "zipped.txt.gz", "wt", encoding="utf-8", newline="") as handle:
        handle.write("compressed text\r\nsecond line\n")
    records = [f"record {i}: ünïcödé\nwith a line break" for i in range(20)]
    with (directory / "records.jsonl").open("w", encoding="utf-8") as handle:
        for index, record in enumerate(records):
            handle.write(json.dumps({"text": record, "id": index}) + "\n" + ("\n" if index == 3 else ""))
    files = [directory / n for n in ("big.txt", "notes.md", "zipped.txt.gz", "records.jsonl", "tail.txt")]
    documents = [big, texts["notes.md"], "compressed text\r\nsecond line\n", *records, "no newline"]
    return files, documents


def test_round_trip_is_lossless_and_matches_whole_document_encoding(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    files, documents = awkward_corpus(tmp_path / "corpus")
    summary = pack_corpus(files, tiny_tokenizer_path, 16, tmp_path / "data")
    tokenizer = load_tokenizer(tmp_path / "data" / "tokenizer.json")
    tokens = all_tokens(tmp_path / "data" / "train.bin")
    decoded = decode_documents(tokenizer, tokens)
    assert len(decoded) >= len(documents) - 1 and decoded == documents[: len(decoded)]
    # Piece-wise encoding equals encoding each whole document; special-token text stays text.
    tokenizer.encode_special_tokens = True
    expected = np.concatenate([np.array([*tokenizer.encode(doc).ids, EOS]) for doc in documents])
    split = summary.splits["train"]
    assert split.num_tokens + split.dropped_tokens == expected.size and split.dropped_tokens < 16
    assert np.array_equal(tokens, expected[: split.num_tokens])
    assert 1 not in tokens  # "<|mask|>" in the text never becomes the mask token
    assert split.documents == len(documents)
    assert split.text_bytes == sum(len(doc.encode()) for doc in documents)


def test_bundled_plays_round_trip_with_complete_metadata(
    tiny_corpus: dict[str, list[Path]], tiny_data_dir: Path, tiny_tokenizer_path: Path
) -> None:
    tokenizer = load_tokenizer(tiny_data_dir / "tokenizer.json")
    plays = [gzip.decompress(path.read_bytes()).decode() for path in tiny_corpus["train"]]
    decoded = decode_documents(tokenizer, all_tokens(tiny_data_dir / "train.bin"))
    assert len(decoded) >= len(plays) - 1 and decoded == plays[: len(decoded)]
    meta = json.loads((tiny_data_dir / "train.json").read_text())
    assert meta["format"] == "dlm-packed-v1" and meta["dtype"] == "uint16" and meta["vocab_size"] == 512
    assert meta["seq_len"] == 64 and meta["num_tokens"] == meta["num_blocks"] * 64
    assert (tiny_data_dir / "train.bin").stat().st_size == meta["num_tokens"] * 2
    assert meta["documents"] == len(plays) and meta["text_bytes"] == sum(len(p.encode()) for p in plays)
    sha = hashlib.sha256(tiny_tokenizer_path.read_bytes()).hexdigest()
    assert (
        meta["tokenizer_sha256"] == sha == hashlib.sha256((tiny_data_dir / "tokenizer.json").read_bytes()).hexdigest()
    )
    sources = [(s["path"], s["bytes"], s["sha256"]) for s in meta["sources"]]
    assert sources == [
        (str(p), p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in tiny_corpus["train"]
    ]
    val = json.loads((tiny_data_dir / "val.json").read_text())
    assert [s["path"] for s in val["sources"]] == [str(p) for p in tiny_corpus["val"]]
    hamlet = gzip.decompress(tiny_corpus["val"][0].read_bytes()).decode()
    held_out = tokenizer.decode(all_tokens(tiny_data_dir / "val.bin").tolist())
    assert hamlet.startswith(held_out[:-1]) and len(held_out) > 0.9 * len(hamlet)


def test_fraction_split_is_deterministic_and_keeps_documents_whole(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    corpus = tmp_path / "docs.jsonl"
    documents = [f"document number {i}: some words of text." for i in range(60)]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    tokenizer = load_tokenizer(tiny_tokenizer_path)

    def split(seed: int, name: str) -> tuple[bytes, bytes, set[str], set[str]]:
        out = tmp_path / name
        pack_corpus([corpus], tiny_tokenizer_path, 4, out, val_fraction=0.5, seed=seed)
        train, val = (out / "train.bin").read_bytes(), (out / "val.bin").read_bytes()
        return train, val, *(set(decode_documents(tokenizer, all_tokens(out / f))) for f in ("train.bin", "val.bin"))

    first, again, other = split(7, "a"), split(7, "b"), split(8, "c")
    assert first[:2] == again[:2]
    train_docs, val_docs = first[2], first[3]
    assert not train_docs & val_docs and len(train_docs | val_docs) >= len(documents) - 2
    assert train_docs | val_docs <= set(documents) and 10 < len(val_docs) < 50
    assert other[3] != val_docs


def test_sampler_resume_jump_equals_replay() -> None:
    sampler = DeterministicBatchSampler(num_blocks=23, batch_size=4, seed=5)
    replay = [batch for batch, _ in zip(sampler, range(40), strict=False)]
    for start in (0, 3, 5, 6, 17):
        jumped = DeterministicBatchSampler(23, 4, seed=5, start_batch=start)
        assert [b for b, _ in zip(jumped, range(12), strict=False)] == replay[start : start + 12]
    late = DeterministicBatchSampler(23, 4, seed=5)
    late.start_batch = 11  # what the training loop sets on resume
    assert next(iter(late)) == replay[11]


def test_sampler_epochs_are_fresh_permutations_dropping_the_partial_batch() -> None:
    sampler = DeterministicBatchSampler(num_blocks=23, batch_size=4, seed=5)
    batches = [batch for batch, _ in zip(sampler, range(15), strict=False)]  # 5 batches per epoch
    epochs = [[block for batch in batches[i : i + 5] for block in batch] for i in (0, 5, 10)]
    assert all(len(set(epoch)) == 20 and set(epoch) <= set(range(23)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    other_seed = DeterministicBatchSampler(23, 4, seed=6)
    assert next(iter(other_seed)) != batches[0]


def test_sampler_shards_are_disjoint_and_cover_the_single_process_order() -> None:
    single = [b for b, _ in zip(DeterministicBatchSampler(40, 3, seed=1), range(36), strict=False)]
    world = 3
    shards = [
        [b for b, _ in zip(DeterministicBatchSampler(40, 3, seed=1, rank=r, world_size=world), range(12), strict=False)]
        for r in range(world)
    ]
    assert [shards[g % world][g // world] for g in range(36)] == single
    first_epoch = [block for shard in shards for batch in shard[:4] for block in batch]  # 13 per epoch
    assert len(first_epoch) == len(set(first_epoch))
    resumed = DeterministicBatchSampler(40, 3, seed=1, start_batch=5, rank=2, world_size=world)
    assert next(iter(resumed)) == single[5 * world + 2]


def test_sampler_refuses_a_dataset_smaller_than_one_batch() -> None:
    with pytest.raises(UserError, match="fewer than one batch"):
        DeterministicBatchSampler(num_blocks=3, batch_size=4, seed=0)
    with pytest.raises(ValueError):
        DeterministicBatchSampler(10, 2, seed=0, rank=2, world_size=2)


def test_dataset_items_pickling_and_dataloader_workers(tiny_data_dir: Path) -> None:
    dataset = load_packed_dataset(tiny_data_dir, 64, split="val")
    assert isinstance(dataset, PackedDataset) and dataset.metadata["split"] == "val"
    item = dataset[3]
    assert item.dtype == torch.int64 and item.shape == (64,)
    assert torch.equal(item, torch.from_numpy(np.fromfile(dataset.path, np.uint16)[192:256].astype(np.int64)))
    blob = pickle.dumps(dataset)
    assert len(blob) < 4096 and pickle.loads(blob)._tokens is None
    with pytest.raises(IndexError):
        dataset[len(dataset)]
    sampler = DeterministicBatchSampler(len(dataset), 8, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    for batch, indices, _ in zip(loader, sampler, range(4), strict=False):
        assert torch.equal(batch, torch.stack([dataset[i] for i in indices]))


def test_large_vocabularies_pack_as_uint32(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    big = Tokenizer.from_file(str(tiny_tokenizer_path))
    big.add_tokens([f"<|extra{i}|>" for i in range(65_600)])
    big.save(str(tmp_path / "big.json"))
    text = "A word <|extra65500|> beyond uint16, and more words.\n"
    (tmp_path / "doc.txt").write_text(text * 20)
    summary = pack_corpus([tmp_path / "doc.txt"], tmp_path / "big.json", 8, tmp_path / "data")
    meta = json.loads((tmp_path / "data" / "train.json").read_text())
    assert summary.dtype == meta["dtype"] == "uint32" and meta["vocab_size"] == 65_600 + 512
    assert (tmp_path / "data" / "train.bin").stat().st_size == 4 * meta["num_tokens"]
    tokens = all_tokens(tmp_path / "data" / "train.bin")
    assert tokens.dtype == np.uint32 and tokens.max() == 512 + 65_500 == big.token_to_id("<|extra65500|>")
    assert (text * 20).startswith(big.decode(tokens.tolist())[:-1])


def test_truncated_file_and_wrong_seq_len_are_refused(tmp_path: Path, tiny_data_dir: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    with pytest.raises(UserError, match="packed with seq_len 64, but the model uses 128") as caught:
        load_packed_dataset(data / "train.bin", 128)
    assert str(data / "train.bin") in str(caught.value)
    with (data / "train.bin").open("r+b") as handle:
        handle.truncate((data / "train.bin").stat().st_size - 2)
    with pytest.raises(UserError, match="truncated") as caught:
        load_packed_dataset(data / "train.bin", 64)
    assert str(data / "train.bin") in str(caught.value)
    (data / "val.json").unlink()
    with pytest.raises(UserError, match=r"metadata file val\.json is missing"):
        load_packed_dataset(data, 64, split="val")


def test_a_pack_made_with_the_removed_mask_padding_option_loads_with_a_warning(
    tmp_path: Path, tiny_tokenizer_path: Path
) -> None:
    from dlm.data.chat_pack import pack_chat

    lines = [json.dumps({"prompt": f"q{i}", "response": "a"}) + "\n" for i in range(4)]
    (tmp_path / "c.jsonl").write_text("".join(lines))
    pack_chat([tmp_path / "c.jsonl"], tiny_tokenizer_path, 32, tmp_path / "out")
    metadata = json.loads((tmp_path / "out" / "train.json").read_text())
    metadata["chat"]["mask_padding"] = True  # what such a pack recorded
    (tmp_path / "out" / "train.json").write_text(json.dumps(metadata))
    with pytest.warns(UserNote, match="packed with --mask-padding, which dlm no longer offers.*re-pack without it"):
        assert len(load_packed_dataset(tmp_path / "out")) == 4


def test_interrupted_pack_leaves_nothing_that_loads(
    tiny_corpus: dict[str, list[Path]], tmp_path: Path, tiny_tokenizer_path: Path
) -> None:
    def interrupt(done: int, total: int, tokens: int) -> None:
        raise KeyboardInterrupt

    output = tmp_path / "new" / "data"
    with pytest.raises(KeyboardInterrupt):
        pack_corpus(tiny_corpus["train"][:1], tiny_tokenizer_path, 64, output, progress=interrupt)
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "existing"
    pack_corpus(tiny_corpus["train"][:1], tiny_tokenizer_path, 64, existing)
    before = {p.name: p.read_bytes() for p in existing.iterdir()}
    with pytest.raises(KeyboardInterrupt):
        pack_corpus(tiny_corpus["train"][1:2], tiny_tokenizer_path, 64, existing, overwrite=True, progress=interrupt)
    assert {p.name: p.read_bytes() for p in existing.iterdir()} == before  # old data intact, no temp files


def test_overwrite_and_packing_beside_the_tokenizer(
    tiny_corpus: dict[str, list[Path]], tmp_path: Path, tiny_tokenizer_path: Path, run_cli
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    shutil.copyfile(tiny_tokenizer_path, data / "tokenizer.json")
    args = ("pack", tiny_corpus["train"][0], "-t", data / "tokenizer.json", "-l", "64", "-o", data)
    assert run_cli(*args).exit_code == 0  # the tokenizer itself is not an existing output
    first = (data / "train.bin").read_bytes()
    run_cli(*args).assert_refused("already holds train.bin, train.json", str(data))
    assert (data / "train.bin").read_bytes() == first
    result = run_cli(*args[:2], tiny_corpus["train"][1], *args[2:], "--overwrite", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout.splitlines()[-1])["splits"]["train"]["documents"] == 2
    assert (data / "train.bin").read_bytes() != first


def test_discovery_of_directories_globs_and_kinds(tmp_path: Path) -> None:
    files, _ = awkward_corpus(tmp_path / "corpus")
    (tmp_path / "corpus" / "skip.csv").write_text("a,b\n")
    found = discover_inputs([tmp_path / "corpus"])
    assert found == sorted(p.resolve() for p in files)
    globbed = discover_inputs([str(tmp_path / "corpus" / "*.txt"), files[0]])
    assert globbed == [files[0].resolve(), files[4].resolve()]
    with pytest.raises(UserError, match="unsupported file type"):
        discover_inputs([tmp_path / "corpus" / "skip.csv"])


def test_replace_mode_counts_invalid_bytes(tmp_path: Path, tiny_tokenizer_path: Path, run_cli) -> None:
    (tmp_path / "bad.txt").write_bytes(b"valid start " * 20 + b"\xff\xfe bad \xc3 end \xef\xbf\xbd kept\n")
    args = ("pack", tmp_path / "bad.txt", "-t", tiny_tokenizer_path, "-l", "8", "-o", tmp_path / "data")
    run_cli(*args).assert_refused(str(tmp_path / "bad.txt"), "invalid UTF-8 at byte 240")
    result = run_cli(*args, "--errors", "replace")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["replaced_characters"] == 3
    text = load_tokenizer(tiny_tokenizer_path).decode(all_tokens(tmp_path / "data" / "train.bin").tolist())
    assert "\ufffd\ufffd bad \ufffd end \ufffd" in text


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def case_inputs(case: str, d: Path) -> tuple[list[Path], list[str | Path], list[str]]:
    """(inputs, extra arguments, fragments the error line must contain) of one bad input."""

    if case == "missing path":
        return [d / "absent.txt"], [], ["input not found", str(d / "absent.txt")]
    if case == "no text files":
        return [write(d / "dir" / "x.csv", "a,b").parent], [], ["holds no", str(d / "dir")]
    if case == "empty corpus":
        return [write(d / "empty.txt", "")], [], ["corpus is empty", "empty.txt"]
    if case == "smaller than a block":
        return [write(d / "a.txt", "tiny")], ["-l", "4096"], ["train split has", "fewer than one block of 4096"]
    if case == "not UTF-8":
        return [write(d / "b.txt", b"ok\n\x80")], [], [str(d / "b.txt"), "invalid UTF-8 at byte 3"]
    if case == "jsonl not JSON":
        return [write(d / "c.jsonl", '{"text": "a"}\n{oops\n')], [], ["c.jsonl", "line 2 is not valid JSON"]
    if case == "jsonl lacks field":
        return [write(d / "d.jsonl", '{"body": "a"}\n')], [], ["d.jsonl", "line 1 has no string field 'text'"]
    if case == "seq_len below 2":
        return [write(d / "e.txt", "text")], ["-l", "1"], ["seq_len must be at least 2"]
    if case == "val fraction out of range":
        return [write(d / "f.txt", "text")], ["--val-fraction", "1.5"], ["val_fraction must be in [0, 1)"]
    assert case == "unwritable output"
    blocker = write(d / "file", "x")
    return [write(d / "g.txt", "text")], ["-o", blocker / "out"], [str(blocker), "not a directory"]


BAD_INPUTS = [
    "missing path",
    "no text files",
    "empty corpus",
    "smaller than a block",
    "not UTF-8",
    "jsonl not JSON",
    "jsonl lacks field",
    "seq_len below 2",
    "val fraction out of range",
    "unwritable output",
]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_pack_inputs_exit_2_and_write_nothing(
    case: str, tmp_path: Path, tiny_tokenizer_path: Path, run_cli
) -> None:
    inputs, extra, fragments = case_inputs(case, tmp_path / "in")
    before = sorted(tmp_path.rglob("*"))
    result = run_cli("pack", *inputs, "-t", tiny_tokenizer_path, "-l", "64", "-o", tmp_path / "out", *extra)
    result.assert_refused(*fragments)
    assert sorted(tmp_path.rglob("*")) == before  # no output directory, no temporary file


def test_cli_human_output_summarises_each_split(
    tiny_corpus: dict[str, list[Path]], tmp_path: Path, tiny_tokenizer_path: Path, run_cli, monkeypatch, narrow_console
) -> None:
    monkeypatch.setattr("dlm.cli.data_cmd.wants_json", lambda flag: False)
    args = ("pack", tiny_corpus["train"][0], "-t", tiny_tokenizer_path, "-l", "64", "-o", tmp_path / "data")
    # One document cannot fill both splits of a fraction split: refused, and nothing is written.
    run_cli(*args, "--val-fraction", "0.5").assert_refused("split has 0 tokens, fewer than one block of 64")
    assert not (tmp_path / "data").exists()
    result = run_cli(*args, "--val-input", tiny_corpus["val"][0])
    assert result.exit_code == 0, result.stderr
    meta = json.loads((tmp_path / "data" / "train.json").read_text())
    assert f"{meta['num_blocks']:,}" in result.stdout and "uint16 tokens, vocab 512" in result.stdout


def test_pack_process_never_imports_torch(
    tmp_path: Path, tiny_corpus: dict[str, list[Path]], tiny_tokenizer_path: Path
) -> None:
    # A torch import costs seconds; the packing speed bar counts the whole CLI process.
    script = (
        "import sys\nfrom dlm.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n"
        "    assert not exc.code, exc.code\nprint('torch' in sys.modules)\n"
    )
    args = ["pack", str(tiny_corpus["train"][0]), "-t", str(tiny_tokenizer_path), "-l", "64", "-o", str(tmp_path / "d")]
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False" and (tmp_path / "d" / "train.json").is_file()


def test_corrupt_gzip_is_a_user_error(tmp_path: Path, tiny_tokenizer_path: Path, run_cli) -> None:
    (tmp_path / "broken.txt.gz").write_bytes(gzip.compress(b"some text\n" * 100)[:-20])
    result = run_cli("pack", tmp_path / "broken.txt.gz", "-t", tiny_tokenizer_path, "-l", "8", "-o", tmp_path / "out")
    result.assert_refused(str(tmp_path / "broken.txt.gz"), "cannot read file")
    assert not (tmp_path / "out").exists()
