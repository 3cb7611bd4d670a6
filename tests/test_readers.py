"""Corpus formats beyond text and jsonl: Parquet, zstd and saved Hugging Face datasets.

Each packs to exactly the tokens of the same documents given as `.txt` files; bad rows and missing
fields are named with the file and the row; memory stays flat in the size of a Parquet file; and a
missing optional package is one error line naming the extra that installs it.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlm.data import readers
from dlm.data.corpus import CorpusReader, discover_inputs
from dlm.data.readers import Chunk, Format, ReadContext
from dlm.data.tokenizer import train_tokenizer

# Documents with what a reader could get wrong: line endings, no final newline, U+FFFD already in the
# text, a special token's spelling, non-ASCII, and one longer than a text piece (64 KB).
DOCUMENTS = [
    "First document.\nSecond line, no newline at the end",
    "Windows\r\nline endings\r\n\r\n",
    "Unicode: é, 日本語, 🙂 and a replacement character \ufffd kept as is\n",
    "<|endoftext|> and <|mask|> are text here\n",
    "".join(f"{i:05d} a longer line of text that repeats with its number\n" for i in range(2000)),
    "\n\n  leading blank lines and trailing spaces   ",
]


def write_texts(directory: Path, documents: list[str]) -> list[Path]:
    """One `.txt` per document, named so that sorting keeps the order."""

    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"doc{index:03d}.txt" for index in range(len(documents))]
    for path, document in zip(paths, documents, strict=True):
        path.write_bytes(document.encode("utf-8"))
    return paths


def write_parquet(path: Path, documents: list[str | None], rows_per_group: int = 2, **columns: list) -> Path:
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    parquet.write_table(pyarrow.table({"text": documents, **columns}), path, row_group_size=rows_per_group)
    return path


def zstd_frames(data: bytes, frames: int = 1) -> bytes:
    """`data` as zstd, cut into `frames` frames: a reader must read across frame boundaries."""

    zstandard = pytest.importorskip("zstandard")
    step = -(-len(data) // frames)
    return b"".join(zstandard.ZstdCompressor().compress(data[i : i + step]) for i in range(0, len(data), step))


def save_dataset(path: Path, documents: list[str | None], shards: int = 1) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": documents, "id": list(range(len(documents)))}).save_to_disk(
        str(path), num_shards=shards
    )
    return path


def pack(run_cli, tokenizer: Path, output: Path, *inputs: str | Path, extra: tuple[str, ...] = ()) -> dict:
    result = run_cli("pack", *inputs, "-t", tokenizer, "-l", "8", "-o", output, "--json", *extra)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def format_inputs(kind: str, directory: Path) -> list[Path]:
    """The `DOCUMENTS` in one format, in the same order."""

    directory.mkdir(parents=True)
    if kind == "parquet":
        return [write_parquet(directory / "docs.parquet", DOCUMENTS, extra_column=list(range(len(DOCUMENTS))))]
    if kind == "jsonl.zst":
        lines = "".join(json.dumps({"text": document}) + "\n" for document in DOCUMENTS).encode()
        (directory / "docs.jsonl.zst").write_bytes(zstd_frames(lines, frames=3))
        return [directory / "docs.jsonl.zst"]
    if kind == "txt.zst":
        paths = [directory / f"doc{index:03d}.txt.zst" for index in range(len(DOCUMENTS))]
        for path, document in zip(paths, DOCUMENTS, strict=True):
            path.write_bytes(zstd_frames(document.encode(), frames=2 if len(document) > 1000 else 1))
        return [directory]  # a directory of them: discovery finds and sorts .txt.zst files
    assert kind == "saved dataset"
    return [save_dataset(directory / "saved", DOCUMENTS, shards=2)]


@pytest.mark.data_extras
@pytest.mark.parametrize("kind", ["parquet", "jsonl.zst", "txt.zst", "saved dataset"])
def test_each_format_packs_exactly_the_tokens_of_the_same_text(
    kind: str, tmp_path: Path, tiny_tokenizer_path: Path, run_cli
) -> None:
    inputs = format_inputs(kind, tmp_path / kind)
    expected = pack(run_cli, tiny_tokenizer_path, tmp_path / "from-txt", *write_texts(tmp_path / "txt", DOCUMENTS))
    got = pack(run_cli, tiny_tokenizer_path, tmp_path / "out", *inputs)
    assert (tmp_path / "out" / "train.bin").read_bytes() == (tmp_path / "from-txt" / "train.bin").read_bytes()
    for key in ("documents", "text_bytes", "num_tokens", "dropped_tokens"):
        assert got["splits"]["train"][key] == expected["splits"]["train"][key], key
    sources = json.loads((tmp_path / "out" / "train.json").read_text())["sources"]
    assert [Path(s["path"]).name for s in sources] == [Path(p).name for p in discover_inputs(inputs)]
    assert all(s["bytes"] > 0 and len(s["sha256"]) == 64 for s in sources)


@pytest.mark.data_extras
def test_source_hashes_are_of_the_bytes_on_disk(tmp_path: Path) -> None:
    import hashlib

    parquet = write_parquet(tmp_path / "a.parquet", DOCUMENTS)
    saved = save_dataset(tmp_path / "saved", DOCUMENTS, shards=2)
    reader = CorpusReader([parquet, saved])
    assert sum(piece.last for piece in reader.pieces()) == 2 * len(DOCUMENTS) == reader.documents
    arrow_files = [saved / "data-00000-of-00002.arrow", saved / "data-00001-of-00002.arrow"]
    expected = [
        (str(parquet), parquet.stat().st_size, hashlib.sha256(parquet.read_bytes()).hexdigest()),
        (
            str(saved),
            sum(f.stat().st_size for f in arrow_files),
            hashlib.sha256(b"".join(f.read_bytes() for f in arrow_files)).hexdigest(),
        ),
    ]
    assert [(s.path, s.bytes, s.sha256) for s in reader.sources] == expected
    assert reader.bytes_read == reader.total_bytes == sum(size for _, size, _ in expected)


@pytest.mark.data_extras
def test_a_tokenizer_trained_on_parquet_equals_one_trained_on_the_text(tmp_path: Path) -> None:
    parquet = write_parquet(tmp_path / "docs.parquet", DOCUMENTS)
    texts = write_texts(tmp_path / "txt", DOCUMENTS)
    train_tokenizer([parquet], 300, tmp_path / "from-parquet.json")
    train_tokenizer(texts, 300, tmp_path / "from-txt.json")
    assert (tmp_path / "from-parquet.json").read_bytes() == (tmp_path / "from-txt.json").read_bytes()


@pytest.mark.data_extras
def test_text_field_and_directories_holding_every_format(tmp_path: Path, tiny_tokenizer_path: Path, run_cli) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_parquet(corpus / "a.parquet", ["ignored"] * 2, body=["from parquet\n", "second row\n"])
    (corpus / "b.jsonl.zst").write_bytes(zstd_frames(b'{"body": "from zstd jsonl\\n"}\n'))
    save_dataset(corpus / "c-saved", ["ignored"])  # no `body` column: named with its columns
    (corpus / "notes.csv").write_text("skipped\n")
    result = run_cli("pack", corpus, "-t", tiny_tokenizer_path, "-l", "4", "-o", tmp_path / "o", "--text-field", "body")
    result.assert_refused(str(corpus / "c-saved"), "has no column 'body' (its columns: text, id)", "--text-field")
    (corpus / "c-saved" / "state.json").rename(corpus / "c-saved" / "moved.json")  # now a plain directory
    found = discover_inputs([corpus])
    assert [p.name for p in found] == ["a.parquet", "b.jsonl.zst"]
    summary = pack(run_cli, tiny_tokenizer_path, tmp_path / "o", corpus, extra=("--text-field", "body"))
    assert summary["splits"]["train"]["documents"] == 3
    assert summary["skipped_files"]["count"] == 4  # notes.csv and the three files of the former dataset


def bad_input(case: str, d: Path) -> tuple[Path, list[str]]:
    """An input with one problem, and the fragments its error line must hold."""

    d.mkdir(parents=True)
    if case == "parquet null row":
        path = write_parquet(d / "n.parquet", ["a", "b", "c", None, "e"])
        return path, [str(path), "row 3 (0-based) has no 'text': it is null"]
    if case == "parquet missing column":
        path = write_parquet(d / "m.parquet", ["a"], body=["b"])
        return path, [str(path), "has no column 'title' (its columns: text, body)"]
    if case == "parquet column not text":
        path = write_parquet(d / "i.parquet", ["a"], title=[7])
        return path, [str(path), "column 'title' holds int64, not text"]
    if case == "parquet invalid UTF-8":
        pyarrow = pytest.importorskip("pyarrow")
        path = write_parquet(d / "u.parquet", pyarrow.array([b"fine", b"ok \xff"], pyarrow.binary()))
        return path, [str(path), "invalid UTF-8 at byte 3 of 'text' in row 1 (0-based)", "--errors replace"]
    if case == "not a parquet file":
        pytest.importorskip("pyarrow.parquet")
        (d / "x.parquet").write_text("text, not Parquet\n")
        return d / "x.parquet", [str(d / "x.parquet"), "cannot read file"]
    if case == "jsonl.zst bad line":
        (d / "j.jsonl.zst").write_bytes(zstd_frames(b'{"text": "a"}\n\n{"text": 3}\n', frames=2))
        return d / "j.jsonl.zst", [str(d / "j.jsonl.zst"), "line 3 has no string field 'text'"]
    if case == "txt.zst invalid UTF-8":
        (d / "t.txt.zst").write_bytes(zstd_frames(b"ok\n" * 10 + b"\xc3(", frames=2))
        return d / "t.txt.zst", [str(d / "t.txt.zst"), "invalid UTF-8 at byte 30 of the decompressed text"]
    if case == "truncated zst":
        (d / "cut.txt.zst").write_bytes(zstd_frames(os.urandom(1 << 16).hex().encode())[:-5])
        return d / "cut.txt.zst", [str(d / "cut.txt.zst"), "cannot read file", "ended before the end-of-stream"]
    if case == "corrupt zst":
        pytest.importorskip("zstandard")
        (d / "bad.txt.zst").write_bytes(b"plain text, not zstd\n")
        return d / "bad.txt.zst", [str(d / "bad.txt.zst"), "cannot read file: invalid zstd data"]
    if case == "saved dataset null row":
        path = save_dataset(d / "ds", ["a", "b", "c", None], shards=2)  # the null is in the second file
        return path, [str(path), "row 3 (0-based) of the dataset has no 'text': it is null"]
    assert case == "saved DatasetDict"
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    split = datasets.Dataset.from_dict({"text": ["a"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(d / "dd"))
    return d / "dd", [str(d / "dd"), "a saved DatasetDict with splits test, train", str(d / "dd" / "test")]


BAD_INPUTS = [
    "parquet null row",
    "parquet missing column",
    "parquet column not text",
    "parquet invalid UTF-8",
    "not a parquet file",
    "jsonl.zst bad line",
    "txt.zst invalid UTF-8",
    "truncated zst",
    "corrupt zst",
    "saved dataset null row",
    "saved DatasetDict",
]


@pytest.mark.data_extras
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_rows_and_fields_are_named_with_file_and_row(
    case: str, tmp_path: Path, tiny_tokenizer_path: Path, run_cli
) -> None:
    path, fragments = bad_input(case, tmp_path / "in")
    extra = ["--text-field", "title"] if "parquet missing column" in case or "not text" in case else []
    result = run_cli("pack", path, "-t", tiny_tokenizer_path, "-l", "4", "-o", tmp_path / "out", *extra)
    result.assert_refused(*fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.data_extras
def test_replace_mode_reads_invalid_utf8_in_parquet(tmp_path: Path, tiny_tokenizer_path: Path, run_cli) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    rows = pyarrow.array([b"valid " * 20, b"bad \xff\xfe and \xef\xbf\xbd kept"], pyarrow.large_binary())
    path = write_parquet(tmp_path / "u.parquet", rows)
    summary = pack(run_cli, tiny_tokenizer_path, tmp_path / "o", path, extra=("--errors", "replace"))
    assert summary["replaced_characters"] == 2 and summary["splits"]["train"]["documents"] == 2


MISSING = {
    "parquet": ("docs.parquet", ["pyarrow", "pyarrow.parquet"], "reading .parquet files needs pyarrow"),
    "zstd": ("docs.jsonl.zst", ["zstandard"], "reading .zst files needs zstandard"),
    "datasets": ("saved", ["pyarrow"], "reading a saved Hugging Face dataset needs pyarrow"),
}


@pytest.mark.parametrize("extra", list(MISSING))
def test_a_missing_package_is_one_error_line_naming_the_extra(
    extra: str, tmp_path: Path, tiny_tokenizer_path: Path, run_cli, monkeypatch
) -> None:
    name, modules, message = MISSING[extra]
    path = tmp_path / "corpus" / name
    if extra == "datasets":  # the files that mark a saved dataset; never read, so any content does
        path.mkdir(parents=True)
        (path / "state.json").write_text("{}")
        (path / "dataset_info.json").write_text("{}")
    else:
        path.parent.mkdir()
        path.write_bytes(b"never read")
    (tmp_path / "corpus" / "plain.txt").write_text("readable without any extra\n")
    for module in modules:  # a None entry makes `import module` raise ImportError
        monkeypatch.setitem(sys.modules, module, None)
    fix = f"pip install 'dlm[{extra}]'"
    for command in (
        ("pack", tmp_path / "corpus", "-t", tiny_tokenizer_path, "-l", "4", "-o", tmp_path / "out"),
        ("tokenizer", "train", tmp_path / "corpus", "-n", "300", "-o", tmp_path / "tok.json"),
    ):
        run_cli(*command).assert_refused(str(path), message, fix)
    assert not (tmp_path / "out").exists() and not (tmp_path / "tok.json").exists()


def read_lines(context: ReadContext) -> Iterator[Chunk]:
    """The example of docs/architecture.md: each non-blank line is one document, without its line break."""

    with context.open() as handle:
        offset = 0
        for line in handle:
            text, size = context.decode(line.rstrip(b"\r\n"), offset)
            offset += len(line)
            if text.strip():
                yield Chunk(text, size, last=True)


def test_a_new_format_is_one_read_function_and_one_registry_entry(
    tmp_path: Path, tiny_tokenizer_path: Path, run_cli, monkeypatch
) -> None:
    monkeypatch.setattr(readers, "_FORMATS", readers._FORMATS.copy())  # the registration leaves with the test
    readers.register_format(Format("lines", "`.lines`", read_lines, suffixes=(".lines",), compressible=True))
    assert readers.formats()[-1].name == "lines"
    documents = ["first line", "second, with é", "third"]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.lines.gz").write_bytes(gzip.compress("first line\r\n\nsecond, with é\n".encode()))
    (corpus / "b.lines").write_bytes(b"third\n\xff\n")
    expected = pack(run_cli, tiny_tokenizer_path, tmp_path / "txt", *write_texts(tmp_path / "txt-in", documents))
    run_cli("pack", corpus, "-t", tiny_tokenizer_path, "-l", "8", "-o", tmp_path / "o").assert_refused(
        str(corpus / "b.lines"), "invalid UTF-8 at byte 6"
    )
    (corpus / "b.lines").write_bytes(b"third\n")
    got = pack(run_cli, tiny_tokenizer_path, tmp_path / "lines", corpus)
    assert (tmp_path / "lines" / "train.bin").read_bytes() == (tmp_path / "txt" / "train.bin").read_bytes()
    assert got["splits"]["train"]["documents"] == expected["splits"]["train"]["documents"] == 3


MEASURE_PEAK = (
    "import resource, sys\nfrom dlm.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n"
    "    assert not exc.code, exc.code\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
)


def packing_peak_kib(parquet: Path, tokenizer: Path, output: Path) -> int:
    """Peak resident memory (KiB) of a `dlm pack` process packing `parquet`."""

    # One encoding thread: the peak then measures the reader, not how many threads a busy machine had.
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    args = ["pack", str(parquet), "-t", str(tokenizer), "-l", "64", "-o", str(output), "--json"]
    result = subprocess.run([sys.executable, "-c", MEASURE_PEAK, *args], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip().splitlines()[-1])


@pytest.mark.data_extras
def test_packing_memory_is_flat_in_the_size_of_a_parquet_file(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    import random

    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 8))) for _ in range(2000)]
    rows = pyarrow.table({"text": [" ".join(rng.choices(words, k=1000)) + "\n" for _ in range(100)]})
    # ~19 MB and ~77 MB of text in row groups of 100 rows. The rows repeat: the packer reads and hashes
    # every one (twice) but tokenizes only the first copy, which keeps this test to a few seconds. A
    # reader that loads the whole column peaks about 1.5x higher on the larger file (measured).
    peaks = []
    for scale in (1, 4):
        path = tmp_path / f"x{scale}.parquet"
        with parquet.ParquetWriter(path, rows.schema) as writer:
            for _ in range(32 * scale):
                writer.write_table(rows)
        peaks.append(packing_peak_kib(path, tiny_tokenizer_path, tmp_path / f"out{scale}"))
    assert peaks[1] <= 1.3 * peaks[0], peaks
