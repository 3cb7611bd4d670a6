"""Reading one corpus input: its bytes (decompressed, hashed and counted as they stream) and their UTF-8 text.

`ReadContext` is what every reader of `dlm.data.readers` gets: the input, the reader's settings, the
decoding policy (`--errors`: stop at invalid UTF-8 with where it is, or read U+FFFD) and the on-disk
bytes consumed and hashed so far. Compression is a layer under the byte-stream formats, chosen by the
trailing suffix (`COMPRESSIONS`).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO, Literal, NamedTuple, get_args

from dlm.errors import UserError
from dlm.extras import Requirement, require

# What to do with bytes that are not UTF-8: stop with their offset, or read U+FFFD.
DecodeErrors = Literal["strict", "replace"]
DECODE_ERRORS: tuple[str, ...] = get_args(DecodeErrors)
_REPLACEMENT_UTF8 = "\ufffd".encode()
# An instruction example as read (`dlm pack --chat`): a JSON-like value and where it is, "FILE:LINE" or
# "FILE: row N (0-based)"; `dlm.data.chat.parse_example` judges it.
Record = tuple[Any, str]


class Chunk(NamedTuple):
    """A slice of one document's text, as a reader yields it."""

    text: str
    text_bytes: int  # UTF-8 bytes of `text`
    last: bool  # the document ends with this chunk


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
