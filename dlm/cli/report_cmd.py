"""`dlm report`: parse, call the library (`dlm.report.page`), say where the page is.

The library loads inside the command so that `dlm --help` never pays for torch or plotly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from dlm.cli.common import JsonOption, console, print_json, wants_json


def report_command(
    run_dir: Annotated[
        Path,
        typer.Argument(metavar="RUN_DIR", help="A run directory (training.output_dir) or a `dlm demo` directory."),
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="The HTML file to write; default: RUN_DIR/report.html.", show_default=False
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace a file at --output that is not an earlier report.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Write one self-contained HTML page of a run: curves, loss by noise level, eval results, samples, config.

    The page opens offline: the charts' JavaScript (plotly, the `report` extra) is inside it.

    An earlier report at --output is replaced; any other file only with --overwrite.
    """

    # lazy: keeps torch out of `dlm --help` and of every other command's start
    from dlm.report.page import write_report

    path = write_report(run_dir, output, overwrite)
    size = path.stat().st_size
    if wants_json(as_json):
        print_json({"output": str(path), "bytes": size})
        return
    console.print(
        f"wrote [bold]{escape(str(path))}[/] ({size / 1e6:.1f} MB): open it in a browser",
        highlight=False,
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    app.command("report")(report_command)
