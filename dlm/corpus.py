"""Files in and out: finding text files, streaming their documents, and safe output paths.

Inputs are files, directories (searched recursively) and glob patterns. A `.txt` or `.md` file is one
document; every non-blank line of a `.jsonl` file is one document (its `text_field`). Any of them may
be gzip-compressed (`.gz`). Files are read in line-aligned pieces of about `piece_bytes`, so memory
never grows with file size, only with the longest line.

Pieces end at a newline (or the end of the document). The tokenizer splits its input after every
newline before anything else, so encoding the pieces one by one gives exactly the tokens of encoding
the whole document at once, and the pieces can be encoded in parallel.

Files that a directory or glob holds but dlm cannot read (a README, `.csv`, `.html`) are skipped and
listed (`discover_corpus`), so that a user sees what was left out; hidden files are never corpus text.

Outputs are checked before any work starts (`check_output_file`, `check_writable_directory`) and
written under a temporary name (`temporary_path`) that is renamed into place at the very end. The
temporaries of a killed process are removed by the next run (`remove_stale_temporaries`).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, TypeVar, get_args

from dlm.errors import UserError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
SUPPORTED = "`.txt`, `.md`, `.jsonl` (each optionally `.gz`)"
# What to do with bytes that are not UTF-8: stop with their offset, or read U+FFFD.
DecodeErrors = Literal["strict", "replace"]
DECODE_ERRORS: tuple[str, ...] = get_args(DecodeErrors)
_REPLACEMENT_UTF8 = "\ufffd".encode()
_T = TypeVar("_T")


def _kind(path: Path) -> str | None:
    """'text', 'jsonl' or None (unsupported), looking through a trailing `.gz`."""

    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[: -len(".gz")]
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


@dataclass
class Discovered:
    """The corpus files that inputs name, and the files they hold that dlm cannot read."""

    paths: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)  # found in a directory or glob, not readable


def _partition(files: Iterable[Path], what: str, where: str | Path) -> Discovered:
    """Readable and unreadable files; refuse when none is readable."""

    found = Discovered()
    for path in files:
        (found.paths if _kind(path) is not None else found.skipped).append(path)
    if not found.paths:
        others = f" (only {len(found.skipped)} other files, e.g. {found.skipped[0].name})" if found.skipped else ""
        raise UserError(f"{what} no {SUPPORTED} files{others}", path=where)
    return found


def _expand(item: str | Path) -> Discovered:
    path = Path(item).expanduser()
    if path.is_file():
        if _kind(path) is None:
            raise UserError(f"unsupported file type; dlm reads {SUPPORTED}", path=path)
        return Discovered([path])
    if path.is_dir():
        # Hidden entries (.git, editor swap files, dlm's own temporaries) are never corpus text.
        visible = (p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts))
        files = sorted(p for p in visible if p.is_file())
        return _partition(files, "directory holds", path)
    if any(char in str(item) for char in "*?["):
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        return _partition([p for p in matches if p.is_file()], "glob matches", item)
    raise UserError("input not found", path=path, fix="check the path")


def discover_corpus(inputs: Sequence[str | Path]) -> Discovered:
    """The text files named by `inputs`, in the order given (directories and globs sorted), and the
    files that directories and globs hold but dlm cannot read."""

    if not inputs:
        raise UserError("no inputs given", fix="pass text files, directories or globs")
    paths: dict[Path, None] = {}
    skipped: dict[Path, None] = {}
    for item in inputs:
        found = _expand(item)
        paths.update(dict.fromkeys(path.resolve() for path in found.paths))
        skipped.update(dict.fromkeys(path.resolve() for path in found.skipped))
    return Discovered(list(paths), list(skipped))


def discover_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """The text files named by `inputs`, in the order given (directories and globs sorted)."""

    return discover_corpus(inputs).paths


@dataclass(frozen=True)
class SourceFile:
    """One input file as read: its on-disk size and sha256, for the packed metadata."""

    path: str
    bytes: int
    sha256: str


class Piece(NamedTuple):
    """A newline-aligned slice of one document's text."""

    text: str
    text_bytes: int  # UTF-8 bytes of `text` (bits per byte are measured against these)
    document: int  # running index of the document over the whole corpus
    source: int  # index of the file in the reader's `paths`
    last: bool  # the document ends with this piece


class _HashingFile(io.RawIOBase):
    """A raw file that hashes and counts the on-disk bytes as they stream past."""

    def __init__(self, path: Path):
        super().__init__()
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self.sha256 = hashlib.sha256()
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        count = self._file.readinto(buffer) or 0
        self.sha256.update(memoryview(buffer)[:count])
        self.bytes_read += count
        return count

    def close(self) -> None:
        self._file.close()
        super().close()


def _with_last(items: Iterable[_T]) -> Iterator[tuple[_T, bool]]:
    """Pairs (item, is_last), looking one item ahead."""

    iterator = iter(items)
    try:
        previous = next(iterator)
    except StopIteration:
        return
    for item in iterator:
        yield previous, False
        previous = item
    yield previous, True


