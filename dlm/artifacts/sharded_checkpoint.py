"""Sharded checkpoints on disk: the `step-N/` directories that torch.distributed.checkpoint writes.

Each rank writes its own shards (`__RANK_I.distcp`) of the model, optimizer, EMA and RNG state,
and torch writes its `.metadata` (the index of every shard). A directory counts only once dlm's
marker, `dlm-checkpoint.json`, is written last by rank 0: it holds the run's plain values (step,
counters, config, tokenizer and data hashes, gradient scaler) and the sha256 of every other file.
Loading verifies those checksums before torch reads a byte, so a missing shard, a shard from
another run or a damaged one is refused by name, with the next-older complete checkpoint. DCP's
`.metadata` is a pickle: dlm reads it only once its sha256 matches the marker's.

`latest` is a symbolic link to the newest complete directory, swapped in atomically; a directory
without a marker (a save cut short by `kill -9` or a full disk) is never `latest`, and the next
run removes it with a note. This module owns the layout; `dlm.train.checkpointing` writes through
DCP, and `read_sharded_weights` consolidates the model on one process for export, eval and sampling.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlm.errors import UserError, UserNote
from dlm.fileio import atomic_write_json, fsync_directory, temporary_path

SHARDED_FORMAT = "dlm-dcp-v1"
MARKER_NAME = "dlm-checkpoint.json"
LATEST_LINK = "latest"
DCP_METADATA = ".metadata"
# The keys of the tensors in a DCP checkpoint, by part (dlm.train.checkpointing writes them).
MODEL_PREFIX, EMA_PREFIX = "model.", "ema."
_STEP_DIRECTORY = re.compile(r"^step-(\d{8,})$")
_HASH_CHUNK = 8 << 20
# A checkpoint saved or read by one process needs no process group; torch says so at every call.
_SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"
warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Around a DCP call on one process, where the filter above may have been reset (pytest does)."""

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield


class IncompleteCheckpointNote(UserNote):
    """A checkpoint directory whose save never finished was removed."""


def step_directory_name(step: int) -> str:
    return f"step-{step:08d}"


def is_sharded_checkpoint(path: Path) -> bool:
    """A `step-N/` directory (or the `latest` link to one), complete or not."""

    return path.is_dir() and (_STEP_DIRECTORY.match(path.resolve().name) is not None or (path / MARKER_NAME).exists())


def _step_directories(run_dir: Path) -> list[tuple[int, Path]]:
    if not run_dir.is_dir():
        return []
    found = []
    for path in run_dir.iterdir():
        match = _STEP_DIRECTORY.match(path.name)
        if match and path.is_dir() and not path.is_symlink():
            found.append((int(match.group(1)), path))
    return sorted(found)


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """`(step, path)` of every sharded checkpoint whose marker exists, oldest first."""

    return [(step, path) for step, path in _step_directories(run_dir) if (path / MARKER_NAME).is_file()]


def incomplete_checkpoints(run_dir: Path) -> list[Path]:
    return [path for _, path in _step_directories(run_dir) if not (path / MARKER_NAME).is_file()]


def remove_incomplete_checkpoints(run_dir: Path, keep: Iterable[Path] = ()) -> list[Path]:
    """Delete the directories of saves that never finished (rank 0, under the run lock), with a note."""

    kept = {path.resolve() for path in keep}
    removed = [path for path in incomplete_checkpoints(run_dir) if path.resolve() not in kept]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
        warnings.warn(
            f"{path}: removed a checkpoint whose save never finished (no {MARKER_NAME}); the complete ones are kept",
            IncompleteCheckpointNote,
            stacklevel=2,
        )
    return removed


def latest_sharded(run_dir: Path) -> Path | None:
    """The directory `latest` points at, when it is a complete sharded checkpoint."""

    link = run_dir / LATEST_LINK
    if not link.is_symlink() or not (link / MARKER_NAME).is_file():
        return None
    return run_dir / os.readlink(link)


def sharded_step(path: Path) -> int | None:
    match = _STEP_DIRECTORY.match(path.resolve().name)
    return int(match.group(1)) if match else None


