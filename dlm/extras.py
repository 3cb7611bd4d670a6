"""Optional packages: which dlm extra installs each one, and the one error when it is missing.

Readers (Parquet, zstd, saved datasets), training loggers, the harness adapter, the report page and
optional optimizers all ask here, so a missing package is refused the same way everywhere.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from dlm.errors import UserError


@dataclass(frozen=True)
class Requirement:
    """An optional package a feature needs, and the dlm extra that installs it."""

    module: str
    extra: str
    what: str  # "reading .parquet files"


def optional_module(name: str) -> ModuleType | None:
    """The module `name`, or None when it (or a package it needs) is not installed."""

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def require(requirement: Requirement, path: str | Path | None = None) -> ModuleType:
    """The module, or one `UserError` naming the extra to install."""

    module = optional_module(requirement.module)
    if module is None:
        package = requirement.module.split(".")[0]
        raise UserError(
            f"{requirement.what} needs {package}, which is not installed",
            path=path,
            fix=f"pip install 'dlm[{requirement.extra}]'",
        )
    return module
