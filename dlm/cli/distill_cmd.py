"""`dlm distill`: a few-step student from a trained model, with `dlm train`'s dashboard and exit codes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dlm.cli.common import JsonOption, SetOption, TrainingDeviceOption
from dlm.cli.train_cmd import AllowDataChangeOption, MaxRunMinutes, MaxRunSteps, PrecisionOption, _overrides, _run


def distill_command(
    teacher: Annotated[
        Path, typer.Argument(help="The model to distil: an export directory, a checkpoint or a run directory.")
    ],
    data: Annotated[
        Path,
        typer.Option(
            "--data",
            help="Packed text (`dlm pack --output` with the teacher's tokenizer): train.bin and val.bin.",
            show_default=False,
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Run directory of the student.")] = Path(
        "runs/distill"
    ),
    teacher_steps: Annotated[
        int, typer.Option("--teacher-steps", min=2, help="Sampling steps of the first round's teacher.")
    ] = 64,
    rounds: Annotated[
        int,
        typer.Option(
            "--rounds", min=1, max=10, help="Rounds of halving: the student samples in teacher-steps / 2^rounds steps."
        ),
    ] = 3,
    steps_per_round: Annotated[
        int, typer.Option("--steps-per-round", min=1, help="Optimizer steps of each round.")
    ] = 200,
    divergence: Annotated[
        str, typer.Option("--divergence", help="reverse-kl, kl or tvd: what each round minimises.")
    ] = "reverse-kl",
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
    """Distil TEACHER into a student that samples in fewer steps (distillation through time, SDTT).

    The student starts as the teacher. Each round it learns to take in one step what its teacher
    takes in two, and then teaches the next round: 64 teacher steps and 3 rounds give an 8-step
    student. The run resumes with `dlm resume OUTPUT`; `dlm export OUTPUT --output DIR` writes the
    student, which samples in its steps by default.
    """

    from dlm.distill.run import distillation_experiment

    distill = {"teacher_steps": teacher_steps, "rounds": rounds, "steps_per_round": steps_per_round,
               "divergence": divergence}  # fmt: skip
    experiment = distillation_experiment(teacher, data, output, distill, _overrides(overrides, device, precision))
    _run(experiment, as_json, max_run_steps=max_run_steps, max_run_minutes=max_run_minutes, overwrite=overwrite,
         allow_data_change=allow_data_change)  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("distill")(distill_command)