def older_sharded_checkpoint(path: Path) -> Path | None:
    """The newest complete checkpoint beside `path` older than it."""

    own = sharded_step(path)
    older = [candidate for step, candidate in complete_checkpoints(path.resolve().parent) if own is None or step < own]
    return older[-1] if older else None


# ---------------------------------------------------------------------------------------------
# Completing a save: checksums, marker, latest, retention
# ---------------------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def rank_files(directory: Path, rank: int) -> list[Path]:
    """The shard files `rank` wrote (DCP's FileSystemWriter names them `__RANK_I.distcp`)."""

    return sorted(directory.glob(f"__{rank}_*.distcp"))


def hash_files(paths: Iterable[Path]) -> dict[str, str]:
    return {path.name: file_sha256(path) for path in paths}


def complete_checkpoint(
    directory: Path, record: Mapping[str, Any], shard_hashes: Mapping[str, str], keep_last: int
) -> Path:
    """Write the marker last (sha256 of every file), point `latest` at `directory`, prune older ones.

    Called by rank 0 once every rank's shards and DCP's `.metadata` are on disk.
    """

    files = {**shard_hashes, DCP_METADATA: file_sha256(directory / DCP_METADATA)}
    fsync_directory(directory)
    atomic_write_json(directory / MARKER_NAME, {"format": SHARDED_FORMAT, **record, "files": files})
    fsync_directory(directory)
    _point_latest(directory)
    _apply_retention(directory.parent, keep_last, directory)
    return directory


def _point_latest(directory: Path) -> None:
    link = directory.parent / LATEST_LINK
    temporary = temporary_path(link)
    temporary.unlink(missing_ok=True)
    os.symlink(directory.name, temporary)
    os.replace(temporary, link)
    fsync_directory(directory.parent)


def _apply_retention(run_dir: Path, keep_last: int, just_written: Path) -> None:
    if keep_last <= 0:
        return
    for _, path in complete_checkpoints(run_dir)[:-keep_last]:
        if path != just_written:  # after resuming from an older one, the new one may sort lower
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Reading: the marker, the verified files, the consolidated weights
# ---------------------------------------------------------------------------------------------


def _next_older_fix(directory: Path) -> str:
    older = older_sharded_checkpoint(directory)
    if older is None:
        return f"no older complete checkpoint is left in {directory.resolve().parent}; start over with --overwrite"
    resume = f"dlm resume {older.parent} --checkpoint {older.name}"
    return f"use the next-older complete checkpoint {older} (to train on from it: {resume})"


def read_marker(directory: Path) -> dict[str, Any]:
    """The marker of a complete checkpoint; a directory without one is refused by name."""

    marker = directory / MARKER_NAME
    if not marker.is_file():
        raise UserError(
            f"incomplete checkpoint: {MARKER_NAME} is missing, its save never finished",
            path=directory,
            fix=_next_older_fix(directory),
        )
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"unreadable {MARKER_NAME}: {exc}", path=marker, fix=_next_older_fix(directory)) from None
    if (
        not isinstance(record, dict)
        or record.get("format") != SHARDED_FORMAT
        or not isinstance(record.get("files"), dict)
    ):
        raise UserError(f"not a dlm sharded checkpoint marker (format {SHARDED_FORMAT})", path=marker)
    # DCP's .metadata is a pickle and its shards may hold pickled values: every file DCP could read must
    # be one the marker vouches for (by sha256, checked before a byte is read), or the directory is not
    # dlm's own. Files DCP never reads (a .DS_Store a file browser left) do not matter.
    listed = record["files"]
    unlisted = sorted(path.name for path in directory.iterdir() if _read_by_dcp(path.name) and path.name not in listed)
    if DCP_METADATA not in listed or unlisted:
        what = f"{unlisted[0]} is not listed in" if unlisted else f"{DCP_METADATA} (a pickle) is not listed in"
        raise UserError(
            f"{what} {MARKER_NAME}: this step directory holds files dlm did not write",
            path=directory,
            fix="use a checkpoint dlm wrote (step directories are trusted input: load only your "
            "own), or delete the files it does not list",
        )
    return record


