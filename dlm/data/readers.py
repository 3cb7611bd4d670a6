"""Corpus formats: the one place that knows how an input file (or a saved dataset) becomes documents.

Each format is a `Format` registered with `register_format`: the suffixes (or the directory test) that select it, the
optional package it needs and the extra that installs it, and a `read` function that yields the
documents of one input as `Chunk`s. Compression is a layer under the byte-stream formats, chosen by
the trailing suffix (`COMPRESSIONS`), so `notes.jsonl.zst` is jsonl read through zstd. Discovery,
`dlm tokenizer train`, `dlm pack`, the missing-package errors and the list of supported inputs all
follow the registry: adding a format is one read function and one `register_format` call.

A format whose inputs hold fields (JSONL objects, the columns of Parquet and of saved datasets) also
has a `records` function: instruction data (`dlm pack --chat`) reads each line or row as one record,
of the fields it asks for, named with its file and line or row.

Every reader streams: memory is bounded by a piece of text (`piece_bytes`), a JSON line, a Parquet
row group's text column, or an Arrow record batch, never by the size of the input. Readers decode
bytes with `ReadContext.decode`, so invalid UTF-8 is refused (with where it is) or replaced the same
way in every format, and they name the file and the line or row of anything they cannot use.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO, Literal, NamedTuple, TypeVar, get_args

from dlm.errors import UserError
from dlm.extras import Requirement, require
from dlm.registry import Registry

# What to do with bytes that are not UTF-8: stop with their offset, or read U+FFFD.
DecodeErrors = Literal["strict", "replace"]
DECODE_ERRORS: tuple[str, ...] = get_args(DecodeErrors)
_REPLACEMENT_UTF8 = "\ufffd".encode()
_T = TypeVar("_T")
# An instruction example as read (`dlm pack --chat`): a JSON-like value and where it is, "FILE:LINE" or
# "FILE: row N (0-based)"; `dlm.data.chat.parse_example` judges it.
Record = tuple[Any, str]


class Chunk(NamedTuple):
    """A slice of one document's text, as a reader yields it."""

    text: str
    text_bytes: int  # UTF-8 bytes of `text`
    last: bool  # the document ends with this chunk


PARQUET = Requirement("pyarrow.parquet", "parquet", "reading .parquet files")
SAVED_DATASET = Requirement("pyarrow", "datasets", "reading a saved Hugging Face dataset")
ZSTD = Requirement("zstandard", "zstd", "reading .zst files")


UTF8_FIX = "convert the file to UTF-8, or pass --errors replace to substitute U+FFFD"


class Utf8Decoder:
    """UTF-8 decoding under the `--errors` policy; counts the characters it replaced."""

    def __init__(self, errors: str = "strict", fix: str = UTF8_FIX):
        if errors not in DECODE_ERRORS:
            raise UserError(f"errors must be one of {', '.join(DECODE_ERRORS)}, got {errors!r}")
        self.errors, self.fix = errors, fix  # what the error for invalid UTF-8 says to do
        self.replaced_characters = 0

    def decode(self, data: bytes, path: Path, offset: int, within: str) -> tuple[str, int]:
        """The text of `data` and its UTF-8 size (which replacement changes)."""

        try:
            return data.decode("utf-8"), len(data)
        except UnicodeDecodeError as exc:
            if self.errors == "strict":
                raise UserError(
                    f"invalid UTF-8 at byte {offset + exc.start}{within}",
                    path=path,
                    fix=self.fix,
                ) from None
        text = data.decode("utf-8", errors="replace")
        # U+FFFD characters already in the file are valid UTF-8; only the rest are replacements.
        self.replaced_characters += text.count("\ufffd") - data.count(_REPLACEMENT_UTF8)
        return text, len(text.encode("utf-8"))


