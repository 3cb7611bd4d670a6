"""The one exception type for mistakes a user can fix.

Library code raises `UserError` where it detects bad input, naming the file, the field and the
fix; the CLI renders it once as a red `error: ...` line and exits with code 2. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

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
