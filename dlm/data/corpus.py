"""Files in and out: finding corpus inputs, streaming their documents, and safe output paths.

Inputs are files, directories (searched recursively) and glob patterns. How a file becomes documents
is its format's business (`dlm.data.readers`, the registry of formats): a `.txt` or `.md` file is one
document, every non-blank line of a `.jsonl` file is one (its `text_field`), and so is every row of
a `.parquet` file or of a saved Hugging Face dataset (a directory, read as one input). Text and jsonl
may be compressed (`.gz`, `.zst`). Files are read in pieces, so memory never grows with file size.

Pieces of text files end at a newline (or the end of the document). The tokenizer splits its input
after every newline before anything else, so encoding the pieces one by one gives exactly the tokens
of encoding the whole document at once, and the pieces can be encoded in parallel.

Files that a directory or glob holds but dlm cannot read (a README, `.csv`, `.html`) are skipped and
listed (`discover_corpus`), so that a user sees what was left out; hidden files are never corpus text.
A format that needs an optional package is refused before any work, with the extra to install.

Outputs are checked before any work starts (`check_output_file`); writing them is `dlm.fileio`'s.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from dlm.data.readers import ReadContext, Utf8Decoder, check_requirements, format_of, supported_inputs
from dlm.errors import UserError
from dlm.fileio import check_writable_directory


@dataclass
class Discovered:
    """The corpus inputs that arguments name, and the files they hold that dlm cannot read."""

    paths: list[Path] = field(default_factory=list)  # files, and directories read as one input
    skipped: list[Path] = field(default_factory=list)  # found in a directory or glob, not readable


def _partition(entries: Iterable[Path], what: str, where: str | Path) -> Discovered:
    """Readable and unreadable entries; refuse when none is readable."""

    found = Discovered()
    for path in entries:
        (found.paths if format_of(path) is not None else found.skipped).append(path)
    if not found.paths:
        others = f" (only {len(found.skipped)} other files, e.g. {found.skipped[0].name})" if found.skipped else ""
        raise UserError(f"{what} no input dlm reads ({supported_inputs()}){others}", path=where)
    return found


def _refuse_dataset_dict(path: Path) -> None:
    """A saved `DatasetDict` holds several splits: which are training text is the user's choice."""

    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir() and format_of(p) is not None)
        raise UserError(
            f"a saved DatasetDict with splits {', '.join(splits) or '(none)'}",
            path=path,
            fix=f"name one split directory, e.g. {path / (splits[0] if splits else 'train')}",
        )


def _walk(directory: Path) -> list[Path]:
    """The visible files under `directory`, and the saved datasets in it (each one input, not searched)."""

    _refuse_dataset_dict(directory)
    entries: list[Path] = []
    for root, directories, files in os.walk(directory):
        # Hidden entries (.git, editor swap files, dlm's own temporaries) are never corpus text.
        for name in [d for d in directories if d.startswith(".") or format_of(Path(root, d)) is not None]:
            directories.remove(name)
            if not name.startswith("."):
                entries.append(Path(root, name))
        for name in directories:
            _refuse_dataset_dict(Path(root, name))
        entries.extend(Path(root, name) for name in files if not name.startswith("."))
    return sorted(p for p in entries if p.is_dir() or p.is_file())


def _expand(item: str | Path) -> Discovered:
    path = Path(item).expanduser()
    if path.is_file():
        if format_of(path) is None:
            raise UserError(f"unsupported file type; dlm reads {supported_inputs()}", path=path)
        return Discovered([path])
    if path.is_dir():
        return Discovered([path]) if format_of(path) is not None else _partition(_walk(path), "directory holds", path)
    if any(char in str(item) for char in "*?["):
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        return _partition([p for p in matches if p.is_file() or format_of(p)], "glob matches", item)
    raise UserError("input not found", path=path, fix="check the path")