class ReadContext:
    """One input being read: the reader's settings, and the on-disk bytes consumed and hashed so far."""

    def __init__(self, path: Path, text_field: str, piece_bytes: int, decoder: Utf8Decoder):
        self.path = path
        self.text_field = text_field
        self.piece_bytes = piece_bytes
        self.decoder = decoder
        self.bytes_read = 0  # on-disk bytes: the unit of progress
        self.sha256 = hashlib.sha256()  # of the on-disk bytes, in reading order

    def decode(self, data: bytes, offset: int = 0, within: str | None = None) -> tuple[str, int]:
        if within is None:
            within = " of the decompressed text" if compression_of(self.path) else ""
        return self.decoder.decode(data, self.path, offset, within)

    @contextmanager
    def open(self, path: Path | None = None) -> Iterator[BinaryIO]:
        """The decompressed bytes of `path` (the input itself by default), hashed and counted on disk."""

        path = self.path if path is None else path
        try:
            raw = _HashingFile(path, self)
        except OSError as exc:
            raise UserError(f"cannot open file: {exc.strerror}", path=path) from None
        handle: BinaryIO = io.BufferedReader(raw, buffer_size=1 << 20)
        try:
            compression = compression_of(path)
            handle = compression.open(handle, path) if compression else handle
            yield handle
        except (OSError, EOFError, zlib.error) as exc:
            raise UserError(f"cannot read file: {exc}", path=path) from None
        finally:
            handle.close()
            raw.close()

    def hash_file(self, path: Path) -> None:
        """Hash `path` in one sequential read, for a format read by seeking (Parquet); the bytes read
        are then its size."""

        self.bytes_read = 0
        with self.open(path) as handle:
            while handle.read(1 << 20):
                pass


class _HashingFile(io.RawIOBase):
    """A raw file that hashes and counts the on-disk bytes as they stream past."""

    def __init__(self, path: Path, context: ReadContext):
        super().__init__()
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        self._context = context

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        count = self._file.readinto(buffer) or 0
        self._context.sha256.update(memoryview(buffer)[:count])
        self._context.bytes_read += count
        return count

    def close(self) -> None:
        self._file.close()
        super().close()


class _ZstdReader(io.RawIOBase):
    """The decompressed bytes of a zstd stream of any number of frames.

    zstandard's own stream reader returns a truncated file's bytes without an error; here a frame
    the input ends inside is an EOFError, as in gzip. Input goes in 16 KB steps, so the output held
    at once is 16 KB times the compression ratio (about 50x for repetitive text)."""

    _STEP = 1 << 14

    def __init__(self, source: BinaryIO, zstandard: ModuleType):
        super().__init__()
        self._source, self._zstandard = source, zstandard
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False
        self._output, self._position = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while self._position == len(self._output):
            data = self._source.read(self._STEP)
            if not data:
                if self._in_frame:
                    raise EOFError("compressed file ended before the end-of-stream marker was reached")
                return 0
            self._output, self._position = self._decompress(data), 0
        count = min(len(buffer), len(self._output) - self._position)
        buffer[:count] = self._output[self._position : self._position + count]
        self._position += count
        return count

    def _decompress(self, data: bytes) -> bytes:
        parts = []
        try:
            while data:
                self._in_frame = True
                parts.append(self._frame.decompress(data))
                if not self._frame.eof:
                    break
                # A frame ended: what follows is the next frame (or a skippable one).
                data, self._in_frame = self._frame.unused_data, False
                self._frame = self._decompressor.decompressobj()
        except self._zstandard.ZstdError as exc:
            raise OSError(f"invalid zstd data ({exc})") from None
        return b"".join(parts)

    def close(self) -> None:
        self._source.close()
        super().close()


@dataclass(frozen=True)
class Compression:
    suffix: str
    open: Callable[[BinaryIO, Path], BinaryIO]
    needs: Requirement | None = None


def _open_gzip(handle: BinaryIO, path: Path) -> BinaryIO:
    return gzip.GzipFile(fileobj=handle)  # type: ignore[return-value]


def _open_zstd(handle: BinaryIO, path: Path) -> BinaryIO:
    return io.BufferedReader(_ZstdReader(handle, require(ZSTD, path)), buffer_size=1 << 20)


COMPRESSIONS = (Compression(".gz", _open_gzip), Compression(".zst", _open_zstd, ZSTD))


