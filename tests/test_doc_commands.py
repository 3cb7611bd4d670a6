"""Every `dlm ...` command line in the README and docs/ uses options its command really has."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import typer

from dlm.cli import app

ROOT = Path(__file__).resolve().parents[1]


def _command_lines() -> list[tuple[str, str]]:
    lines = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("dlm ") and not line.startswith("dlm ..."):
                lines.append((path.name, line.split("  #")[0].split(" # ")[0]))
    return lines


def _resolve(words: list[str]) -> tuple[Any, list[str]]:
    command = typer.main.get_command(app)
    words = words[1:]
    while words and words[0] in getattr(command, "commands", {}):  # a group: descend
        command, words = command.commands[words[0]], words[1:]
    return command, words


def test_documented_options_exist() -> None:
    unknown = []
    for name, line in _command_lines():
        try:
            words = shlex.split(line)
        except ValueError:
            continue  # a line continued on the next one
        command, rest = _resolve(words)
        known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        for word in rest:
            option = word.split("=")[0]
            if re.fullmatch(r"--[a-z][a-z0-9-]*", option) and option not in known | {"--help"}:
                unknown.append(f"{name}: {line}: {option}")
    assert not unknown, "\n".join(unknown)


def test_the_held_out_example_keeps_validation_outside_the_training_inputs() -> None:
    for name, line in _command_lines():
        if "--val-input" in line and line.startswith("dlm pack"):
            words = shlex.split(line)
            held_out = words[words.index("--val-input") + 1]
            training = [w for w in words[2 : words.index("--val-input")] if not w.startswith("-")]
            assert all(not held_out.startswith(t) for t in training), f"{name}: {line}"