def discover_corpus(inputs: Sequence[str | Path]) -> Discovered:
    """The inputs named by `inputs`, in the order given (directories and globs sorted), and the
    files that directories and globs hold but dlm cannot read. Refuses, before any reading, an
    input whose format needs a package that is not installed."""

    if not inputs:
        raise UserError("no inputs given", fix="pass text files, directories or globs")
    paths: dict[Path, None] = {}
    skipped: dict[Path, None] = {}
    for item in inputs:
        found = _expand(item)
        paths.update(dict.fromkeys(path.resolve() for path in found.paths))
        skipped.update(dict.fromkeys(path.resolve() for path in found.skipped))
    check_requirements(paths)
    return Discovered(list(paths), list(skipped))


def discover_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """The inputs named by `inputs`, in the order given (directories and globs sorted)."""

    return discover_corpus(inputs).paths


@dataclass(frozen=True)
class SourceFile:
    """One input as read: its on-disk size and sha256, for the packed metadata. A saved dataset
    (a directory) counts its Arrow files, hashed one after the other in its row order."""

    path: str
    bytes: int
    sha256: str


class Piece(NamedTuple):
    """A slice of one document's text (newline-aligned for text files)."""

    text: str
    text_bytes: int  # UTF-8 bytes of `text` (bits per byte are measured against these)
    document: int  # running index of the document over the whole corpus (its first reading)
    source: int  # index of the input in the reader's `paths`
    last: bool  # the document ends with this piece
    copy: int = 0  # which reading of its input this is (`order`): 0, or a repeat of a weighted source


class CorpusReader:
    """Streams the documents of `paths` as `Piece`s; counts bytes, replacements and documents.

    `order` lists the (input index, copy) readings to make, by default each input once; a repeated
    input (copy 1, 2, ...) numbers its documents as its first reading did, which must come first."""

    def __init__(
        self,
        paths: Sequence[Path],
        text_field: str = "text",
        errors: str = "strict",
        piece_bytes: int = 1 << 16,
        order: Sequence[tuple[int, int]] | None = None,
    ):
        self.decoder = Utf8Decoder(errors)
        self.paths = list(paths)
        self.text_field = text_field
        self.errors = errors
        self.piece_bytes = piece_bytes
        self.order = [(index, 0) for index in range(len(self.paths))] if order is None else list(order)
        sizes = [_input_size(path) for path in self.paths]
        self.input_bytes = sum(sizes)  # on disk, each input once
        self.total_bytes = sum(sizes[index] for index, _ in self.order)  # to read: repeats counted
        self.sources: list[SourceFile] = []  # filled as each input's first reading is finished
        self.documents = 0
        self._first_document: dict[int, int] = {}
        self._done_bytes = 0
        self._current: ReadContext | None = None

    @property
    def replaced_characters(self) -> int:
        return self.decoder.replaced_characters

    @property
    def bytes_read(self) -> int:
        """On-disk (compressed, for `.gz`) bytes consumed so far: the unit of `total_bytes`."""

        return self._done_bytes + (self._current.bytes_read if self._current else 0)

    def pieces(self) -> Iterator[Piece]:
        for index, copy in self.order:
            path = self.paths[index]
            reader = format_of(path)
            if reader is None:
                raise UserError(f"unsupported file type; dlm reads {supported_inputs()}", path=path)
            context = ReadContext(path, self.text_field, self.piece_bytes, self.decoder)
            self._current = context
            document = self._first_document.setdefault(index, self.documents)
            for chunk in reader.read(context):
                yield Piece(chunk.text, chunk.text_bytes, document, index, chunk.last, copy)
                document += chunk.last
            if copy == 0:
                self.documents = document
                self.sources.append(SourceFile(str(path), context.bytes_read, context.sha256.hexdigest()))
            self._done_bytes += context.bytes_read
            self._current = None


def _input_size(path: Path) -> int:
    reader = format_of(path)
    return path.stat().st_size if reader is None else reader.size(path)


def check_output_file(path: Path, overwrite: bool) -> None:
    """Refuse to replace an existing file unless asked to, and refuse unwritable locations."""

    if path.is_dir():
        raise UserError("output is a directory", path=path, fix="name a file to write")
    if path.exists() and not overwrite:
        raise UserError("output already exists", path=path, fix="pass --overwrite to replace it")
    check_writable_directory(path.parent)
