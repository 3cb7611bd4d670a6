"""The eval report `dlm eval` writes into a run directory, as its readers check it.

`dlm report` draws it and `dlm export` quotes it in the model card; both leave out a report whose
fields have the wrong JSON types, saying which one, rather than fail on it. `dlm eval --output`
checks where it will write one before it evaluates (`check_eval_output`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dlm.errors import UserError, check_can_create

EVAL_FORMAT_PREFIX = "dlm-eval"

# The fields of an eval report the page reads, by the JSON type each must have (absent is fine).
EVAL_FIGURES = (
    "nll",
    "nll_stderr",
    "bits_per_byte",
    "bits_per_byte_stderr",
    "unigram_bits_per_byte",
    "perplexity_bound",
    "fixed_noise_loss",
    "fixed_noise_accuracy",
)
_EVAL_COUNTS = ("sequences", "tokens")


def _is_number(value: object, allow_float: bool = True) -> bool:
    kinds = (int, float) if allow_float else (int,)
    return isinstance(value, kinds) and not isinstance(value, bool)  # JSON true is not a figure


def eval_report_problem(report: dict[str, Any]) -> str | None:
    """What makes an eval report unfit for the page (a field of the wrong type), or None."""

    context = report.get("context", {})
    if not isinstance(context, dict):
        return "its context is not an object"
    if context.get("step") is not None and not _is_number(context["step"], allow_float=False):
        return "its context.step is not an integer"
    if bad := [key for key in EVAL_FIGURES if report.get(key) is not None and not _is_number(report[key])]:
        return f"{bad[0]} is not a number"
    if bad := [key for key in _EVAL_COUNTS if report.get(key) is not None and not _is_number(report[key], False)]:
        return f"{bad[0]} is not an integer"
    notes = report.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(note, str) for note in notes):
        return "its notes are not a list of strings"
    return None


def is_eval_report(path: Path) -> bool:
    """Whether `path` holds an eval report `dlm eval` wrote (a JSON object with its format tag)."""

    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # ValueError: invalid JSON or UTF-8
        return False
    return isinstance(report, dict) and str(report.get("format", "")).startswith(EVAL_FORMAT_PREFIX)


def check_report_path(path: Path) -> None:
    """Where an eval report can go: a file name, in a directory that exists."""

    if path.is_dir():
        raise UserError("--output is a directory", path=path, fix="name a file, e.g. eval.json")
    if not path.parent.is_dir():
        raise UserError("the directory of --output does not exist", path=path, fix="create it first")


def check_eval_output(output: Path, overwrite: bool) -> None:
    """Before an evaluation that can take minutes: an earlier eval report is replaced, any other file
    only with `overwrite`, a directory never, and the directory must exist and be writable."""

    check_can_create(output, "--output")
    check_report_path(output)
    if output.exists() and not overwrite and not is_eval_report(output):
        raise UserError(
            "output exists and is not an eval report dlm wrote",
            path=output,
            fix="pass --overwrite to replace it, or pick another",
        )
