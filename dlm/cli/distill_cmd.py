"""`dlm distill`: a few-step student from a trained model, with `dlm train`'s dashboard and exit codes."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer

from dlm.cli.common import (
    JsonOption,
    SetOption,
    TrainingDeviceOption,
    console,
    given_options,
    print_json,
    refuse_other_mode,
    wants_json,
)
from dlm.cli.progress import ProgressView
from dlm.cli.train_cmd import AllowDataChangeOption, MaxRunMinutes, MaxRunSteps, PrecisionOption, _overrides, _run
from dlm.config.schema import ExperimentConfig
from dlm.errors import UserError


def distill_command(
    ctx: typer.Context,
    teacher: Annotated[
        Path, typer.Argument(help="The model to distil: an export directory, a checkpoint or a run directory.")
    ],
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="Packed text (`dlm pack --output` with the teacher's tokenizer): train.bin and val.bin.",
            show_default=False,
        ),
    ] = None,
    teacher_samples: Annotated[
        int | None,
        typer.Option(
            "--teacher-samples",
            help="Distil on this many of the teacher's own samples instead of --data: written once (to "
            "OUTPUT/teacher-samples, reused by a second call) before the rounds begin.",
            show_default=False,
        ),
    ] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="Run directory of the student.")] = Path(
        "runs/distill"
    ),
    teacher_steps: Annotated[
        int | None,
        typer.Option(
            "--teacher-steps",
            min=2,
            help="Sampling steps of the first round's teacher \\[default: the steps a distilled teacher was "
            "distilled for, else 64].",
            show_default=False,
        ),
    ] = None,
    rounds: Annotated[
        int,
        typer.Option(
            "--rounds", min=1, max=10, help="Rounds of halving: the student samples in teacher-steps / 2^rounds steps."
        ),
    ] = 3,
    steps_per_round: Annotated[
        int, typer.Option("--steps-per-round", min=1, help="Optimizer steps of each round.")
    ] = 100,
    divergence: Annotated[
        str,
        typer.Option("--divergence", help="kl, reverse-kl or tvd: what each round minimises (docs/distill.md)."),
    ] = "kl",
    remasking: Annotated[
        str,
        typer.Option(
            "--remasking",
            help="The reveal order the student is distilled for and samples in: random (ancestral) or dilated "
            "(the planned order that keeps few-step text closest to one token a step: docs/distill.md).",
        ),
    ] = "random",
    method: Annotated[
        str,
        typer.Option(
            "--method",
            help="sdtt (rounds that halve the steps) or certainty (one round of certainty forcing for "
            "--threshold sampling; give it --rounds 1 and, at best, --teacher-samples).",
        ),
    ] = "sdtt",
    certainty_weight: Annotated[
        float, typer.Option("--certainty-weight", min=0.0, help="--method certainty: the entropy term's weight.")
    ] = 1.0,
    minutes: Annotated[
        float | None,
        typer.Option(
            "--minutes",
            help="Fill this wall-clock budget: a few distillation steps are timed first and --steps-per-round "
            "is set so that the rounds end in time (the run stops at the budget in any case).",
        ),
    ] = None,
    overrides: SetOption = None,
    max_run_steps: MaxRunSteps = None,
    max_run_minutes: MaxRunMinutes = None,
    device: TrainingDeviceOption = None,
    precision: PrecisionOption = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Delete the run already in --output and start over.")
    ] = False,
    allow_data_change: AllowDataChangeOption = False,
    as_json: JsonOption = False,
) -> None:
    """Distil TEACHER into a student that samples in fewer steps (SDTT).

    The student starts as the teacher. Each round it learns to take in one
    step what its teacher takes in two, then teaches the next round: 64
    teacher steps and 3 rounds give an 8-step student. --method certainty
    instead trains one round of certainty forcing, for sampling with
    --threshold. Continue a stopped
    run with `dlm resume OUTPUT`; `dlm export OUTPUT --output DIR` writes the
    student, which samples in its own steps by default. docs/distill.md has
    what it measured: on the demo's model no student is yet clearly better
    than its teacher sampled in the same steps.
    """

    # lazy: keeps torch out of `dlm --help` and of every other command's start
    from dlm.distill.run import distillation_experiment

    distill = {
        **({} if teacher_steps is None else {"teacher_steps": teacher_steps}),
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "divergence": divergence,
        "remasking": remasking,
        "method": method,
        "certainty_weight": certainty_weight,
    }
    settings = _overrides(overrides, device, precision)
    given = given_options(ctx)
    if method == "certainty":  # it trains toward the data, with no teacher's two steps to match
        refuse_other_mode(given, ("divergence", "remasking"), "to --method certainty")
    else:
        refuse_other_mode(given, ("certainty_weight",), f"to --method {method}", fix=", or add --method certainty")
    if minutes is not None:
        refuse_other_mode(
            given,
            ("steps_per_round", "max_run_minutes"),
            "with --minutes, which sets the steps of each round and stops the run in time",
        )
    data = _data(teacher, data, teacher_samples, output, overwrite, as_json)
    if minutes is None:
        experiment = distillation_experiment(teacher, data, output, distill, settings)
    else:
        experiment, seconds_left = _plan(teacher, data, output, distill, settings, minutes, as_json)
        max_run_minutes = seconds_left / 60
    _run(
        experiment,
        as_json,
        max_run_steps=max_run_steps,
        max_run_minutes=max_run_minutes,
        overwrite=overwrite,
        allow_data_change=allow_data_change,
    )


def _data(teacher: Path, data: Path | None, samples: int | None, output: Path, overwrite: bool, as_json: bool) -> Path:
    """--data, or the packed directory of --teacher-samples (written now, with a progress bar)."""

    if (data is None) == (samples is None):
        raise UserError(
            "give one of --data (packed text) and --teacher-samples N (the teacher's own samples)",
            fix="for example --data runs/demo/data, or --teacher-samples 2048",
        )
    if samples is None:
        assert data is not None
        return data

    from dlm.distill.samples import teacher_samples

    with ProgressView("teacher samples", wants_json(as_json), console, sys.stdout) as view:

        def progress(done: int, total: int) -> None:
            rate = done / view.elapsed
            eta = (total - done) / rate if rate > 0 else None
            view.show(
                done,
                total,
                f"{rate:.1f} samples/s  ETA {eta:.0f}s" if eta is not None else "",
                {"stage": "teacher_samples", "samples": done, "total": total, "samples_per_s": rate, "eta_s": eta},
            )

        return teacher_samples(teacher, samples, output, overwrite=overwrite, progress=progress)


def _plan(
    teacher: Path, data: Path, output: Path, distill: dict[str, Any], settings: list[str], minutes: float, as_json: bool
) -> tuple[ExperimentConfig, float]:
    """The experiment with its rounds planned to fill `minutes`; say what was planned (a JSON line with --json)."""

    from dlm.bench.throughput import run_benchmark
    from dlm.distill.budget import budgeted_experiment
    from dlm.distill.step import DistillStep

    plan = partial(
        budgeted_experiment,
        teacher,
        data,
        output,
        minutes,
        partial(run_benchmark, step_type=DistillStep),
        distill,
        settings,
    )
    if wants_json(as_json):
        experiment, seconds_left = plan()
    else:
        with console.status("timing distillation steps to plan the rounds"):
            experiment, seconds_left = plan()
    assert experiment.distill is not None
    rounds, steps = experiment.distill.rounds, experiment.distill.steps_per_round
    if wants_json(as_json):
        print_json(
            {
                "event": "distill_plan",
                "minutes": minutes,
                "steps_per_round": steps,
                "rounds": rounds,
                "seconds_left": round(seconds_left, 1),
            }
        )
    else:
        console.print(f"plan: {rounds} rounds of {steps} steps in {seconds_left / 60:.1f} minutes", highlight=False)
    return experiment, seconds_left


def register(app: typer.Typer) -> None:
    app.command("distill")(distill_command)
