"""The Arrow-backed corpus formats: Parquet files and saved Hugging Face datasets (`dlm.data.readers`
registers them). Each row's text column is one document, or, for instruction data, each row's fields
one record. pyarrow comes with the `parquet` and `datasets` extras.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from dlm.data.read_context import Chunk, ReadContext, Record
from dlm.errors import UserError
from dlm.extras import Requirement, require

_T = TypeVar("_T")
PARQUET = Requirement("pyarrow.parquet", "parquet", "reading .parquet files")
SAVED_DATASET = Requirement("pyarrow", "datasets", "reading a saved Hugging Face dataset")

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


def saved_dataset_size(path: Path) -> int:
    """On-disk bytes of a saved dataset's Arrow files: the unit of its progress."""

    return sum(file.stat().st_size for file in saved_dataset_files(path))
