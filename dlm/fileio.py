"""Files on disk: atomic writes, the one temporary-name scheme, writability and free-space checks.

Every file dlm writes as a whole (checkpoints, exports, packed data, tokenizers, reports, a run's
config.json, the demo's files) is written to `temporary_path(final)`, a hidden sibling named
`.NAME.tmp-PID`, then renamed over `final`: a reader sees the old file or the new one, never half of
one. A write that fails removes its temporary; the temporary of a killed process is recognised by
its name and removed by the next writer (`remove_stale_temporaries`) once that process is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dlm.errors import UserError

GIB = float(1 << 30)  # bytes in a GiB: the unit of every disk and memory figure dlm reports
_TEMPORARY_NAME = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)")


def temporary_path(final: Path) -> Path:
    """A hidden sibling of `final` that no loader mistakes for the real file (unique per process)."""

    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def is_within(path: Path, directory: Path) -> bool:
    """Whether `path` is `directory` or lies under it, symbolic links followed."""

    inner, outer = Path(path).resolve(), Path(directory).resolve()
    return inner == outer or outer in inner.parents


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending anything)."""

    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process; a number beyond any pid
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def remove_stale_temporaries(directory: Path, names: Iterable[str] | None = None) -> list[Path]:
    """Remove the `temporary_path`s in `directory` (of `names`, or of any file when None) whose
    process is gone: a killed writer never renamed or removed them. A live process's are kept."""

    wanted = None if names is None else set(names)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for entry in sorted(directory.iterdir()):
        match = _TEMPORARY_NAME.fullmatch(entry.name)
        if match is None or (wanted is not None and match["name"] not in wanted):
            continue
        if entry.is_file() and not process_alive(int(match["pid"])):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def temporaries(directory: Path) -> list[Path]:
    """Every temporary in `directory`, whatever its process (for a caller that owns the directory)."""

    return [entry for entry in directory.glob(".*.tmp-*") if _TEMPORARY_NAME.fullmatch(entry.name)]


def fsync_directory(directory: Path) -> None:
    """Make a rename durable; some platforms / filesystems cannot fsync a directory."""

    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


@contextlib.contextmanager
def atomic_path(final: Path, durable: bool = False) -> Iterator[Path]:
    """Yield the temporary to write `final` through; on success it replaces `final`, on any
    failure (an exception, a signal) it is removed and `final` is untouched. `durable` fsyncs the
    file before and the directory after the rename (checkpoints: a power cut keeps one of them)."""

    temporary = temporary_path(final)
    try:
        yield temporary
        if durable and temporary.is_file():
            fsync_file(temporary)
        os.replace(temporary, final)
    except BaseException:
        if temporary.is_dir() and not temporary.is_symlink():
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            temporary.unlink(missing_ok=True)
        raise
    if durable:
        fsync_directory(final.parent)


def swap_directory_into_place(built: Path, output: Path) -> None:
    """Rename the finished directory `built` to `output`, replacing an old one only at the very end:
    a failed rename puts the old directory back rather than leave nothing."""

    if not output.exists():
        built.rename(output)
        return
    retired = output.with_name(f".{output.name}.old-{os.getpid()}")
    output.rename(retired)
    try:
        built.rename(output)
    except OSError:
        retired.rename(output)
        raise
    shutil.rmtree(retired)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = False) -> Path:
    with atomic_path(path, durable) as temporary:
        temporary.write_bytes(data)
    return path


def atomic_write_text(path: Path, text: str, durable: bool = False) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), durable)


def atomic_write_json(path: Path, data: Any, ensure_ascii: bool = True) -> Path:
    """`data` as indented JSON with a final newline (config.json, reports, the demo's files)."""

    return atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=ensure_ascii) + "\n")


def share_as_created(path: Path) -> None:
    """Give `path` the mode a file created here normally gets (0666 less the umask): writers such as
    safetensors create 0600, and an export is made to be shared."""

    mask = os.umask(0o22)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


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


def probe_writable(directory: Path) -> None:
    """Create and remove a temporary in `directory`: the OSError a real write would meet, if any."""

    probe = temporary_path(directory / "write-probe")
    with open(probe, "xb"):
        pass
    probe.unlink()


def format_bytes(count: float) -> str:
    """1.5 KiB, 20.0 MiB, 3.2 GiB, 384.5 TiB (TiB is the largest unit)."""

    if abs(count) < 1024:
        return f"{count:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if abs(count) < 1024:
            return f"{count:.1f} {unit}"
    return f"{count / 1024:.1f} TiB"


def check_free_space(directory: Path, bytes_needed: int, what: str, fix: str) -> None:
    """Refuse to start a write of about `bytes_needed` bytes that the disk of `directory` cannot hold."""

    free = shutil.disk_usage(directory).free
    if free < bytes_needed:
        raise UserError(
            f"only {format_bytes(free)} free on its disk, {what} needs about {format_bytes(bytes_needed)}",
            path=directory,
            fix=fix,
        )