class CorpusReader:
    """Streams the documents of `paths` as `Piece`s; counts bytes, replacements and documents."""

    def __init__(
        self,
        paths: Sequence[Path],
        text_field: str = "text",
        errors: str = "strict",
        piece_bytes: int = 1 << 16,
    ):
        if errors not in DECODE_ERRORS:
            raise UserError(f"errors must be one of {', '.join(DECODE_ERRORS)}, got {errors!r}")
        self.paths = list(paths)
        self.text_field = text_field
        self.errors = errors
        self.piece_bytes = piece_bytes
        self.total_bytes = sum(path.stat().st_size for path in self.paths)
        self.sources: list[SourceFile] = []  # filled as each file is finished
        self.replaced_characters = 0
        self.documents = 0
        self._done_bytes = 0
        self._current: _HashingFile | None = None

    @property
    def bytes_read(self) -> int:
        """On-disk (compressed, for `.gz`) bytes consumed so far: the unit of `total_bytes`."""

        return self._done_bytes + (self._current.bytes_read if self._current else 0)

    def pieces(self) -> Iterator[Piece]:
        for index, path in enumerate(self.paths):
            try:
                raw = _HashingFile(path)
            except OSError as exc:
                raise UserError(f"cannot open file: {exc.strerror}", path=path) from None
            self._current = raw
            buffered = io.BufferedReader(raw, buffer_size=1 << 20)
            handle = gzip.GzipFile(fileobj=buffered) if path.name.endswith(".gz") else buffered
            try:
                if _kind(path) == "jsonl":
                    yield from self._jsonl_pieces(path, index, handle)
                else:
                    yield from self._text_pieces(path, index, handle)
            except (OSError, EOFError, zlib.error) as exc:
                raise UserError(f"cannot read file: {exc}", path=path) from None
            finally:
                handle.close()
                raw.close()
            self.sources.append(SourceFile(str(path), raw.bytes_read, raw.sha256.hexdigest()))
            self._done_bytes += raw.bytes_read
            self._current = None

    def _decode(self, data: bytes, path: Path, offset: int) -> tuple[str, int]:
        """The text of `data` and its UTF-8 size (which replacement changes)."""

        try:
            return data.decode("utf-8"), len(data)
        except UnicodeDecodeError as exc:
            if self.errors == "strict":
                where = " of the decompressed text" if path.name.endswith(".gz") else ""
                raise UserError(
                    f"invalid UTF-8 at byte {offset + exc.start}{where}",
                    path=path,
                    fix="convert the file to UTF-8, or pass --errors replace to substitute U+FFFD",
                ) from None
        text = data.decode("utf-8", errors="replace")
        # U+FFFD characters already in the file are valid UTF-8; only the rest are replacements.
        self.replaced_characters += text.count("\ufffd") - data.count(_REPLACEMENT_UTF8)
        return text, len(text.encode("utf-8"))

    def _text_pieces(self, path: Path, source: int, handle: io.IOBase) -> Iterator[Piece]:
        def chunks() -> Iterator[bytes]:
            while lines := handle.readlines(self.piece_bytes):
                yield b"".join(lines)

        offset = 0
        document = self.documents
        for data, last in _with_last(chunks()):
            text, size = self._decode(data, path, offset)
            offset += len(data)
            yield Piece(text, size, document, source, last)
        if offset:
            self.documents += 1

    def _jsonl_pieces(self, path: Path, source: int, handle: io.IOBase) -> Iterator[Piece]:
        offset = 0
        for line_number, line in enumerate(handle, start=1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(self._decode(line, path, start)[0])
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"line {line_number} is not valid JSON ({exc.msg})",
                    path=path,
                    fix="write one JSON object per line",
                ) from None
            text = record.get(self.text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserError(
                    f"line {line_number} has no string field {self.text_field!r}",
                    path=path,
                    fix="pass --text-field with the name of the field holding the text",
                )
            if text:
                yield Piece(text, len(text.encode("utf-8")), self.documents, source, True)
                self.documents += 1


def check_writable_directory(directory: Path) -> None:
    """Refuse early when files could not be created in `directory`; creates nothing itself."""

    probe = Path(directory).absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(
            "is not a directory, so nothing can be written under it",
            path=probe,
            fix="choose an output path under a directory",
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError("directory is not writable", path=probe, fix="choose a writable location")


def check_output_file(path: Path, overwrite: bool) -> None:
    """Refuse to replace an existing file unless asked to, and refuse unwritable locations."""

    if path.is_dir():
        raise UserError("output is a directory", path=path, fix="name a file to write")
    if path.exists() and not overwrite:
        raise UserError("output already exists", path=path, fix="pass --overwrite to replace it")
    check_writable_directory(path.parent)


def temporary_path(final: Path) -> Path:
    """A hidden sibling of `final` that no loader mistakes for the real file."""

    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


_TEMPORARY_NAME = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)")


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending anything)."""

    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; a number beyond any pid
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def remove_stale_temporaries(directory: Path, names: Iterable[str]) -> list[Path]:
    """Remove the `temporary_path`s of `names` in `directory` whose process is gone: a killed run
    never renamed or removed them. Those of a live process (a concurrent run) are kept."""

    wanted = set(names)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in sorted(directory.iterdir()):
        match = _TEMPORARY_NAME.fullmatch(entry.name)
        if match and match["name"] in wanted and entry.is_file() and not process_alive(int(match["pid"])):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed

