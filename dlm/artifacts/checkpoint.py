"""Checkpoints: atomic saves, retention, `latest.pt`, safe loading, and the run-directory lock.

A save never exposes a half-written file under a real name: data goes to a temporary file in the
same directory (`dlm.fileio.atomic_path`), is fsynced, then renamed into place (atomic on POSIX). `latest.pt`
is a hard link to the newest numbered file, itself swapped in atomically, so `kill -9` at any
moment leaves the previous `latest.pt` intact; a save that fails (a full disk) removes its
temporary file and reports a `UserError`. Every payload carries a sha256 of its contents
(`dlm.artifacts.checksum`), verified on load: a damaged file is refused, naming the next-older checkpoint.
Loading always uses `torch.load(weights_only=True)`: a file that would need arbitrary pickle code is
refused, never loaded unsafely.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from dlm.artifacts.checksum import CHECKSUM_KEY, payload_sha256, with_checksum
from dlm.errors import UserError, UserNote
from dlm.fileio import atomic_path, check_free_space, probe_writable, remove_stale_temporaries

try:
    import fcntl
except ImportError:  # Windows: no flock; RunLock records the pid but cannot enforce exclusivity
    fcntl = None  # type: ignore[assignment]

# One source of truth for the format names; anything else is refused on load.
TRAINING_FORMAT = "dlm-checkpoint-v1"
INFERENCE_FORMAT = "dlm-inference-v1"
KNOWN_FORMATS = (TRAINING_FORMAT, INFERENCE_FORMAT)

LATEST_NAME = "latest.pt"
INFERENCE_NAME = "inference-latest.pt"
LOCK_NAME = ".lock"
_STEP_FILE = re.compile(r"^step-(\d{8,})\.pt$")


class UnverifiedCheckpointWarning(UserNote):
    """A checkpoint saved before checksums existed: loaded, but its bytes cannot be verified."""


# ---------------------------------------------------------------------------------------------
# Atomic saves (through dlm.fileio) and their errors
# ---------------------------------------------------------------------------------------------


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write: torch.save reports one as a RuntimeError whose context
    is the OSError that the file object raised."""

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _write_failed(path: Path, exc: BaseException) -> UserError:
    error = _os_error(exc)
    reason = (error.strerror or str(error)) if error is not None else str(exc)
    return UserError(
        f"could not write {path.name}: {reason}; it was not saved, and no earlier file was touched",
        path=path.parent,
        fix=f"free some disk space (or raise the file size limit), then continue with: dlm resume {path.parent}",
    )


def _atomic_torch_save(obj: Any, path: Path) -> None:
    try:
        # Through a Python file object: a full disk then surfaces as the OSError behind torch's error.
        with atomic_path(path, durable=True) as temporary, open(temporary, "wb") as handle:
            torch.save(obj, handle)
    except (OSError, RuntimeError) as exc:
        if _os_error(exc) is None:
            raise
        raise _write_failed(path, exc) from None


def _atomic_link(source: Path, target: Path) -> None:
    """Point `target` at `source`'s data: a hard link (no second copy), else a full copy."""

    try:
        with atomic_path(target, durable=True) as temporary:
            try:
                os.link(source, temporary)
            except OSError:  # filesystems without hard links (some network / FUSE mounts)
                shutil.copyfile(source, temporary)
    except OSError as exc:
        raise _write_failed(target, exc) from None


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def step_checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def numbered_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """`(step, path)` of every `step-*.pt` in the directory, oldest step first."""

    directory = Path(output_dir)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _STEP_FILE.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def _apply_retention(directory: Path, keep_last: int, just_written: Path) -> None:
    if keep_last <= 0:
        return
    for _, path in numbered_checkpoints(directory)[:-keep_last]:
        # After resuming from an older checkpoint the new file can sort below abandoned later
        # ones; the file just written is always kept.
        if path != just_written:
            path.unlink(missing_ok=True)


