"""Packed token data: the streaming packer, the memory-mapped dataset and the batch sampler.

`pack_corpus` tokenizes documents, ends each with the end-of-document token, concatenates them and
cuts the stream into blocks of exactly `seq_len` tokens, streaming straight to disk (memory stays
flat whatever the corpus size). A split is `NAME.bin` (raw little-endian uint16, or uint32 when the
vocabulary does not fit) plus `NAME.json` (metadata). Everything is written under temporary names and
renamed at the end, metadata last, so an interrupted pack leaves nothing that loads.

torch is imported only where a tensor is made: `dlm pack` never touches it and starts in a fraction
of the seconds a torch import costs.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dlm import __version__
from dlm.corpus import (
    CorpusReader,
    Piece,
    check_writable_directory,
    discover_inputs,
    temporary_path,
)
from dlm.errors import UserError
from dlm.tokenizer import load_tokenizer, special_token_id, tokenizer_sha256

if TYPE_CHECKING:
    import torch

PACKED_FORMAT = "dlm-packed-v1"
SPLITS = ("train", "val")
OUTPUT_FILES = ("tokenizer.json", *(f"{s}.{ext}" for s in SPLITS for ext in ("bin", "json")))
# Encode about this much text per `encode_batch_fast` call: enough pieces for every core, little RAM.
BATCH_TEXT_BYTES = 1 << 20
PackProgress = Callable[[int, int, int], None]  # (bytes read, total bytes, tokens written)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits in it, else uint32; always little-endian on disk."""

    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


@dataclass
class SplitSummary:
    """One packed split as written."""

    path: Path
    num_blocks: int
    num_tokens: int
    dropped_tokens: int
    documents: int
    text_bytes: int


@dataclass
class PackSummary:
    """What `pack_corpus` wrote."""

    output: Path
    vocab_size: int
    dtype: str
    seq_len: int
    input_bytes: int
    replaced_characters: int
    seconds: float
    splits: dict[str, SplitSummary] = field(default_factory=dict)


class _SplitWriter:
    """Streams one split's tokens to a temporary file and counts what went in."""

    def __init__(self, name: str, final: Path, dtype: np.dtype, eos: int):
        self.name, self.final = name, final
        self.temporary = temporary_path(final)
        self.handle = open(self.temporary, "wb")  # noqa: SIM115 - closed by close()
        self.eos = np.array([eos], dtype=dtype)
        self.pending: list[np.ndarray] = []
        self.tokens = self.documents = self.text_bytes = 0
        self.sources: set[int] = set()

    def add(self, ids: np.ndarray, piece: Piece) -> None:
        self.pending.append(ids)
        self.text_bytes += piece.text_bytes
        self.sources.add(piece.source)
        if piece.last:
            self.pending.append(self.eos)
            self.documents += 1

    def flush(self) -> None:
        if self.pending:
            tokens = np.concatenate(self.pending)
            tokens.tofile(self.handle)
            self.tokens += tokens.size
            self.pending.clear()

    def close(self) -> None:
        self.handle.close()


def _check_pack_arguments(seq_len: int, val_fraction: float, val_inputs: Sequence[Any]) -> None:
    if seq_len < 2:
        raise UserError(f"seq_len must be at least 2, got {seq_len}", fix="pass --seq-len 2 or more")
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}", fix="for example --val-fraction 0.05")
    if val_fraction > 0 and val_inputs:
        raise UserError(
            "give either a validation fraction or validation inputs, not both",
            fix="drop --val-fraction or --val-input",
        )


