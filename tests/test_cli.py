"""CLI conventions shared by every command: help, version, user errors, JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from dlm import __version__
from dlm.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def run_dlm(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dlm", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_help_lists_every_workflow() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in (
        "config",
        "tokenizer",
        "pack",
        "validate",
        "train",
        "resume",
        "eval",
        "bench",
        "export",
        "sample",
        "demo",
    ):
        assert command in result.output, command


def test_the_cli_runs_with_a_typer_that_shows_flags_plainly() -> None:
    # Typer before 0.28 has no display_type_rich (the version some GPU images carry): the help of a flag
    # needs no correction there, and the CLI must not fail at import.
    code = (
        "import typer.core; del typer.core.TyperOption.display_type_rich; "
        "from typer.testing import CliRunner; from dlm.cli import app; "
        "result = CliRunner().invoke(app, ['train', '--help']); "
        "assert result.exit_code == 0 and '--overwrite' in result.output, result.output"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr


@pytest.mark.parametrize(
    ("arguments", "wanted"),
    [
        (("pack", "--errors", "bogus", "x"), "Invalid value for '--errors'"),
        (("pack", "x"), "Missing option '--tokenizer'"),
        (("sampl",), "No such command 'sampl'"),
        (("train", "--no-such-flag"), "No such option: --no-such-flag"),
    ],
)
def test_a_usage_error_is_one_error_line_naming_the_help(arguments: tuple[str, ...], wanted: str) -> None:
    result = run_dlm(*arguments)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and wanted in lines[0], result.stderr
    assert lines[0].endswith("--help)") and "Traceback" not in result.stderr


def test_a_group_without_its_command_shows_its_help_and_exits_2() -> None:
    result = run_dlm("config")
    assert result.returncode == 2 and "show" in result.stdout and "error" not in result.stderr


def test_under_torchrun_every_end_of_a_command_goes_through_end_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process in a process group must not tear down the interpreter under gloo's threads: a command
    that returns, one that exits with a code, and a user error all end through `end_process`."""

    import types

    from dlm.cli import main

    class Ended(Exception):
        pass

    ended: list[int] = []

    def end_process(code: int) -> None:
        ended.append(code)
        raise Ended

    fake = types.SimpleNamespace(joined_process_group=lambda: True, end_process=end_process)
    monkeypatch.setitem(sys.modules, "dlm.train.distributed", fake)
    for argv in (["config", "docs", "-o", str(tmp_path / "reference.md")], ["--version"], ["pack", "x"]):
        with pytest.raises(Ended):
            main(argv)
    assert ended == [0, 0, 2]


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_bad_config_exits_2_with_one_error_line_and_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nbatch_size = 0\n", encoding="utf-8")
    result = run_dlm("config", "show", str(bad))
    assert result.returncode == 2
    assert result.stderr.startswith("error:")
    assert "training.batch_size" in result.stderr and str(bad) in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    result = run_dlm("--debug", "config", "show", str(tmp_path / "absent.toml"))
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_config_show_json_applies_overrides() -> None:
    result = runner.invoke(
        app, ["config", "show", str(ROOT / "configs" / "tiny.toml"), "--set", "training.seed=7", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["training"]["seed"] == 7 and data["model"]["d_model"] == 64


@pytest.mark.parametrize("config", ["tiny.toml", "distill"])
def test_config_show_prints_every_section_a_config_has_for_people(config: str, tmp_path: Path) -> None:
    """Tables per section (optional ones only where present), a nested table's fields dotted as `--set`
    names them, and brackets shown, not read as markup."""

    path = ROOT / "configs" / "tiny.toml"
    arguments = ["config", "show", str(path), "--set", "training.seed=7"]
    if config == "distill":
        arguments += ["--set", "training.init_from=model", "--set", "training.max_steps=300"]
        arguments += ["--set", "training.warmup_steps=10", "--set", "distill.teacher=model"]
    result = runner.invoke(app, arguments, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    for shown in ("[model]", "[training]", "[diffusion]", "seed", "7", "lora.rank", "'float32'"):
        assert shown in result.output, shown
    assert ("[distill]" in result.output) == (config == "distill") and "[rl]" not in result.output


def test_train_human_output_keeps_paths_to_copy_whole(
    tiny_data_dir: Path, tmp_path: Path, run_cli, monkeypatch, narrow_console: int
) -> None:
    monkeypatch.setattr("dlm.cli.train_cmd.wants_json", lambda flag: False)
    run_dir = tmp_path / "a-run-directory-whose-name-alone-is-long-enough-to-fill-most-of-a-terminal-line"
    assert len(str(run_dir)) > narrow_console
    settings = (
        f"training.tokenizer={tiny_data_dir / 'tokenizer.json'}",
        f"training.train_data={tiny_data_dir / 'train.bin'}",
        "training.val_data=none",
        f"training.output_dir={run_dir}",
        "training.max_steps=10",
    )
    overrides = [part for setting in settings for part in ("--set", setting)]
    result = run_cli("train", "--config", ROOT / "configs" / "tiny.toml", *overrides, "--max-run-steps", "1")
    assert result.exit_code == 0, result.stderr
    # Copied into the next command: each must stay on one line at 80 columns.
    assert f"paused at step 1; checkpoint {run_dir / 'step-00000001.pt'}\n" in result.stdout
    assert f"continue with: dlm resume {run_dir}\n" in result.stderr


def test_flags_show_no_value_type_in_help() -> None:
    """`--overwrite` takes no value: the help must not show it as `--overwrite <bool>`."""

    for command in (["pack", "--help"], ["eval", "--help"], ["--help"]):
        result = runner.invoke(app, command, env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        assert "<bool>" not in result.output, command
    assert "<path>" in runner.invoke(app, ["pack", "--help"], env={"COLUMNS": "80"}).output  # values keep theirs


def _commands(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, [*path, name])


def test_every_bracketed_word_of_the_help_reaches_the_screen() -> None:
    """The help is rich markup: an unescaped `[rl]` or `[model]` (a config section) would be read as a
    style tag and vanish (escaped, `\\[rl]`, it shows). Every command's page, and its group's list of
    commands, shows them all."""

    bracketed = re.compile(r"\[[^][\n]+\]")
    checked = 0
    for path, command in _commands(get_command(app), []):
        texts = [command.help or ""] + [param.help or "" for param in command.params if hasattr(param, "help")]
        texts += [(sub.help or "").split("\n\n")[0] for sub in getattr(command, "commands", {}).values()]
        wanted = {match.group(0) for text in texts for match in bracketed.finditer(text)}
        if wanted:
            page = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "250"}).output
            shown = " ".join(page.replace("│", " ").split())  # a bracket may wrap within its panel
            assert not [word for word in wanted if " ".join(word.split()) not in shown], path
            checked += len(wanted)
    assert checked >= 3  # the config sections named in `dlm rl`'s and `dlm train`'s help


def test_every_help_paragraph_flows_at_80_columns() -> None:
    """A docstring's line breaks are the source's, not the screen's: at 80 columns every paragraph of a
    command's help wraps at the screen's width, with no short line in its middle (typer's rich mode
    kept them, so a source line longer than the screen left one)."""

    checked = 0
    for path, _command in _commands(get_command(app), []):
        page = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"}).output
        description = page.split("╭─")[0].split("Usage:", 1)[1].split("\n")[1:]
        paragraph: list[str] = []
        for line in [*description, ""]:
            if line.strip():
                paragraph.append(line.strip())
                continue
            short = [text for text in paragraph[:-1] if len(text) < 50 and not text.startswith(("- ", "* "))]
            assert not short, (path, short)
            checked += len(paragraph) > 1
            paragraph = []
    assert checked >= 10


def test_a_docstring_is_reflowed_by_paragraph_keeping_lists_and_kept_paragraphs() -> None:
    from dlm.cli import _reflowed

    doc = "Summary line\nwrapped.\n\nA paragraph\nin two lines:\n- one item\n- another\n  its tail"
    doc += "\n\n\bkept\nas written"
    assert _reflowed(doc) == (
        "Summary line wrapped.\n\nA paragraph in two lines:\n- one item\n- another\n  its tail\n\n\bkept\nas written"
    )
