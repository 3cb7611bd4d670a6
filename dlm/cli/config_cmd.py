"""`dlm config show` and `dlm config docs`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from dlm.cli.common import JsonOption, SetOption, console, print_json
from dlm.config.reference import config_reference_markdown
from dlm.config.schema import load_config
from dlm.fileio import atomic_write_text

config_app = typer.Typer(help="Inspect configs and the configuration reference.", no_args_is_help=True)


@config_app.command("show")
def show(
    config: Annotated[Path, typer.Argument(help="Experiment config (TOML or a run's config.json).")],
    overrides: SetOption = None,
    as_json: JsonOption = False,
) -> None:
    """Print the resolved config: file values, then overrides, then defaults for the rest."""

    experiment = load_config(config, overrides)
    if as_json:
        print_json(experiment.to_dict())
        return

    for section, values in experiment.to_dict().items():
        if values is None:  # an optional section ([distill], [rl]) this config does not have
            continue
        table = Table(title=escape(f"[{section}]"), title_justify="left", show_header=False, box=None)
        for key, value in _fields(values):
            table.add_row(f"[cyan]{escape(key)}[/]", escape(repr(value) if isinstance(value, str) else str(value)))
        console.print(table)


def _fields(values: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """A section's fields, a table within it (`training.lora`) as its dotted fields, as `--set` names them."""

    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from _fields(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@config_app.command("docs")
def docs(
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")] = None,
) -> None:
    """Generate the configuration reference (docs/configuration.md) from the schema."""

    text = config_reference_markdown()
    if output is None:
        typer.echo(text, nl=False)
        return
    atomic_write_text(output, text)


def register(app: typer.Typer) -> None:
    app.add_typer(config_app, name="config")
