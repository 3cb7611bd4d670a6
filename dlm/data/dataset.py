"""Packed token data: the memory-mapped dataset and the deterministic batch sampler.

`dlm pack` (`dlm.data.pack.pack_corpus`) writes a split as `NAME.bin` (raw little-endian
uint16, or uint32 when the vocabulary does not fit) plus `NAME.json` (metadata); `load_packed_dataset`
opens one, checking the file against its metadata.

torch is imported only where a tensor is made: `dlm pack` never touches it and starts in a fraction
of the seconds a torch import costs.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dlm.data.pack import PACKED_FORMAT
from dlm.errors import UserError, UserNote

if TYPE_CHECKING:
    import torch


COUNT_CHUNK_TOKENS = 1 << 22  # tokens counted at a time: bincount widens to int64, so never the whole split


def token_counts(dataset: Any, vocab_size: int, max_tokens: int | None = None) -> np.ndarray:
    """Occurrences (int64) of each of `vocab_size` ids among the first `max_tokens` (default: all)
    tokens of a packed split, counted in chunks so a large split costs no more memory than a small one."""

    flat = np.asarray(dataset.tokens).reshape(-1)[:max_tokens]
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, flat.size, COUNT_CHUNK_TOKENS):
        counts += np.bincount(flat[start : start + COUNT_CHUNK_TOKENS], minlength=vocab_size)[:vocab_size]
    return counts


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
        # Instruction data (`dlm pack --chat`) has a uint8 loss mask beside it: 1 where a token is learned.
        self.mask_path = path.with_name(metadata["loss_mask"]) if metadata.get("loss_mask") else None
        self._mask: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_blocks

    @property
    def tokens(self) -> np.ndarray:
        """All blocks as a read-only [num_blocks, seq_len] view of the file."""

        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_blocks, self.seq_len))
        return self._tokens

    def __getitem__(self, index: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A block's tokens, or (tokens, loss mask) for instruction data (`dlm.diffusion.objective.split_batch`)."""

        import torch

        if not -self.num_blocks <= index < self.num_blocks:
            raise IndexError(f"block {index} out of range for {self.num_blocks} blocks")
        tokens = torch.from_numpy(self.tokens[index].astype(np.int64))
        if self.mask_path is None:
            return tokens
        if self._mask is None:
            self._mask = np.memmap(self.mask_path, dtype=np.uint8, mode="r", shape=(self.num_blocks, self.seq_len))
        return tokens, torch.from_numpy(self._mask[index] != 0)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None, "_mask": None}


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
    mask = bin_path.with_name(metadata["loss_mask"]) if metadata.get("loss_mask") else None
    tokens = expected // np.dtype(metadata["dtype"]).itemsize
    if mask is not None and (not mask.is_file() or mask.stat().st_size != tokens):
        raise UserError(
            f"the loss mask {mask.name} is missing or not one byte per token",
            path=bin_path,
            fix="re-run `dlm pack --chat`",
        )
    if isinstance(metadata.get("chat"), dict) and metadata["chat"].get("mask_padding"):
        warnings.warn(
            UserNote(
                f"{bin_path}: packed with --mask-padding, which dlm no longer offers: its padding "
                "is visible and unlearned, which shows the model in training where each reply ends, "
                "as it never sees when sampling (docs/finetune.md); re-pack without it"
            ),
            stacklevel=2,
        )
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