def _read_by_dcp(name: str) -> bool:
    """Whether DCP's reader may open a file of this name in a step directory: its index and shards."""

    return name.startswith(DCP_METADATA) or name.endswith(".distcp")


def check_files(directory: Path, record: Mapping[str, Any], names: Iterable[str] | None = None) -> None:
    """Every file the marker lists (or `names` of them) exists and has its recorded sha256."""

    files: Mapping[str, str] = record["files"]
    for name in sorted(files) if names is None else names:
        path = directory / name
        if not path.is_file():
            raise UserError(
                f"shard {name} of this checkpoint is missing", path=directory, fix=_next_older_fix(directory)
            )
        if file_sha256(path) != files[name]:
            raise UserError(
                f"shard {name} does not match the sha256 in {MARKER_NAME}: it is damaged or from another run",
                path=path,
                fix=_next_older_fix(directory),
            )


def tensor_entries(directory: Path) -> dict[str, Any]:
    """DCP's description (size, dtype) of every tensor in a checkpoint whose files were verified."""

    # lazy (here and below): torch.distributed.checkpoint takes ~0.4 s to import; only sharded
    # checkpoints need it, so `dlm sample`, `dlm eval` and `dlm export` of a .pt run start without it.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {key: meta for key, meta in entries.items() if isinstance(meta, TensorStorageMetadata)}


def read_sharded_tensors(directory: Path, keys: Iterable[str], entries: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors `keys`, whole, on this process, from a checkpoint whose files were verified.

    DCP reads each piece of every shard straight into one preallocated full tensor: the result is
    the only copy in memory, whatever the world size that saved it.
    """

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    targets = {key: torch.empty(entries[key].size, dtype=entries[key].properties.dtype) for key in keys}
    with single_process_quiet():
        dcp.load(targets, storage_reader=FileSystemReader(str(directory)), no_dist=True)
    return targets


@dataclass(frozen=True)
class ShardedWeights:
    """The model's weights in a verified sharded checkpoint, read one tensor at a time.

    `sources` maps each weight name to the DCP key it is read from: the EMA's (float32) for the
    parameters it tracks when wanted, the model's otherwise; `dtypes` are the model's own.
    """

    directory: Path
    record: dict[str, Any]
    kind: str  # "ema" | "live"
    sources: dict[str, str]
    entries: dict[str, Any]
    dtypes: dict[str, Any]

    @property
    def names(self) -> list[str]:
        return sorted(self.sources)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[self.sources[name]].size)

    def read(self, name: str) -> Any:
        """One whole tensor, in the model's dtype; the only copy of it this reads into memory."""

        key = self.sources[name]
        return read_sharded_tensors(self.directory, [key], self.entries)[key].to(self.dtypes[name])


def open_sharded_weights(directory: Path, use_ema: bool = True) -> ShardedWeights:
    """The marker, checked files and tensor index of a sharded checkpoint, nothing read yet."""

    directory = directory.resolve()
    record = read_marker(directory)
    check_files(directory, record)
    entries = tensor_entries(directory)
    model = {key.removeprefix(MODEL_PREFIX): key for key in entries if key.startswith(MODEL_PREFIX)}
    average = {key.removeprefix(EMA_PREFIX): key for key in entries if key.startswith(EMA_PREFIX)}
    use_average = bool(use_ema and record.get("ema") and average.keys() & model.keys())
    sources = {name: average.get(name, key) if use_average else key for name, key in model.items()}
    dtypes = {name: entries[key].properties.dtype for name, key in model.items()}
    return ShardedWeights(directory, record, "ema" if use_average else "live", sources, entries, dtypes)


def read_sharded_weights(directory: Path, use_ema: bool = True) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(marker, model weights, "ema" | "live") of a sharded checkpoint, gathered on this process,
    tensor by tensor (the EMA's in place of the parameters it tracks when wanted; never the
    optimizer's)."""

    weights = open_sharded_weights(directory, use_ema)
    return weights.record, {name: weights.read(name) for name in weights.names}, weights.kind
