"""The `dlm` command-line app: parse arguments, call the library, render the result.

Each workflow lives in its own module with a `register(app)` function. User errors (`UserError`)
become one red `error: ...` line and exit code 2; `--debug` shows their traceback too. Notes for
the user (`UserNote` warnings) become one yellow `warning: ...` line.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Annotated, Any

import typer
import typer.core
from rich.markup import escape

from dlm import __version__
from dlm.cli import (
    bench_cmd,
    config_cmd,
    data_cmd,
    demo_cmd,
    distill_cmd,
    eval_cmd,
    export_cmd,
    report_cmd,
    rl_cmd,
    sample_cmd,
    serve_cmd,
    train_cmd,
)
from dlm.cli.common import err_console
from dlm.errors import UserError, UserNote

# Typer from 0.28 shows `--overwrite <bool>` in the help as if a flag took a value; earlier versions
# have no such method and show flags plainly, so there is nothing to correct.
_display_type = getattr(typer.core.TyperOption, "display_type_rich", None)


def _flag_display_type(self: typer.core.TyperOption, ctx: Any) -> str | None:
    """No value type for a flag."""

    if self.is_flag and self.metavar is None:
        return None
    assert _display_type is not None  # installed only where typer has it
    return _display_type(self, ctx)


if _display_type is not None:
    typer.core.TyperOption.display_type_rich = _flag_display_type  # type: ignore[method-assign]

app = typer.Typer(
    name="dlm",
    help="Masked discrete diffusion language models: tokenize, pack, train, evaluate, export, sample.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dlm {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for user errors too.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    _state["debug"] = debug


# The order of registration is the order of `dlm --help`.
_COMMANDS = (
    config_cmd,
    data_cmd,
    train_cmd,
    distill_cmd,
    rl_cmd,
    eval_cmd,
    report_cmd,
    export_cmd,
    bench_cmd,
    sample_cmd,
    serve_cmd,
    demo_cmd,
)
for _module in _COMMANDS:
    _module.register(app)


def _reflowed(doc: str) -> str:
    """A docstring as a command's help: each paragraph's lines joined for the terminal to wrap. Typer's
    rich mode keeps a docstring's line breaks, so at 80 columns a source line longer than the screen
    left a short line in the middle of a paragraph. A list item (`- `, `* `) or an indented line keeps
    its own, and a paragraph marked `\\b` (click's "keep as written") is left whole."""

    def joined(paragraph: str) -> str:
        if paragraph.startswith("\b"):
            return paragraph
        lines = paragraph.split("\n")
        kept = lines[:1]
        for line in lines[1:]:
            kept.append(("\n" if line.startswith(("- ", "* ", " ")) else " ") + line)
        return "".join(kept)

    return "\n\n".join(joined(paragraph) for paragraph in doc.split("\n\n"))


def _help_from_docstrings(commands: typer.Typer) -> None:
    """Every command's help, from its function's docstring (litgpt's way: the docstring is the help), reflowed."""

    for info in commands.registered_commands:
        if info.help is None and info.callback is not None and info.callback.__doc__:
            info.help = _reflowed(inspect.getdoc(info.callback) or "")
    for group in commands.registered_groups:
        if group.typer_instance is not None:
            _help_from_docstrings(group.typer_instance)


_help_from_docstrings(app)


_show_warning = warnings.showwarning


def _show_note(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    if issubclass(category, UserNote):
        err_console.print(f"[bold yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
    else:
        _show_warning(message, category, *args, **kwargs)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""

    try:
        _main(argv)
    except SystemExit as stop:
        if isinstance(stop.code, str) and _joined_process_group():
            print(stop.code, file=sys.stderr)  # as the interpreter would
        _end_distributed(_exit_code(stop))
        raise


def _joined_process_group() -> bool:
    # Only modules that are loaded can have joined a group (`dlm pack` never imports torch).
    distributed = sys.modules.get("dlm.train.distributed")
    return distributed is not None and bool(distributed.joined_process_group())


def _end_distributed(code: int) -> None:
    """A process that joined a process group (under torchrun) ends through `end_process`, whatever ended
    its command; any other returns, to exit as usual."""

    if _joined_process_group():
        sys.modules["dlm.train.distributed"].end_process(code)


def _exit_code(stop: SystemExit) -> int:
    """The status the interpreter would exit with for `stop` (a message means 1)."""

    return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)


def _main(argv: list[str] | None) -> None:
    warnings.showwarning = _show_note
    try:
        # Not standalone: click's usage errors come here, to be one `error:` line like every other.
        code = app(args=argv, prog_name="dlm", standalone_mode=False)
    except UserError as exc:
        if _state["debug"]:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Abort:  # end of input at a prompt
        err_console.print("[bold red]error:[/] aborted: the input ended", highlight=False)
        sys.exit(1)
    except Exception as exc:
        usage = _usage_error(exc)
        if usage is None:
            raise
        if usage:  # a group called with no command has shown its help already, and says nothing more
            err_console.print(f"[bold red]error:[/] {escape(usage)}", highlight=False, soft_wrap=True)
        sys.exit(getattr(exc, "exit_code", 2))
    # As a standalone click app does: every command ends in SystemExit (callers of `main` rely on it),
    # with `typer.Exit`'s code, or 130 for a Ctrl-C typer caught.
    sys.exit(code if isinstance(code, int) else 0)


def _usage_error(exc: Exception) -> str | None:
    """A command-line usage error's line (a bad option value, a missing argument), with where to read
    more; None for any other exception. Click's exceptions, however typer ships click."""

    if not type(exc).__module__.endswith("click.exceptions") or not hasattr(exc, "format_message"):
        return None
    message = exc.format_message()
    if not message:
        return ""
    command = getattr(getattr(exc, "ctx", None), "command_path", "dlm")
    return f"{message} (see {command} --help)"
