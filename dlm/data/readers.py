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

The bytes under every reader (decompression, hashing, the UTF-8 policy) are `dlm.data.read_context`'s;
the Arrow-backed readers live in `dlm.data.arrow_readers`, registered here with the others.

Every reader streams: memory is bounded by a piece of text (`piece_bytes` of whole lines), a JSON line, a Parquet
row group's text column, or an Arrow record batch, never by the size of the input. Readers decode
bytes with `ReadContext.decode`, so invalid UTF-8 is refused (with where it is) or replaced the same
way in every format, and they name the file and the line or row of anything they cannot use.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dlm.data.arrow_readers import (
    PARQUET,
    SAVED_DATASET,
    is_saved_dataset,
    read_parquet,
    read_parquet_records,
    read_saved_dataset,
    read_saved_dataset_records,
    saved_dataset_size,
)
from dlm.data.read_context import (
    COMPRESSIONS,
    DECODE_ERRORS,
    UTF8_FIX,
    Chunk,
    DecodeErrors,
    ReadContext,
    Record,
    Utf8Decoder,
    compression_of,
)
from dlm.errors import UserError
from dlm.extras import Requirement, require
from dlm.registry import Registry

__all__ = [
    "COMPRESSIONS",
    "DECODE_ERRORS",
    "UTF8_FIX",
    "Chunk",
    "DecodeErrors",
    "Format",
    "ReadContext",
    "Record",
    "Utf8Decoder",
    "check_requirements",
    "compression_of",
    "format_of",
    "formats",
    "record_inputs",
    "register_format",
    "supported_inputs",
    "unregister_format",
]

_T = TypeVar("_T")


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


def _file_size(path: Path) -> int:
    return path.stat().st_size


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
register_format(
    Format("jsonl", "`.jsonl`", read_jsonl, suffixes=(".jsonl",), compressible=True, records=read_jsonl_records)
)
register_format(
    Format("parquet", "`.parquet`", read_parquet, suffixes=(".parquet",), needs=PARQUET, records=read_parquet_records)
)
register_format(
    Format(
        "saved-dataset",
        "saved Hugging Face datasets (`save_to_disk` directories)",
        read_saved_dataset,
        directory=is_saved_dataset,
        needs=SAVED_DATASET,
        size=saved_dataset_size,
        records=read_saved_dataset_records,
    )
)


def describe(chosen: Iterable[Format]) -> str:
    """The inputs the `chosen` formats read, in words (with Markdown backticks)."""

    chosen = list(chosen)
    compressions = " or ".join(f"`{c.suffix}`" for c in COMPRESSIONS)
    return ", ".join(
        [
            ", ".join(f.label for f in chosen if f.compressible) + f" (each optionally {compressions})",
            *(f.label for f in chosen if not f.compressible),
        ]
    )


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
