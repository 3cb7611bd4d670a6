"""The one exception type for mistakes a user can fix.

Library code raises `UserError` where it detects bad input, naming the file, the field and the
fix; the CLI renders it once as a red `error: ...` line and exits with code 2. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class UserError(Exception):
    """Bad input: a config, a file or an option the user can correct."""

    exit_code = 2

    def __init__(self, message: str, *, path: str | Path | None = None, fix: str | None = None):
        self.path = None if path is None else str(path)
        self.fix = fix
        text = message if self.path is None else f"{self.path}: {message}"
        if fix:
            text = f"{text} ({fix})"
        super().__init__(text)


class UserNote(UserWarning):
    """Something the user should know that does not stop the command (the CLI prints `warning: ...`)."""


@contextmanager
def reported_os_errors(what: str, path: str | Path) -> Iterator[None]:
    """Turn a failed write (full disk, file size limit, permissions) into a `UserError`.

    safetensors reports the same failures as its own error type; it is converted too, recognised
    by name so that this module (imported by every command) does not import safetensors.
    """

    try:
        yield
    except OSError as exc:
        raise UserError(f"cannot write {what}: {exc.strerror or exc}", path=path, fix=_WRITE_FIX) from None
    except Exception as exc:
        if type(exc).__name__ != "SafetensorError":
            raise
        raise UserError(f"cannot write {what}: {exc}", path=path, fix=_WRITE_FIX) from None


_WRITE_FIX = "free some disk space, or choose a location you can write to"


def check_can_create(path: str | Path, option: str) -> None:
    """Before any slow work: refuse an output whose directory cannot hold it."""

    existing = Path(path).absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{option}: {existing} is not a directory", path=path, fix="choose another location")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{option}: {existing} is not writable", path=path, fix="choose a directory you can write to")
