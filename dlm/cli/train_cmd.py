"""`dlm train` and `dlm resume`: the live dashboard (or JSON lines) around `dlm.train.train`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from dlm.cli.common import ConfigOption, JsonOption, SetOption, console, err_console, wants_json
from dlm.config import ExperimentConfig, load_config
from dlm.errors import UserError

MaxRunSteps = Annotated[
    int | None,
    typer.Option("--max-run-steps", min=1, help="Stop safely ('paused') after this many optimizer steps."),
]
MaxRunMinutes = Annotated[
    float | None,
    typer.Option("--max-run-minutes", min=0.01, help="Stop safely ('paused') after this much wall time."),
]
DeviceOption = Annotated[
    str | None, typer.Option("--device", help="Override training.device: auto, cpu, cuda, cuda:N or mps.")
]
PrecisionOption = Annotated[
    str | None,
    typer.Option("--precision", help="Override training.precision: auto, float32, bfloat16 or float16."),
]


def _with_overrides(
    config: Path, overrides: list[str] | None, device: str | None, precision: str | None
) -> ExperimentConfig:
    extra = list(overrides or [])
    if device is not None:
        extra.append(f"training.device={device}")
    if precision is not None:
        extra.append(f"training.precision={precision}")
    return load_config(config, extra)


def _run(
    experiment: ExperimentConfig,
    resume: Path | None,
    max_run_steps: int | None,
    max_run_minutes: float | None,
    as_json: bool,
) -> None:
    from dlm.dashboard import JsonLinesSink, TrainingDashboard
    from dlm.train import train

    seconds = None if max_run_minutes is None else max_run_minutes * 60
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 talks to the person
        result = train(experiment, resume=resume, max_run_steps=max_run_steps, max_run_seconds=seconds)
        sys.exit(result.exit_code)
    if wants_json(as_json):
        result = train(
            experiment, resume=resume, max_run_steps=max_run_steps, max_run_seconds=seconds, sink=JsonLinesSink()
        )
    else:
        with TrainingDashboard(console) as dashboard:
            result = train(
                experiment, resume=resume, max_run_steps=max_run_steps, max_run_seconds=seconds, sink=dashboard
            )
        # soft_wrap: the checkpoint path and the resume command are copied, so they never break.
        console.print(
            f"[bold]{result.status}[/] at step {result.step}; checkpoint {escape(str(result.checkpoint))}",
            highlight=False,
            soft_wrap=True,
        )
    if result.status != "complete":
        err_console.print(f"continue with: dlm resume {escape(str(result.run_dir))}", highlight=False, soft_wrap=True)
    if result.exit_code:
        sys.exit(result.exit_code)


def train_command(
    config: ConfigOption,
    overrides: SetOption = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue from this training checkpoint (e.g. RUN/latest.pt).")
    ] = None,
    max_run_steps: MaxRunSteps = None,
    max_run_minutes: MaxRunMinutes = None,
    device: DeviceOption = None,
    precision: PrecisionOption = None,
    nproc: Annotated[
        int | None,
        typer.Option("--nproc", min=1, help="Start this many processes on this machine via torch.distributed.run."),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Train a model from a config; Ctrl-C saves a checkpoint you can resume."""

    if nproc is not None and nproc > 1:
        from dlm.distributed import launch_local

        sys.exit(launch_local(nproc, sys.argv[1:]))
    experiment = _with_overrides(config, overrides, device, precision)
    _run(experiment, resume, max_run_steps, max_run_minutes, as_json)


def resume_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (holds config.json and latest.pt).")],
    overrides: SetOption = None,
    max_run_steps: MaxRunSteps = None,
    max_run_minutes: MaxRunMinutes = None,
    device: DeviceOption = None,
    precision: PrecisionOption = None,
    as_json: JsonOption = False,
) -> None:
    """Continue a run exactly where it stopped, with the config saved in the run."""

    config_path, latest = run_dir / "config.json", run_dir / "latest.pt"
    for needed in (config_path, latest):
        if not needed.exists():
            raise UserError(
                "not a dlm run directory: missing " + needed.name,
                path=run_dir,
                fix="pass the output_dir of an earlier `dlm train`",
            )
    experiment = _with_overrides(config_path, overrides, device, precision)
    _run(experiment, latest, max_run_steps, max_run_minutes, as_json)


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)
    app.command("resume")(resume_command)