def _check_output_dir(output: Path, tokenizer: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise UserError("output exists and is not a directory", path=output, fix="name a directory")
    existing = [name for name in OUTPUT_FILES if (output / name).exists()]
    if "tokenizer.json" in existing and (output / "tokenizer.json").samefile(tokenizer):
        existing.remove("tokenizer.json")  # packing beside the tokenizer it was given is fine
    if existing and not overwrite:
        raise UserError(
            f"output already holds {', '.join(existing)}",
            path=output,
            fix="pass --overwrite to replace them, or choose another --output",
        )
    check_writable_directory(output)


def _encode_stream(reader: CorpusReader, tokenizer: Any, dtype: np.dtype) -> Iterator[list[tuple[Piece, np.ndarray]]]:
    """Batches of (piece, token ids), each batch encoded in parallel by `encode_batch_fast`."""

    batch: list[Piece] = []
    size = 0
    for piece in reader.pieces():
        batch.append(piece)
        size += piece.text_bytes
        if size >= BATCH_TEXT_BYTES:
            yield _encode(batch, tokenizer, dtype)
            batch, size = [], 0
    if batch:
        yield _encode(batch, tokenizer, dtype)


def _encode(batch: list[Piece], tokenizer: Any, dtype: np.dtype) -> list[tuple[Piece, np.ndarray]]:
    encodings = tokenizer.encode_batch_fast([p.text for p in batch], add_special_tokens=False)
    return [(p, np.array(e.ids, dtype=dtype)) for p, e in zip(batch, encodings, strict=True)]


class _SplitChooser:
    """Which split a piece belongs to: by input list, or a seeded draw per whole document."""

    def __init__(self, train_files: int, val_fraction: float, seed: int):
        self.train_files, self.val_fraction = train_files, val_fraction
        self.rng = np.random.default_rng(seed)
        self.document, self.split = -1, "train"

    def __call__(self, piece: Piece) -> str:
        if piece.source >= self.train_files:
            return "val"
        if self.val_fraction == 0:
            return "train"
        if piece.document != self.document:
            # Documents arrive in order, so one draw per new document is deterministic in the seed.
            self.document = piece.document
            self.split = "val" if self.rng.random() < self.val_fraction else "train"
        return self.split


def pack_corpus(
    inputs: Sequence[str | Path],
    tokenizer: str | Path,
    seq_len: int,
    output: str | Path,
    val_fraction: float = 0.0,
    val_inputs: Sequence[str | Path] = (),
    seed: int = 0,
    text_field: str = "text",
    errors: str = "strict",
    overwrite: bool = False,
    progress: PackProgress | None = None,
) -> PackSummary:
    """Tokenize `inputs` into `output/{train,val}.{bin,json}` plus a copy of the tokenizer."""

    started = time.perf_counter()
    output, tokenizer_path = Path(output), Path(tokenizer)
    _check_pack_arguments(seq_len, val_fraction, val_inputs)
    loaded = load_tokenizer(tokenizer_path)
    # Text that spells a special token ("<|mask|>") is data: it must not become the real token.
    loaded.encode_special_tokens = True
    vocab_size = loaded.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    train_paths = discover_inputs(inputs)
    val_paths = discover_inputs(val_inputs) if val_inputs else []
    if shared := set(train_paths) & set(val_paths):
        raise UserError("file is both a training and a validation input", path=sorted(shared)[0])
    _check_output_dir(output, tokenizer_path, overwrite)
    reader = CorpusReader(train_paths + val_paths, text_field=text_field, errors=errors)
    wanted = ("train", "val") if val_fraction > 0 or val_paths else ("train",)

    created = [d for d in (output, *output.absolute().parents) if not d.exists()]
    output.mkdir(parents=True, exist_ok=True)
    eos = special_token_id(loaded, "eos")
    writers = {name: _SplitWriter(name, output / f"{name}.bin", dtype, eos) for name in wanted}
    committed = False
    try:
        choose = _SplitChooser(len(train_paths), val_fraction, seed)
        _stream(reader, loaded, dtype, writers, choose, progress)
        if reader.documents == 0:
            raise UserError("the corpus is empty: no text in any input file", path=train_paths[0])
        metadata = _finish_splits(writers, reader, tokenizer_path, vocab_size, seq_len, seed, val_fraction)
        _commit(output, writers, metadata, tokenizer_path)
        committed = True
    finally:
        for writer in writers.values():
            writer.close()
            writer.temporary.unlink(missing_ok=True)
            temporary_path(output / f"{writer.name}.json").unlink(missing_ok=True)
        temporary_path(output / "tokenizer.json").unlink(missing_ok=True)
        if not committed:
            _remove_empty(created)
    splits = {name: SplitSummary(output / f"{name}.bin", **_split_counts(meta)) for name, meta in metadata.items()}
    seconds = time.perf_counter() - started
    return PackSummary(
        output, vocab_size, dtype.name, seq_len, reader.total_bytes, reader.replaced_characters, seconds, splits
    )


def _stream(
    reader: CorpusReader,
    tokenizer: Any,
    dtype: np.dtype,
    writers: dict[str, _SplitWriter],
    choose: _SplitChooser,
    progress: PackProgress | None,
) -> None:
    for batch in _encode_stream(reader, tokenizer, dtype):
        for piece, ids in batch:
            writers[choose(piece)].add(ids, piece)
        for writer in writers.values():
            writer.flush()
        if progress is not None:
            tokens = sum(writer.tokens for writer in writers.values())
            progress(reader.bytes_read, reader.total_bytes, tokens)


def _split_counts(meta: dict[str, Any]) -> dict[str, int]:
    fields = ("num_blocks", "num_tokens", "dropped_tokens", "documents", "text_bytes")
    return {key: meta[key] for key in fields}


def _finish_splits(
    writers: dict[str, _SplitWriter],
    reader: CorpusReader,
    tokenizer: Path,
    vocab_size: int,
    seq_len: int,
    seed: int,
    val_fraction: float,
) -> dict[str, dict[str, Any]]:
    """Cut each split to whole blocks and build its metadata; refuse a split under one block."""

    metadata = {}
    sha256 = tokenizer_sha256(tokenizer)
    for name, writer in writers.items():
        writer.flush()
        writer.close()
        blocks = writer.tokens // seq_len
        if blocks == 0:
            raise UserError(
                f"the {name} split has {writer.tokens} tokens, fewer than one block of {seq_len}",
                fix="use a smaller --seq-len or more text"
                + (" (a larger --val-fraction or more --val-input files)" if name == "val" else ""),
            )
        itemsize = token_dtype(vocab_size).itemsize
        with open(writer.temporary, "r+b") as handle:
            handle.truncate(blocks * seq_len * itemsize)  # drop the final partial block
        metadata[name] = {
            "format": PACKED_FORMAT,
            "split": name,
            "vocab_size": vocab_size,
            "tokenizer_sha256": sha256,
            "seq_len": seq_len,
            "dtype": token_dtype(vocab_size).name,
            "num_blocks": blocks,
            "num_tokens": blocks * seq_len,
            "dropped_tokens": writer.tokens - blocks * seq_len,
            "documents": writer.documents,
            "text_bytes": writer.text_bytes,  # every document of the split, dropped tail included
            "eos_token_id": int(writer.eos[0]),
            "seed": seed,
            "val_fraction": val_fraction,
            "sources": [vars(reader.sources[i]) for i in sorted(writer.sources)],
            "dlm_version": __version__,
        }
    return metadata


def _commit(
    output: Path, writers: dict[str, _SplitWriter], metadata: dict[str, dict[str, Any]], tokenizer: Path
) -> None:
    """Rename everything into place; the metadata files, which make a split loadable, come last."""

    staged = {output / f"{name}.json": json.dumps(meta, indent=2) + "\n" for name, meta in metadata.items()}
    for final, text in staged.items():
        temporary_path(final).write_text(text, encoding="utf-8")
    target_tokenizer = output / "tokenizer.json"
    if not (target_tokenizer.exists() and target_tokenizer.samefile(tokenizer)):
        shutil.copyfile(tokenizer, temporary_path(target_tokenizer))
        temporary_path(target_tokenizer).replace(target_tokenizer)
    for name in SPLITS:  # stale metadata goes first: a half-replaced split must never load
        (output / f"{name}.json").unlink(missing_ok=True)
        if name not in writers:
            (output / f"{name}.bin").unlink(missing_ok=True)
    for writer in writers.values():
        writer.temporary.replace(writer.final)
    for final in staged:
        temporary_path(final).replace(final)


def _remove_empty(directories: list[Path]) -> None:
    """Remove the directories a failed pack created (deepest first), leaving any that hold files."""

    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


class PackedDataset:
    """Blocks of `seq_len` tokens from a packed `.bin`, read through a lazily opened `np.memmap`.

    The map is opened on first access and dropped when pickled, so each DataLoader worker maps the
    file itself (no copy is ever sent between processes). Not a `torch.utils.data.Dataset` subclass
    only to keep torch out of `dlm pack`; DataLoader needs nothing beyond `len` and indexing.
    """

    def __init__(self, path: Path, metadata: dict[str, Any]):
        self.path = path
        self.metadata = metadata
        self.seq_len = int(metadata["seq_len"])
        self.num_blocks = int(metadata["num_blocks"])
        self.dtype = np.dtype(metadata["dtype"]).newbyteorder("<")
        self._tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_blocks

    @property
    def tokens(self) -> np.ndarray:
        """All blocks as a read-only [num_blocks, seq_len] view of the file."""

        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_blocks, self.seq_len))
        return self._tokens

    def __getitem__(self, index: int) -> torch.Tensor:
        import torch

        if not -self.num_blocks <= index < self.num_blocks:
            raise IndexError(f"block {index} out of range for {self.num_blocks} blocks")
        return torch.from_numpy(self.tokens[index].astype(np.int64))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}