def save_training_checkpoint(output_dir: str | Path, payload: dict[str, Any], step: int, keep_last: int) -> Path:
    """Write `step-{step:08d}.pt` atomically, point `latest.pt` at it, prune to `keep_last`.

    `payload` is built by the caller (step, config, model, optimizer, RNG states ...) and must
    hold only what `torch.load(weights_only=True)` accepts; `format` is stamped when absent.
    `keep_last = 0` keeps every numbered file. Returns the numbered path.
    """

    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if payload.get("format", TRAINING_FORMAT) != TRAINING_FORMAT:
        raise ValueError(f"a training checkpoint has format {TRAINING_FORMAT!r}, got {payload['format']!r}")
    if "step" in payload and int(payload["step"]) != step:
        raise ValueError(f"payload step {payload['step']} disagrees with step {step}")
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory)
    path = directory / step_checkpoint_name(step)
    _atomic_torch_save(with_checksum({**payload, "format": TRAINING_FORMAT}), path)
    _atomic_link(path, directory / LATEST_NAME)
    _apply_retention(directory, keep_last, path)
    return path


def inference_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies with floating tensors in bf16; tensors that share storage stay shared.

    The tied embedding / LM head appears under two names with one storage; converting each name
    separately would store it twice, so conversions are memoised by storage and view geometry.
    """

    converted: dict[str, torch.Tensor] = {}
    by_view: dict[tuple[Any, ...], torch.Tensor] = {}
    for name, tensor in state_dict.items():
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        value = by_view.get(key)
        if value is None:
            dtype = torch.bfloat16 if tensor.is_floating_point() else tensor.dtype
            value = tensor.detach().to(device="cpu", dtype=dtype, copy=True)
            by_view[key] = value
        converted[name] = value
    return converted


def save_inference_checkpoint(
    output_dir: str | Path, state_dict: Mapping[str, torch.Tensor], metadata: dict[str, Any]
) -> Path:
    """Write the compact bf16 `inference-latest.pt` (weights plus `metadata`) atomically."""

    clashes = {"format", "model", CHECKSUM_KEY} & metadata.keys()
    if clashes:
        raise ValueError(f"metadata may not set {sorted(clashes)}: they are written by this function")
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"format": INFERENCE_FORMAT, **metadata, "model": inference_state_dict(state_dict)}
    path = directory / INFERENCE_NAME
    _atomic_torch_save(with_checksum(payload), path)
    return path


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


# torch's weights-only loader names a refused global in either of two phrasings: "Unsupported
# global: GLOBAL mod.name was not an allowed global" or "unsupported GLOBAL mod.name whose module
# mod is blocked".
_BLOCKED_GLOBAL = re.compile(r"\bGLOBAL\s+([\w.]+?)\.?(?:\s|$)")
# Lines of torch's advice around the reason, which say nothing about this file.
_BOILERPLATE = (
    "Weights only load failed",
    "(1)",
    "(2)",
    "Check the documentation",
    "Re-running",
    "In PyTorch",
    "Please file",
)


def _refusal(exc: Exception) -> str:
    """A one-line reason from torch's (long, multi-paragraph) weights-only error."""

    text = str(exc)
    blocked = _BLOCKED_GLOBAL.search(text)
    if blocked:
        return (
            f"it contains Python objects ({blocked.group(1)}) that only unsafe pickle loading could rebuild; "
            "dlm never loads checkpoints that way"
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reasons = [line.removeprefix("WeightsUnpickler error:").strip() for line in lines]
    reasons = [line for line in reasons if line and not line.startswith(_BOILERPLATE)]
    reason = reasons[0] if reasons else type(exc).__name__
    if len(reason) > 160:  # cut at a word, never inside one
        reason = reason[:160].rsplit(" ", 1)[0] + " ..."
    return f"it is not a torch checkpoint or it is damaged ({reason})"


def _format_label(fmt: str) -> str:
    return "training checkpoint" if fmt == TRAINING_FORMAT else "inference checkpoint"


def load_checkpoint(path: str | Path, expected_format: str | None = None) -> dict[str, Any]:
    """Load a dlm checkpoint safely (weights only, onto the CPU); a directory means DIR/latest.pt.

    Anything that is not a dict with a known `format` (or not `expected_format`, when given) is
    refused with a `UserError` naming the file.
    """

    if expected_format is not None and expected_format not in KNOWN_FORMATS:
        raise ValueError(f"expected_format must be one of {KNOWN_FORMATS}, got {expected_format!r}")
    path = Path(path)
    if path.is_dir():
        if not (path / LATEST_NAME).exists():
            raise UserError(
                f"no {LATEST_NAME} in this directory",
                path=path,
                fix="pass a run directory that has saved a checkpoint, or a checkpoint file",
            )
        path = path / LATEST_NAME
    if not path.exists():
        raise UserError("checkpoint not found", path=path, fix="check the path")
    try:
        with warnings.catch_warnings():
            # torch warns about foreign pickle protocols before refusing them; the refusal is
            # reported below, once, as a UserError.
            warnings.simplefilter("ignore")
            data = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise UserError(f"cannot read the checkpoint: {exc.strerror or exc}", path=path) from None
    except Exception as exc:  # torch.load raises many types on foreign bytes (KeyError, EOFError...)
        # A file cut short (a crash, a full disk) beside older checkpoints: say which one to go on from.
        older = older_checkpoint(path) if path.suffix == ".pt" else None
        fix = None if older is None else f"if it was cut short, go on from {older}: " + _resume_from(path, older)
        raise UserError(f"not a dlm checkpoint: {_refusal(exc)}", path=path, fix=fix) from None
    if not isinstance(data, dict):
        raise UserError(f"not a dlm checkpoint: it holds a {type(data).__name__}, not a dict", path=path)
    fmt = data.get("format")
    if fmt not in KNOWN_FORMATS:
        found = "it has no format field" if fmt is None else f"unknown format {fmt!r}"
        raise UserError(
            f"not a dlm checkpoint: {found}",
            path=path,
            fix=f"dlm reads only {' and '.join(KNOWN_FORMATS)} files",
        )
    if expected_format is not None and fmt != expected_format:
        raise UserError(
            f"this is a {_format_label(fmt)} ({fmt}), a {_format_label(expected_format)} "
            f"({expected_format}) is needed here",
            path=path,
            fix="use latest.pt or step-*.pt to resume training, inference-latest.pt or an exported model to sample",
        )
    _verify_checksum(data, path)
    if "model" in data:
        _check_tensor_map(data["model"], path, "model")
    ema = data.get("ema")
    if ema is not None:
        _check_tensor_map(ema.get("shadow") if isinstance(ema, dict) else None, path, "ema.shadow")
    check_finite_weights(data.get("model"), path, step=data.get("step"))
    if isinstance(ema, dict):
        check_finite_weights(ema.get("shadow"), path, "EMA weights", step=data.get("step"))
    return data


def _check_tensor_map(weights: object, path: Path, field: str) -> None:
    """Refuse a checkpoint whose `field` is not weights: a map of tensor names to tensors."""

    if not isinstance(weights, Mapping) or not all(
        isinstance(name, str) and isinstance(tensor, torch.Tensor) for name, tensor in weights.items()
    ):
        raise UserError(
            f"not a dlm checkpoint: its {field} field is not a map of tensor names to tensors",
            path=path,
            fix="dlm reads the checkpoints dlm writes; export the model again from its run",
        )


def check_finite_weights(
    weights: object, path: Path, what: str = "weights", step: object = None, fix: str | None = None
) -> None:
    """Refuse weights that hold a NaN or an inf, naming the first such tensor.

    Such a model computes NaN for every token, so evaluating, sampling, exporting or training it
    would only spread the damage (an eval would print NaN figures and exit 0). Anything but a dict
    of tensors is left to the caller's own checks.
    """

    if not isinstance(weights, Mapping):
        return
    bad = [
        name
        for name, tensor in weights.items()
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not _all_finite(tensor)
    ]
    if not bad:
        return
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    older = older_checkpoint(path, step) if path.suffix == ".pt" and path.is_file() else None
    earlier = f"use the earlier checkpoint {older}" if older is not None else "use an earlier checkpoint or export"
    raise UserError(
        f"the {what} hold NaN or inf values: tensor {bad[0]}{more}; such a model computes only NaN",
        path=path,
        fix=fix or f"{earlier}, or train it again (lower training.learning_rate or use bfloat16 instead of float16)",
    )


def _all_finite(tensor: torch.Tensor) -> bool:
    """Exact, and cheap in the usual case: a NaN or an inf makes the sum non-finite, so a finite sum
    proves every element finite with one reduction (2 to 3x faster than `isfinite` on the CPU, which
    writes a mask as large as the tensor); only a non-finite sum, which an overflow of large finite
    values can give too, is checked element by element."""

    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _verify_checksum(data: dict[str, Any], path: Path) -> None:
    stored = data.get(CHECKSUM_KEY)
    if stored is None:
        warnings.warn(
            f"{path}: saved without a checksum (by an older dlm), so it is loaded unverified",
            UnverifiedCheckpointWarning,
            stacklevel=3,
        )
        return
    if stored == payload_sha256(data):
        return
    older = older_checkpoint(path, data.get("step"))
    if data.get("format") == INFERENCE_FORMAT:
        fix = f"use the run's training checkpoint {path.parent / LATEST_NAME} instead"
    elif older is None:
        fix = f"no older checkpoint is left in {path.parent}; start the run over with: dlm train --overwrite"
    else:
        fix = f"use the next-older checkpoint {older}: " + _resume_from(path, older)
    raise UserError("the checkpoint is damaged: its contents do not match the sha256 saved in it", path=path, fix=fix)


def _resume_from(path: Path, older: Path) -> str:
    return f"dlm resume {path.parent} --checkpoint {older.name}"


def older_checkpoint(path: Path, step: object = None) -> Path | None:
    """The newest numbered checkpoint beside `path` that is older than it (None when there is none).

    The step of `path` comes from its name, from the numbered file it is a hard link of, or else
    from its (possibly damaged) `step` field.
    """

    numbered = numbered_checkpoints(path.parent)
    match = _STEP_FILE.match(path.name)
    own = int(match.group(1)) if match else None
    for number, candidate in numbered:
        if own is None and os.path.samefile(candidate, path):
            own = number
    if own is None and isinstance(step, int):
        own = step
    older = [candidate for number, candidate in numbered if own is None or number < own]
    older = [candidate for candidate in older if not os.path.samefile(candidate, path)]
    return older[-1] if older else None


# ---------------------------------------------------------------------------------------------
# Run directory: one run at a time, and room to save
# ---------------------------------------------------------------------------------------------


class RunLock:
    """An exclusive lock on `output_dir/.lock` for the lifetime of one training run.

    `flock` locks belong to the open file, so the kernel drops them when the process dies (even
    by `kill -9`): a stale lock file never blocks the next run. The file keeps the holder's pid
    for the error message; it is not deleted on release, because deleting a lock file races with
    a process that has just opened it.
    """

    def __init__(self, output_dir: str | Path) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_NAME
        self.enforced = fcntl is not None
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        check_directory(self.output_dir)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.lseek(fd, 0, os.SEEK_SET)
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise UserError(
                    f"another dlm run is using {self.output_dir} (pid {holder})",
                    fix="wait for it to finish, stop it, or set a different training.output_dir",
                ) from None
            except OSError as exc:
                os.close(fd)
                raise UserError(
                    f"cannot lock the run directory: {exc.strerror or exc}",
                    path=self.path,
                    fix="put training.output_dir on a local filesystem",
                ) from None
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


def check_directory(directory: Path) -> None:
    """Create `directory` if needed; refuse a path that is a file or cannot be created."""

    if directory.exists() and not directory.is_dir():
        raise UserError(
            "training.output_dir exists and is not a directory",
            path=directory,
            fix="choose another training.output_dir",
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"cannot create the output directory: {exc.strerror or exc}",
            path=directory,
            fix="choose a training.output_dir you can write to",
        ) from None


def check_output_dir(output_dir: str | Path, bytes_needed: int) -> None:
    """Before training: the run directory exists, is writable and has room for a checkpoint."""

    directory = Path(output_dir)
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    # Measured on the disk the directory will be on, before it is created: a refusal creates nothing.
    if existing.is_dir():
        fix = "free some space or set training.output_dir on a larger disk"
        check_free_space(existing, bytes_needed, "one checkpoint", fix)
    check_directory(directory)
    try:
        probe_writable(directory)
    except OSError as exc:
        raise UserError(
            f"the output directory is not writable: {exc.strerror or exc}",
            path=directory,
            fix="fix its permissions or choose another training.output_dir",
        ) from None