def compression_of(path: Path) -> Compression | None:
    name = path.name.lower()
    return next((c for c in COMPRESSIONS if name.endswith(c.suffix)), None)


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


def read_text(context: ReadContext) -> Iterator[Chunk]:
    """The whole file is one document, in newline-aligned pieces of about `piece_bytes`."""

    with context.open() as handle:

        def pieces() -> Iterator[bytes]:
            while lines := handle.readlines(context.piece_bytes):
                yield b"".join(lines)

        offset = 0
        for data, last in _with_last(pieces()):
            text, size = context.decode(data, offset)
            offset += len(data)
            yield Chunk(text, size, last)


def _jsonl_values(context: ReadContext) -> Iterator[tuple[int, Any]]:
    """Each non-blank line's JSON value, with its line number; a line that is not UTF-8 or not JSON is
    named with its number."""

    with context.open() as handle:
        offset = 0
        within = " of the decompressed text," if compression_of(context.path) else ""
        for line_number, line in enumerate(handle, start=1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            text = context.decode(line, start, f"{within} on line {line_number}")[0]
            try:
                yield line_number, json.loads(text)
            except (json.JSONDecodeError, RecursionError) as exc:
                reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
                raise UserError(
                    f"line {line_number} is not valid JSON ({reason})",
                    path=context.path,
                    fix="write one JSON object per line",
                ) from None


def read_jsonl(context: ReadContext) -> Iterator[Chunk]:
    """Each non-blank line is a JSON object; its `text_field` string is one document."""

    for line_number, record in _jsonl_values(context):
        text = record.get(context.text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise UserError(
                f"line {line_number} has no string field {context.text_field!r}",
                path=context.path,
                fix="pass --text-field with the name of the field holding the text",
            )
        if text:
            yield Chunk(text, len(text.encode("utf-8")), True)


def read_jsonl_records(context: ReadContext, fields: Sequence[str]) -> Iterator[Record]:
    """Each non-blank line's JSON value, keeping only `fields` of an object, named `FILE:LINE`."""

    for line_number, value in _jsonl_values(context):
        record = {key: value[key] for key in fields if key in value} if isinstance(value, dict) else value
        yield record, f"{context.path}:{line_number}"


# The text column of an Arrow batch (Parquet, saved datasets): read as bytes, so that `decode` is the
# one place where UTF-8 is checked, as for every other format.
_TEXT_TYPES = ("string", "large_string", "string_view", "binary", "large_binary", "binary_view")
PARQUET_BATCH_ROWS = 128  # rows converted to Python at once; a row group is read in such batches


def _text_column_index(schema: Any, context: ReadContext) -> int:
    """Refuse a schema without a text column of that name; the column's index."""

    field = context.text_field
    index = schema.get_field_index(field)
    if index < 0:
        raise UserError(
            f"has no column {field!r} (its columns: {', '.join(schema.names)})",
            path=context.path,
            fix="pass --text-field with the name of the column holding the text",
        )
    if str(schema.field(index).type) not in _TEXT_TYPES:
        raise UserError(f"column {field!r} holds {schema.field(index).type}, not text", path=context.path)
    return index


def _arrow_documents(context: ReadContext, column: Any, first_row: int, where: str) -> Iterator[Chunk]:
    """Each non-empty value of an Arrow text column is one document; a null is refused with its row."""

    import pyarrow  # present: every caller required it first

    for row, value in enumerate(column.cast(pyarrow.large_binary()).to_pylist(), start=first_row):
        if value is None:
            raise UserError(
                f"row {row} (0-based){where} has no {context.text_field!r}: it is null",
                path=context.path,
                fix="drop or fill the null rows, or pass --text-field with another column",
            )
        text, size = context.decode(value, 0, f" of {context.text_field!r} in row {row} (0-based){where}")
        if text:
            yield Chunk(text, size, True)


def _arrow_records(context: ReadContext, batch: Any, first_row: int, where: str) -> Iterator[Record]:
    """Each row of a batch as a dict, named `FILE: row N (0-based)`; a binary value is decoded as text is."""

    for row, record in enumerate(batch.to_pylist(), start=first_row):
        for key, value in record.items():
            if isinstance(value, bytes):
                record[key] = context.decode(value, 0, f" of {key!r} in row {row} (0-based){where}")[0]
        yield record, f"{context.path}: row {row} (0-based){where}"


def _record_columns(schema: Any, context: ReadContext, fields: Sequence[str]) -> list[str]:
    """The `fields` that `schema` has, in its order; refuse a schema with none of them."""

    if not (columns := [name for name in schema.names if name in fields]):
        raise UserError(
            f"has none of the columns {', '.join(fields)} (its columns: {', '.join(schema.names)})",
            path=context.path,
        )
    return columns


# What reads one Arrow batch: (context, batch of the selected columns, its first row, where) -> items.
_Convert = Callable[[ReadContext, Any, int, str], Iterator[_T]]
_Select = Callable[[Any], list[str]]  # schema -> the columns to read


def _parquet_rows(context: ReadContext, select: _Select, convert: _Convert[_T]) -> Iterator[_T]:
    """`convert` of each batch of the `select`ed columns, read one row group (in batches) at a time."""

    parquet = require(PARQUET, context.path)
    import pyarrow  # a dependency of pyarrow.parquet

    try:
        # No pre-buffering and a bounded read buffer: only a part of one row group's columns is held.
        handle = parquet.ParquetFile(context.path, pre_buffer=False, buffer_size=1 << 20)
        columns = select(handle.schema_arrow)
        rows, size, done = handle.metadata.num_rows, context.path.stat().st_size, 0
        for batch in handle.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            yield from convert(context, batch, done, "")
            done += batch.num_rows
            context.bytes_read = size * done // max(rows, 1)
    except (pyarrow.ArrowException, OSError) as exc:
        raise UserError(f"cannot read file: {exc}", path=context.path) from None
    # Parquet is read by seeking (the footer first): its bytes are hashed in one more sequential read.
    context.hash_file(context.path)


def _text_column(context: ReadContext) -> _Select:
    return lambda schema: [schema.field(_text_column_index(schema, context)).name]


def _text_documents(context: ReadContext, batch: Any, first_row: int, where: str) -> Iterator[Chunk]:
    return _arrow_documents(context, batch.column(0), first_row, where)


def read_parquet(context: ReadContext) -> Iterator[Chunk]:
    """Each row's `text_field` is one document."""

    return _parquet_rows(context, _text_column(context), _text_documents)


def read_parquet_records(context: ReadContext, fields: Sequence[str]) -> Iterator[Record]:
    """Each row's `fields` (the columns it has of them) as one record."""

    return _parquet_rows(context, lambda schema: _record_columns(schema, context, fields), _arrow_records)


def is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets.Dataset.save_to_disk`."""

    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def saved_dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a saved dataset, in its row order (as `state.json` lists them)."""

    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        files = [path / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"state.json does not list the dataset's files ({exc})", path=path) from None
    if missing := [file for file in files if not file.is_file()]:
        raise UserError(f"the saved dataset lacks {missing[0].name}", path=path)
    return files


def _saved_dataset_rows(context: ReadContext, select: _Select, convert: _Convert[_T]) -> Iterator[_T]:
    """`convert` of each record batch of the `select`ed columns; the Arrow files stream in row order."""

    pyarrow = require(SAVED_DATASET, context.path)
    first_row = 0
    for data_file in saved_dataset_files(context.path):
        with context.open(data_file) as handle:
            try:
                stream = pyarrow.ipc.open_stream(handle)
                columns = select(stream.schema)
                for batch in stream:
                    yield from convert(context, batch.select(columns), first_row, " of the dataset")
                    first_row += batch.num_rows
            except pyarrow.ArrowException as exc:
                raise UserError(f"cannot read file: {exc}", path=data_file) from None


def read_saved_dataset(context: ReadContext) -> Iterator[Chunk]:
    """Each row's `text_field` is one document."""

    return _saved_dataset_rows(context, _text_column(context), _text_documents)


def read_saved_dataset_records(context: ReadContext, fields: Sequence[str]) -> Iterator[Record]:
    """Each row's `fields` (the columns it has of them) as one record."""

    return _saved_dataset_rows(context, lambda schema: _record_columns(schema, context, fields), _arrow_records)


def _file_size(path: Path) -> int:
    return path.stat().st_size


def _saved_dataset_size(path: Path) -> int:
    return sum(file.stat().st_size for file in saved_dataset_files(path))


@dataclass(frozen=True)
class Format:
    """One kind of corpus input."""

    name: str
    label: str  # how the list of supported inputs names it
    read: Callable[[ReadContext], Iterator[Chunk]]
    suffixes: tuple[str, ...] = ()  # file formats
    directory: Callable[[Path], bool] | None = None  # directory formats
    compressible: bool = False  # read through `COMPRESSIONS` when the name ends in one
    needs: Requirement | None = None
    size: Callable[[Path], int] = _file_size  # on-disk bytes read: the unit of progress
    # Reads the input as records holding the given fields (`dlm pack --chat`); None: text only.
    records: Callable[[ReadContext, Sequence[str]], Iterator[Record]] | None = None


_FORMATS: Registry[Format] = Registry("corpus format")


def register_format(spec: Format, replace: bool = False) -> Format:
    """Make dlm read the inputs `spec` selects (after the formats registered before it)."""

    return _FORMATS.add(spec.name, spec, replace=replace)


def unregister_format(name: str) -> None:
    _FORMATS.remove(name)


def formats() -> tuple[Format, ...]:
    """The registered formats, in registration order (the built-in ones first)."""

    return tuple(spec for _, spec in _FORMATS.items())


register_format(Format("text", "`.txt`, `.md`", read_text, suffixes=(".txt", ".md"), compressible=True))
register_format(Format("jsonl", "`.jsonl`", read_jsonl, suffixes=(".jsonl",), compressible=True,
                       records=read_jsonl_records))  # fmt: skip
register_format(Format("parquet", "`.parquet`", read_parquet, suffixes=(".parquet",), needs=PARQUET,
                       records=read_parquet_records))  # fmt: skip
register_format(
    Format(
        "saved-dataset",
        "saved Hugging Face datasets (`save_to_disk` directories)",
        read_saved_dataset,
        directory=is_saved_dataset,
        needs=SAVED_DATASET,
        size=_saved_dataset_size,
        records=read_saved_dataset_records,
    )
)


def describe(chosen: Iterable[Format]) -> str:
    """The inputs the `chosen` formats read, in words (with Markdown backticks)."""

    chosen = list(chosen)
    compressions = " or ".join(f"`{c.suffix}`" for c in COMPRESSIONS)
    return ", ".join([", ".join(f.label for f in chosen if f.compressible) + f" (each optionally {compressions})",
                      *(f.label for f in chosen if not f.compressible)])  # fmt: skip


def supported_inputs() -> str:
    """The inputs dlm reads, in words: every registered format."""

    return describe(formats())


def record_inputs() -> str:
    """The inputs `dlm pack --chat` reads: the formats with records."""

    return describe(f for f in formats() if f.records is not None)


def format_of(path: Path) -> Format | None:
    """The format that reads `path`; None when dlm cannot read it."""

    if path.is_dir():
        return next((f for f in formats() if f.directory is not None and f.directory(path)), None)
    name = path.name.lower()
    compression = compression_of(path)
    if compression is not None:
        name = name[: -len(compression.suffix)]
    for candidate in formats():
        if candidate.suffixes and name.endswith(candidate.suffixes) and (candidate.compressible or not compression):
            return candidate
    return None


def check_requirements(paths: Iterable[Path]) -> None:
    """Before any work: one error naming the extra to install for the first input that needs one."""

    checked: set[Requirement] = set()
    for path in paths:
        compression, found = compression_of(path), format_of(path)
        for needs in (found.needs if found else None, compression.needs if compression else None):
            if needs is not None and needs not in checked:
                require(needs, path)
                checked.add(needs)
