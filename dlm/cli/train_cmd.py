"""`dlm train` and `dlm resume`: the live dashboard (or JSON lines) around `dlm.train.loop.train`.

`dlm train --minutes M` trains within a wall-clock budget through `dlm.train.budget` (calibrated
with `dlm.bench`'s step timer), shown by `budget_view` on a terminal.

Exit codes: 0 complete or paused, 2 a user error, 128 + N after signal N (130 for Ctrl-C, 143 for
SIGTERM), whether the run stopped safely after the first signal or at once after a second one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from dlm.artifacts.events import JsonLinesSink
from dlm.cli.common import (
    ConfigOption,
    JsonOption,
    SetOption,
    TrainingDeviceOption,
    console,
    err_console,
    given_options,
    refuse_other_mode,
    wants_json,
)
from dlm.config.schema import ExperimentConfig, load_config
from dlm.errors import UserError

if TYPE_CHECKING:
    from dlm.train.loop import TrainResult
    from dlm.train.stop import StopSignals

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
BudgetOption = Annotated[
    float | None,
    typer.Option(
        "--minutes",
        help="Train within this wall-clock budget, calibration included: max_steps, warmup and the eval, save "
        "and log intervals are planned from the measured pace, so the learning-rate schedule ends in time. The "
        "same command again finishes an interrupted run; a larger --minutes continues a finished one.",
    ),
]
# What --minutes plans or controls itself: given with it, these options contradict the plan.
BUDGET_CONFLICTS = ("resume", "max_run_steps", "max_run_minutes", "nproc")
PLANNED_SETTING = "training.max_steps"
AllowDataChangeOption = Annotated[
    bool,
    typer.Option(
        "--allow-data-change", help="Continue even though the packed data differs from the data the run used."
    ),
]
AllowBatchChangeOption = Annotated[
    bool,
    typer.Option(
        "--allow-batch-change",
        help="On another number of processes, continue even where the run's global batch cannot be kept "
        "(by default the gradient accumulation is derived to keep it, or the resume is refused).",
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

    _under_signals(experiment, lambda signals: _train(experiment, as_json, stop=signals, **options))


def _under_signals(experiment: ExperimentConfig, work: Callable[[StopSignals], None], again: str | None = None) -> None:
    """Run `work` with the stop signals handled for the whole command: a signal after the run (while
    its result is printed) then cannot kill the process with another exit code or a traceback.
    `again`: how to continue from the last checkpoint (by default `dlm resume RUN`)."""

    # lazy: keeps torch out of `dlm --help` and of every other command's start
    from dlm.train.stop import SignalStop, StopSignals

    try:
        with StopSignals(restore=False) as signals:
            work(signals)
    except SignalStop as stop:
        from dlm.artifacts.run_dir import RunDir

        if RunDir(experiment.training.output_dir).has_checkpoint():
            again = again or f"dlm resume {escape(str(experiment.training.output_dir))}"
            advice = f"continue from the last checkpoint with: {again}"
        else:  # stopped before its first save: there is nothing to resume
            advice = "no checkpoint was saved yet: start the run again with the same command"
        err_console.print(f"{stop}: stopped without saving; {advice}", highlight=False, soft_wrap=True)
        sys.exit(stop.exit_code)
    except KeyboardInterrupt:  # Ctrl-C in the instant before the handlers are installed
        sys.exit(130)


def run_function(experiment: ExperimentConfig) -> Callable[..., TrainResult]:
    """What runs `experiment`: `dlm.train.loop.train`, or for a `[distill]` config `dlm.distill.run.distill`."""

    if experiment.distill is not None:
        from dlm.distill.run import distill

        return distill
    if experiment.rl is not None:
        from dlm.rl.run import rl

        return rl
    from dlm.train.loop import train

    return train


def _train(experiment: ExperimentConfig, as_json: bool, **options: Any) -> None:
    from dlm.cli.dashboard import TrainingDashboard
    from dlm.train.distributed import launched_rank

    train = run_function(experiment)

    minutes = options.pop("max_run_minutes")
    options["max_run_seconds"] = None if minutes is None else minutes * 60
    if launched_rank() != 0:  # under torchrun only rank 0 talks to the person
        result = train(experiment, **options)
        sys.exit(result.exit_code)
    if wants_json(as_json):
        result = train(experiment, sink=JsonLinesSink(), **options)
    else:
        workflow = "distill" if experiment.distill is not None else "rl" if experiment.rl is not None else "train"
        halving = experiment.distill is not None and experiment.distill.halving  # its figure is the agreement
        accuracy = "agreement" if halving else "masked acc"
        with TrainingDashboard(console, title=f"dlm {workflow}", accuracy=accuracy) as dashboard:
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


def _train_within(
    experiment: ExperimentConfig, minutes: float, as_json: bool, stop: StopSignals, **options: Any
) -> None:
    """`--minutes`: calibrate, plan and train (or finish, or continue) the run within the budget."""

    from dlm.bench.throughput import run_benchmark
    from dlm.cli.budget_view import BudgetView
    from dlm.train.budget import BudgetedTraining

    view = None if wants_json(as_json) else BudgetView(console)
    try:
        training = BudgetedTraining(
            experiment,
            minutes,
            calibrate=run_benchmark,
            stop=stop,
            emit=JsonLinesSink() if view is None else view,
            **options,
        )
        plan, step, result = training.run()
    finally:
        if view is not None:
            view.close()
    if view is not None:
        view.summary(plan, step, result)
    if result is not None and result.status == "interrupted":
        err_console.print("continue with: the same command again", highlight=False)
    if result is not None and result.exit_code:
        sys.exit(result.exit_code)


def _check_budget_options(ctx: typer.Context, overrides: list[str], source: str) -> None:
    """A time budget plans the schedule and continues its own run: options that do either are refused.

    `source` names where the budget comes from: `--minutes`, or the config's training.budget_minutes.
    """

    from_config = source != "--minutes"
    drop = "--set training.budget_minutes=0" if from_config else "--minutes"
    refuse_other_mode(
        given_options(ctx),
        BUDGET_CONFLICTS,
        f"with {source}, which plans, stops and continues "
        "the run itself (the same command finishes an interrupted run)",
        fix=f", or add {drop} to train a fixed number of steps" if from_config else "",
    )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun: the plan is one process's
        raise UserError(
            f"{source} trains in one process, and this is one of several started by torchrun",
            fix=f"{'add' if from_config else 'drop'} {drop} to train a fixed number of steps in every process",
        )
    if any(item.split("=", 1)[0].strip() == PLANNED_SETTING for item in overrides):
        raise UserError(
            f"--set {PLANNED_SETTING} does not apply with {source}, which plans it from the measured pace",
            fix=f"drop --set {PLANNED_SETTING}=..., or {'add' if from_config else 'drop'} {drop} to train a fixed "
            "number of steps",
        )


def train_command(
    ctx: typer.Context,
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
    allow_batch_change: AllowBatchChangeOption = False,
    minutes: BudgetOption = None,
    init_from: Annotated[
        Path | None,
        typer.Option(
            "--init-from",
            metavar="MODEL",
            help="Start from this trained model's weights (an export directory, a checkpoint, or a Hugging Face "
            "directory, whose \\[model] shape and tokenizer it takes) with a new optimizer and schedule "
            "(sets training.init_from).",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Train a model from a config; Ctrl-C saves a checkpoint you can resume.

    With --minutes the steps are planned from the measured pace to end the schedule in time.
    """

    if minutes is not None:
        _check_budget_options(ctx, overrides or [], "--minutes")
    extra = _overrides(overrides, device, precision)
    if init_from is not None:
        extra.append(f"training.init_from={init_from}")
    experiment = load_config(config, extra)
    if minutes is None and experiment.training.budget_minutes > 0:
        minutes = experiment.training.budget_minutes
        _check_budget_options(ctx, overrides or [], f"training.budget_minutes = {minutes:g} in {config}")
    if nproc is not None and nproc > 1:
        from dlm.train.distributed import launch_local

        sys.exit(launch_local(nproc, sys.argv[1:]))
    if resume is None:
        from dlm.train.init_from import adopt_source_model

        experiment = adopt_source_model(experiment, extra)
    if minutes is not None:
        work = partial(
            _train_within, experiment, minutes, as_json, overwrite=overwrite, allow_data_change=allow_data_change
        )
        _under_signals(experiment, work, again="the same command again")
        return
    _run(
        experiment,
        as_json,
        resume=resume,
        max_run_steps=max_run_steps,
        max_run_minutes=max_run_minutes,
        overwrite=overwrite,
        allow_data_change=allow_data_change,
        allow_batch_change=allow_batch_change,
    )


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
    allow_batch_change: AllowBatchChangeOption = False,
    as_json: JsonOption = False,
) -> None:
    """Continue a run exactly where it stopped, with the config saved in the run (a distillation run too).

    The run continues in RUN_DIR, wherever the directory is now: a copied or moved run writes into
    the copy, never where it was first trained.
    """

    from dlm.artifacts.run_dir import load_run

    experiment, source = load_run(run_dir, checkpoint, _overrides(overrides, device, precision))
    _run(
        experiment,
        as_json,
        resume=source,
        max_run_steps=max_run_steps,
        max_run_minutes=max_run_minutes,
        allow_data_change=allow_data_change,
        allow_batch_change=allow_batch_change,
    )


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)
    app.command("resume")(resume_command)
