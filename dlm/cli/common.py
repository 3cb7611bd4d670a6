"""What the subcommands share: consoles, JSON output and the options that several commands take."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from dlm.choices import ComputeDtype
from dlm.errors import UserError

console = Console()
err_console = Console(stderr=True)

ConfigOption = Annotated[Path, typer.Option("--config", "-c", help="Experiment config (TOML).", show_default=False)]
SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a config field, e.g. --set training.learning_rate=1e-3 (repeatable).",
        show_default=False,
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
# `--device` takes what `dlm.runtime.device.resolve_device` accepts; left out, training and the demo use the config's.
_DEVICES = "auto, cpu, mps, cuda or cuda:N"
DeviceOption = Annotated[str, typer.Option("--device", help=f"{_DEVICES}.")]
DtypeOption = Annotated[
    ComputeDtype,
    typer.Option(
        "--dtype",
        help="The dtype the model computes in (auto: as stored, but float32 for bfloat16 or float16 weights "
        "on a CPU that only emulates them, where it is faster).",
    ),
]
DemoDeviceOption = Annotated[str | None, typer.Option("--device", help=f"{_DEVICES} (default: the config's).")]
TrainingDeviceOption = Annotated[
    str | None,
    typer.Option("--device", help="Override training.device: auto, cpu, cuda, cuda:N or mps.", show_default=False),
]
DeviceMemoryOption = Annotated[
    float | None,
    typer.Option(
        "--device-memory",
        metavar="GIB",
        min=1e-6,
        show_default=False,
        help="Compare the memory estimate with a GPU of this many GiB (e.g. 24) instead of this machine's free "
        "memory; precision auto counts as bfloat16.",
    ),
]
EmaOption = Annotated[
    bool,
    typer.Option("--ema/--no-ema", help="Use the EMA weights when the checkpoint has them (else the live ones)."),
]


def wants_json(flag: bool) -> bool:
    """JSON when asked, or when stdout is not a terminal a person is watching."""

    return flag or not sys.stdout.isatty()


def print_json(payload: Any) -> None:
    """One JSON document on stdout (paths and other objects rendered as strings)."""

    sys.stdout.write(json.dumps(payload, default=str) + "\n")
    sys.stdout.flush()


def given_options(ctx: typer.Context) -> dict[str, str]:
    """Parameter name -> first flag of every option given on the command line (or by the environment),
    not left at its default: what a command checks to refuse an option its mode would ignore."""

    # By the source's name: typer may bring its own copy of click, and so of the ParameterSource enum.
    sources = {p.name: (ctx.get_parameter_source(p.name), p.opts[0]) for p in ctx.command.params if p.name}
    return {name: flag for name, (source, flag) in sources.items() if source is not None and source.name != "DEFAULT"}


def refuse_other_mode(given: dict[str, str], names: tuple[str, ...], mode: str, fix: str = "") -> None:
    """One `error:` line naming every option in `given` (as `given_options` returns) that only the other
    mode reads: `names` are those options' parameter names, `mode` says which mode runs, `fix` adds to "drop"."""

    wrong = [given[name] for name in names if name in given]
    if wrong:
        flags = ", ".join(wrong)
        raise UserError(f"{flags} {'does' if len(wrong) == 1 else 'do'} not apply {mode}", fix=f"drop {flags}{fix}")
