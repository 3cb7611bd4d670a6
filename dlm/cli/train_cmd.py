"""`dlm train` and `dlm resume`: the live dashboard (or JSON lines) around `dlm.train.loop.train`.

Exit codes: 0 complete or paused, 2 a user error, 128 + N after signal N (130 for Ctrl-C, 143 for
SIGTERM), whether the run stopped safely after the first signal or at once after a second one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from dlm.cli.common import (
    ConfigOption,
    JsonOption,
    SetOption,
    TrainingDeviceOption,
    console,
    err_console,
    wants_json,
)
from dlm.config.schema import ExperimentConfig, load_config

MaxRunSteps = Annotated[
    int | None,
    typer.Option("--max-run-steps", min=1, help="Stop safely ('paused') after this many optimizer steps."),
]
MaxRunMinutes = Annotated[
    float | None,
    typer.Option("--max-run-minutes", min=0.01, help="Stop safely ('paused') after this much wall time."),
]
PrecisionOption = Annotated[
    str | None,
    typer.Option("--precision", help="Override training.precision: auto, float32, bfloat16 or float16."),
]
AllowDataChangeOption = Annotated[
    bool,
    typer.Option(
        "--allow-data-change", help="Continue even though the packed data differs from the data the run used."
    ),
]


def _overrides(overrides: list[str] | None, device: str | None, precision: str | None) -> list[str]:
    """`--set` items, then `--device` and `--precision` as the `--set` items they stand for."""

    extra = list(overrides or [])
    if device is not None:
        extra.append(f"training.device={device}")
    if precision is not None:
        extra.append(f"training.precision={precision}")
    return extra


def _run(experiment: ExperimentConfig, as_json: bool, **options: Any) -> None:
    """Train with `options` (those of `dlm.train.loop.train`) and exit with the run's code."""

    from dlm.train.stop import SignalStop, StopSignals

    # Installed for the whole command, so that a signal after the run (while its result is
    # printed) cannot kill the process with another exit code or a traceback.
    try:
        with StopSignals(restore=False) as signals:
            _train(experiment, as_json, stop=signals, **options)
    except SignalStop as stop:
        run_dir = escape(str(experiment.training.output_dir))
        err_console.print(f"{stop}: stopped without saving; continue from the last checkpoint with: dlm resume "
                          f"{run_dir}", highlight=False, soft_wrap=True)  # fmt: skip
        sys.exit(stop.exit_code)
    except KeyboardInterrupt:  # Ctrl-C in the instant before the handlers are installed
        sys.exit(130)


def _train(experiment: ExperimentConfig, as_json: bool, **options: Any) -> None:
    from dlm.artifacts.events import JsonLinesSink
    from dlm.cli.dashboard import TrainingDashboard
    from dlm.train.distributed import launched_rank
    from dlm.train.loop import train

    minutes = options.pop("max_run_minutes")
    options["max_run_seconds"] = None if minutes is None else minutes * 60
    if launched_rank() != 0:  # under torchrun only rank 0 talks to the person
        result = train(experiment, **options)
        sys.exit(result.exit_code)
    if wants_json(as_json):
        result = train(experiment, sink=JsonLinesSink(), **options)
    else:
        with TrainingDashboard(console) as dashboard:
            result = train(experiment, sink=dashboard, **options)
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
        Path | None,
        typer.Option(
            "--resume", help="Continue from this training checkpoint (RUN/latest.pt, or a sharded RUN/step-00000020)."
        ),
    ] = None,
    max_run_steps: MaxRunSteps = None,
    max_run_minutes: MaxRunMinutes = None,
    device: TrainingDeviceOption = None,
    precision: PrecisionOption = None,
    nproc: Annotated[
        int | None,
        typer.Option("--nproc", min=1, help="Start this many processes on this machine via torch.distributed.run."),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Delete the run already in training.output_dir and start over."),
    ] = False,
    allow_data_change: AllowDataChangeOption = False,
    init_from: Annotated[
        Path | None,
        typer.Option(
            "--init-from",
            metavar="MODEL",
            help="Start from this trained model's weights (an export directory, a checkpoint, or a Hugging Face "
            "directory, whose [model] shape and tokenizer it takes) with a new optimizer and schedule "
            "(sets training.init_from).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Train a model from a config; Ctrl-C saves a checkpoint you can resume."""

    if nproc is not None and nproc > 1:
        from dlm.train.distributed import launch_local

        sys.exit(launch_local(nproc, sys.argv[1:]))
    extra = _overrides(overrides, device, precision)
    if init_from is not None:
        extra.append(f"training.init_from={init_from}")
    experiment = load_config(config, extra)
    if resume is None:
        from dlm.train.init_from import adopt_source_model

        experiment = adopt_source_model(experiment, extra)
    _run(experiment, as_json, resume=resume, max_run_steps=max_run_steps, max_run_minutes=max_run_minutes,
         overwrite=overwrite, allow_data_change=allow_data_change)  # fmt: skip


def resume_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (holds config.json and its latest checkpoint).")],
    overrides: SetOption = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="Resume from this checkpoint of the run (e.g. step-00000020.pt, or step-00000020 when sharded) "
            "instead of the latest.",
        ),
    ] = None,
    max_run_steps: MaxRunSteps = None,
    max_run_minutes: MaxRunMinutes = None,
    device: TrainingDeviceOption = None,
    precision: PrecisionOption = None,
    allow_data_change: AllowDataChangeOption = False,
    as_json: JsonOption = False,
) -> None:
    """Continue a run exactly where it stopped, with the config saved in the run.

    The run continues in RUN_DIR, wherever the directory is now: a copied or moved run writes into
    the copy, never where it was first trained.
    """

    from dlm.artifacts.run_dir import load_run

    experiment, source = load_run(run_dir, checkpoint, _overrides(overrides, device, precision))
    _run(experiment, as_json, resume=source, max_run_steps=max_run_steps, max_run_minutes=max_run_minutes,
         allow_data_change=allow_data_change)  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)
    app.command("resume")(resume_command)