def _read_metadata(bin_path: Path) -> dict[str, Any]:
    meta_path = bin_path.with_suffix(".json")
    if not bin_path.is_file():
        raise UserError("packed data not found", path=bin_path, fix="create it with `dlm pack`")
    if not meta_path.is_file():
        raise UserError(
            f"metadata file {meta_path.name} is missing beside it (an interrupted pack?)",
            path=bin_path,
            fix="re-run `dlm pack`",
        )
    try:
        metadata = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"metadata is not valid JSON: {exc}", path=meta_path) from None
    if not isinstance(metadata, dict) or metadata.get("format") != PACKED_FORMAT:
        raise UserError(f"not {PACKED_FORMAT} metadata", path=meta_path, fix="re-run `dlm pack`")
    required = ("vocab_size", "tokenizer_sha256", "seq_len", "dtype", "num_blocks", "num_tokens")
    if missing := [key for key in required if key not in metadata]:
        raise UserError(f"metadata lacks {', '.join(missing)}", path=meta_path, fix="re-run `dlm pack`")
    if metadata["dtype"] not in ("uint16", "uint32"):
        raise UserError(f"unknown token dtype {metadata['dtype']!r}", path=meta_path)
    return metadata


def load_packed_dataset(path: str | Path, seq_len: int | None = None, split: str = "train") -> PackedDataset:
    """Open `path` (a `.bin` file, or a data directory and `split`) checking it against its metadata."""

    bin_path = Path(path)
    if bin_path.is_dir():
        bin_path = bin_path / f"{split}.bin"
    metadata = _read_metadata(bin_path)
    if seq_len is not None and int(metadata["seq_len"]) != seq_len:
        raise UserError(
            f"packed with seq_len {metadata['seq_len']}, but the model uses {seq_len}",
            path=bin_path,
            fix=f"set model.max_seq_len = {metadata['seq_len']} or re-pack with --seq-len {seq_len}",
        )
    expected = int(metadata["num_blocks"]) * int(metadata["seq_len"]) * np.dtype(metadata["dtype"]).itemsize
    actual = bin_path.stat().st_size
    if actual != expected:
        raise UserError(
            f"file is {actual} bytes but its metadata describes {expected} (truncated or replaced)",
            path=bin_path,
            fix="re-run `dlm pack`",
        )
    if int(metadata["num_blocks"]) < 1:
        raise UserError("packed data holds no blocks", path=bin_path, fix="re-run `dlm pack`")
    return PackedDataset(bin_path, metadata)


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed for one epoch's permutation, independent across (seed, epoch) pairs."""

    digest = hashlib.blake2b(f"dlm-data:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class DeterministicBatchSampler:
    """An endless, resumable, shardable sequence of batches of block indices.

    Global batch g (in single-process order) is chunk g % E of the seeded permutation of epoch
    g // E, where E = num_blocks // batch_size (each epoch's last partial chunk is dropped). Rank r of
    W takes global batches r, r + W, r + 2W, ...; `start_batch` counts this rank's batches already
    consumed, so iteration starts at global batch start_batch * W + r without replaying anything.
    """

    def __init__(
        self,
        num_blocks: int,
        batch_size: int,
        seed: int,
        start_batch: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if batch_size < 1 or start_batch < 0 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"invalid sampler arguments: batch_size={batch_size}, start_batch={start_batch}, "
                f"rank={rank}, world_size={world_size}"
            )
        if num_blocks < batch_size:
            raise UserError(
                f"the dataset has {num_blocks} blocks, fewer than one batch of {batch_size}",
                fix="lower training.batch_size or pack more text",
            )
        self.num_blocks, self.batch_size, self.seed = num_blocks, batch_size, seed
        self.start_batch, self.rank, self.world_size = start_batch, rank, world_size
        self.batches_per_epoch = num_blocks // batch_size

    def permutation(self, epoch: int) -> torch.Tensor:
        import torch

        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
        return torch.randperm(self.num_blocks, generator=generator)

    def global_batch(self, index: int, permutation: torch.Tensor | None = None) -> list[int]:
        """Block indices of global batch `index` (pass the epoch's permutation to reuse it)."""

        epoch, chunk = divmod(index, self.batches_per_epoch)
        order = self.permutation(epoch) if permutation is None else permutation
        return order[chunk * self.batch_size : (chunk + 1) * self.batch_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        index = self.start_batch * self.world_size + self.rank
        epoch, order = -1, None
        while True:
            if index // self.batches_per_epoch != epoch:
                epoch = index // self.batches_per_epoch
                order = self.permutation(epoch)
            yield self.global_batch(index, order)
            index += self.world_size
