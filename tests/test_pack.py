"""`dlm pack` on messy corpora: duplicates, a byte-sized validation split, unreadable files, stale
temporaries of killed packs, and a full disk."""

from __future__ import annotations

import errno
import gzip
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dlm.data.dataset import load_packed_dataset
from dlm.data.pack import MASK_FILES, mask_path, pack_corpus
from dlm.data.tokenizer import load_tokenizer

EOS = 0


def documents(data: Path, split: str, tokenizer_path: Path) -> list[str]:
    """The text of every document that ends (with its end-of-document token) inside a split."""

    ids = np.asarray(load_packed_dataset(data, split=split).tokens).reshape(-1)
    ends = np.flatnonzero(ids == EOS)
    starts = np.concatenate([[0], ends + 1])[: ends.size]
    tokenizer = load_tokenizer(tokenizer_path)
    return [tokenizer.decode(ids[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


def metadata(data: Path, split: str) -> dict:
    return json.loads((data / f"{split}.json").read_text())


def words(text: str) -> str:
    """`text` with every run of whitespace (and rich's panel borders) as one space: rich may wrap a
    line at any width."""

    return " ".join(text.replace("│", " ").split())


def play(index: int, lines: int = 40) -> str:
    return "".join(f"LINE {index}.{i}: a speech of some length, with words in it.\n" for i in range(lines))


# ------------------------------------------------------------------------------- duplicates


def test_identical_documents_are_packed_once_and_validation_keeps_its_copy(
    tmp_path: Path, tiny_tokenizer_path: Path, run_cli
) -> None:
    corpus, held_out = tmp_path / "corpus", tmp_path / "held-out"
    (corpus / "copies").mkdir(parents=True)
    held_out.mkdir()
    same, heldout_text = play(1), play(2)
    (corpus / "a.txt").write_text(same)
    (corpus / "copies" / "b.txt").write_text(same)  # a second file, byte for byte
    (corpus / "c.txt.gz").write_bytes(gzip.compress(same.encode()))  # other file bytes, same text
    rows = [same, "row one\n", "row two\n", "row one\n"]  # a file's text, and a row twice
    (corpus / "d.jsonl").write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    (corpus / "e.txt").write_text(heldout_text)  # training text identical to a validation input
    (held_out / "v.txt").write_text(heldout_text)
    output = tmp_path / "data"
    args = ("pack", corpus, "-t", tiny_tokenizer_path, "-l", "2", "-o", output, "--val-input", held_out, "--json")
    result = run_cli(*args)
    assert result.exit_code == 0, result.stderr
    kept = [same, "row one\n", "row two\n"]
    train, val = metadata(output, "train"), metadata(output, "val")
    assert train["documents"] == 3 and train["text_bytes"] == sum(len(text.encode()) for text in kept)
    assert val["documents"] == 1 and val["text_bytes"] == len(heldout_text.encode())
    dropped = {"documents": 5, "text_bytes": 3 * len(same) + len("row one\n") + len(heldout_text)}
    assert train["duplicates_dropped"] == val["duplicates_dropped"] == dropped
    assert json.loads(result.stdout.splitlines()[-1])["duplicates_dropped"] == dropped
    decoded = documents(output, "train", tiny_tokenizer_path)
    assert decoded == kept[: len(decoded)] and len(decoded) >= 2
    held = documents(output, "val", tiny_tokenizer_path)  # its end token may fall in the cut tail
    assert held == [heldout_text][: len(held)]
    # Only the files that still contribute are the split's sources.
    assert [Path(source["path"]).name for source in train["sources"]] == ["a.txt", "d.jsonl"]


def test_a_duplicated_file_never_lands_in_both_splits_of_a_fraction_split(
    tmp_path: Path, tiny_tokenizer_path: Path
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(30):
        (corpus / f"play{index:02d}.txt").write_text(play(index, lines=5))
    for name in ("twin1.txt", "twin2.txt"):  # the same text twice, as copied files are
        (corpus / name).write_text(play(99, lines=5))
    for seed in range(6):
        output = tmp_path / f"data{seed}"
        pack_corpus([corpus], tiny_tokenizer_path, 2, output, val_fraction=0.5, seed=seed)
        train, val = (documents(output, split, tiny_tokenizer_path) for split in ("train", "val"))
        assert not set(train) & set(val), seed
        assert metadata(output, "train")["duplicates_dropped"]["documents"] == 1


# ------------------------------------------------------------------------------- the split


def mixed_directory(directory: Path) -> int:
    """One long text file (40% of the text) and 300 short `.jsonl` documents; the total bytes."""

    directory.mkdir()
    rows = [f"record {i}: a short note of a few words, and a few more words.\n" * 3 for i in range(300)]
    (directory / "notes.jsonl").write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    rows_bytes = sum(len(row.encode()) for row in rows)
    long = play(0, lines=1 + int(rows_bytes * 2 / 3 / len(play(0, lines=1))))
    (directory / "long.txt").write_text(long)
    return rows_bytes + len(long.encode())


@pytest.mark.parametrize("seed", range(4))
def test_val_fraction_is_a_share_of_the_text_bytes(seed: int, tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    total = mixed_directory(tmp_path / "corpus")
    summary = pack_corpus([tmp_path / "corpus"], tiny_tokenizer_path, 8, tmp_path / "data", val_fraction=0.1, seed=seed)
    train, val = metadata(tmp_path / "data", "train"), metadata(tmp_path / "data", "val")
    assert train["text_bytes"] + val["text_bytes"] == total
    byte_share = val["text_bytes"] / total
    assert abs(byte_share - 0.1) < 0.001  # whole documents of ~200 bytes: within half of one
    tokens = {split: meta["num_tokens"] + meta["dropped_tokens"] for split, meta in (("train", train), ("val", val))}
    token_share = tokens["val"] / (tokens["train"] + tokens["val"])
    assert abs(token_share - 0.1) < 0.02
    realised = {"text_bytes": byte_share, "tokens": token_share}
    assert train["val_share"] == val["val_share"] == summary.val_share == pytest.approx(realised, abs=1e-12)
    assert train["val_fraction"] == 0.1 and train["seed"] == seed


def test_the_realised_split_is_reported_and_deterministic(
    tmp_path: Path, tiny_tokenizer_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    mixed_directory(tmp_path / "corpus")
    args = ("pack", tmp_path / "corpus", "-t", tiny_tokenizer_path, "-l", "8", "--val-fraction", "0.1")
    monkeypatch.setattr("dlm.cli.data_cmd.wants_json", lambda flag: False)
    first = run_cli(*args, "-o", tmp_path / "a")
    assert first.exit_code == 0, first.stderr
    share = metadata(tmp_path / "a", "val")["val_share"]
    assert f"validation: {share['text_bytes']:.1%} of the text bytes, {share['tokens']:.1%} of the tokens" in words(
        first.stdout
    )
    assert run_cli(*args, "-o", tmp_path / "b").exit_code == 0
    assert run_cli(*args, "-o", tmp_path / "c", "--seed", "1").exit_code == 0
    for split in ("train", "val"):
        assert (tmp_path / "a" / f"{split}.bin").read_bytes() == (tmp_path / "b" / f"{split}.bin").read_bytes()
    assert (tmp_path / "a" / "val.bin").read_bytes() != (tmp_path / "c" / "val.bin").read_bytes()


def test_help_says_what_the_fraction_counts(run_cli) -> None:
    result = run_cli("pack", "--help")
    assert result.exit_code == 0 and "UTF-8 bytes" in words(result.stdout)


# ------------------------------------------------------------------------------- skipped files


def test_files_dlm_cannot_read_are_counted_and_named(
    tmp_path: Path, tiny_tokenizer_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus = tmp_path / "a-rather-long-directory-name-for-the-corpus" / "with-another-long-level"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "play.txt").write_text(play(1))
    unreadable = ["README", "table.csv", "page.html", "meta.json", "sub/more.csv", "sub/notes.rst", "sub/x.pdf"]
    for name in unreadable:
        (corpus / name).write_text("not corpus text\n")
    (corpus / ".hidden.csv").write_text("hidden files are never corpus text\n")
    output = tmp_path / "data"
    monkeypatch.setattr("dlm.cli.data_cmd.wants_json", lambda flag: False)
    result = run_cli("pack", corpus, "-t", tiny_tokenizer_path, "-l", "8", "-o", output)
    assert result.exit_code == 0, result.stderr
    expected = sorted((corpus / name).resolve() for name in unreadable)
    skipped = metadata(output, "train")["skipped_files"]
    assert skipped == {"count": 7, "examples": [str(path) for path in expected[:5]]}
    named = ", ".join(path.name for path in expected[:5])
    assert f"skipped 7 files dlm cannot read: {named} and 2 more" in words(result.stdout)
    assert named == "README, meta.json, page.html, more.csv, notes.rst"
    run_cli("pack", corpus / "sub", "-t", tiny_tokenizer_path, "-l", "8", "-o", tmp_path / "none").assert_refused(
        "directory holds no", "(only 3 other files, e.g. more.csv)"
    )


# ------------------------------------------------------------------------------- stale temporaries


def test_temporaries_of_killed_packs_are_removed_but_not_a_live_ones(
    tmp_path: Path, tiny_tokenizer_path: Path, run_cli
) -> None:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(finished.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        output = tmp_path / "data"
        output.mkdir()
        stale = [output / f".{name}.tmp-{dead}" for name in ("train.bin", "val.json", "tokenizer.json")]
        kept = [output / f".train.bin.tmp-{live.pid}", output / f".notes.txt.tmp-{dead}", output / ".val.bin.tmp-x"]
        for path in stale + kept:
            path.write_bytes(b"partial")
        (tmp_path / "play.txt").write_text(play(1))
        result = run_cli("pack", tmp_path / "play.txt", "-t", tiny_tokenizer_path, "-l", "8", "-o", output, "--json")
        assert result.exit_code == 0, result.stderr
        assert json.loads(result.stdout.splitlines()[-1])["removed_temporaries"] == sorted(map(str, stale))
        assert not any(path.exists() for path in stale) and all(path.read_bytes() == b"partial" for path in kept)
    finally:
        live.kill()
        live.wait()


# ------------------------------------------------------------------------------- a chat pack's files


def test_a_plain_pack_over_a_chat_pack_removes_its_loss_masks_only(
    tmp_path: Path, tiny_tokenizer_path: Path, run_cli
) -> None:
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"say {i}", "response": f"{i} {i}"}) + "\n" for i in range(20)))
    output = tmp_path / "data"
    assert (
        run_cli(
            "pack", "--chat", chat, "-t", tiny_tokenizer_path, "-l", "32", "-o", output, "--val-fraction", "0.3"
        ).exit_code
        == 0
    )
    mine = [output / "notes.mask.bin", output / "train.mask.bin.bak", output / "mask.bin"]
    for path in mine:
        path.write_bytes(b"the user's own")
    (tmp_path / "play.txt").write_text(play(1))
    args = ("pack", tmp_path / "play.txt", "-t", tiny_tokenizer_path, "-l", "8", "-o", output)
    run_cli(*args).assert_refused("output already holds", "train.mask.bin, val.mask.bin", "--overwrite")
    assert run_cli(*args, "--overwrite").exit_code == 0
    assert sorted(path.name for path in output.iterdir()) == sorted(
        ["tokenizer.json", "train.bin", "train.json", *(path.name for path in mine)]
    )
    assert all(path.read_bytes() == b"the user's own" for path in mine)
    assert "loss_mask" not in metadata(output, "train")
    assert tuple(mask_path(output / f"{name}.bin").name for name in ("train", "val")) == MASK_FILES


# ------------------------------------------------------------------------------- a full disk


def _file_size_limit(limit: int) -> None:
    """In the child: a small file size limit, and writes past it fail with EFBIG (SIGXFSZ ignored)."""

    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def run_limited(limit: int, *args: str | Path) -> subprocess.CompletedProcess[str]:
    script = "import sys\nfrom dlm.cli import main\nmain(sys.argv[1:])\n"
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        preexec_fn=lambda: _file_size_limit(limit),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert all(fragment in lines[0] for fragment in fragments), (fragments, lines[0])


def test_a_full_disk_while_packing_is_one_error_line_and_leaves_nothing(
    tmp_path: Path, tiny_corpus: dict[str, list[Path]], tiny_tokenizer_path: Path
) -> None:
    output = tmp_path / "a-long-directory-name-so-that-the-error-line-is-longer-than-eighty" / "data"
    result = run_limited(16_384, "pack", tiny_corpus["train"][0], "-t", tiny_tokenizer_path, "-l", "64", "-o", output)
    assert_one_error_line(result, "cannot write the packed data: File too large", str(output), "free some disk space")
    assert list(tmp_path.iterdir()) == []  # no output, no temporaries, no directories it created


def test_a_full_disk_while_training_a_tokenizer_is_one_error_line(
    tmp_path: Path, tiny_corpus: dict[str, list[Path]]
) -> None:
    output = tmp_path / "tokenizer.json"
    result = run_limited(2048, "tokenizer", "train", tiny_corpus["train"][0], "-n", "300", "-o", output)
    assert_one_error_line(result, "cannot write the tokenizer: File too large", str(output))
    assert list(tmp_path.iterdir()) == []


def test_no_space_while_committing_keeps_the_previous_pack(
    tmp_path: Path, tiny_corpus: dict[str, list[Path]], tiny_tokenizer_path: Path, run_cli, monkeypatch
) -> None:
    output = tmp_path / "data"
    args = ("pack", tiny_corpus["train"][0], "-t", tiny_tokenizer_path, "-l", "64", "-o", output, "--overwrite")
    assert run_cli(*args).exit_code == 0
    before = {path.name: path.read_bytes() for path in output.iterdir()}

    def no_space(source: str | Path, target: str | Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    monkeypatch.setattr("dlm.data.pack.shutil.copyfile", no_space)
    run_cli(*args[:2], tiny_corpus["train"][1], *args[2:]).assert_refused(
        str(output), "cannot write the packed data: No space left on device"
    )
    assert {path.name: path.read_bytes() for path in output.iterdir()} == before
