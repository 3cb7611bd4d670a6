"""Distillation runs: the experiment a teacher and packed data make, and the run itself.

A distillation run is a training run (`dlm.train.loop.train`) whose optimizer step is
`dlm.distill.step.DistillStep`: its run directory, checkpoints, resume, dashboards, DDP / FSDP and
stop signals are training's. `dlm export` turns it into a student whose config records the
sampling steps it was distilled for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dlm.artifacts.checksum import weights_sha256
from dlm.artifacts.loading import read_model_source
from dlm.config.distill import DistillConfig
from dlm.config.schema import (
    ExperimentConfig,
    TrainingConfig,
    apply_overrides,
    format_validation_error,
    with_overrides,
)
from dlm.distill.step import DistillStep
from dlm.errors import UserError
from dlm.train.loop import TrainResult, train

# What a student takes over from its teacher's training settings: how it was optimised, not how long.
INHERITED_TRAINING = (
    "optimizer",
    "batch_size",
    "gradient_accumulation_steps",
    "precision",
    "seed",
    "weight_decay",
    "grad_clip",
    "adam_beta1",
    "adam_beta2",
    "compile",
    "attention_kernel",
)
# A distillation run's learning rate is the teacher's divided by this: the student starts trained.
LEARNING_RATE_DIVISOR = 4.0


def distillation_experiment(
    teacher: str | Path,
    data: str | Path,
    output: str | Path,
    distill: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
) -> ExperimentConfig:
    """The experiment that distils `teacher` (an export, checkpoint or run directory) on the packed data in
    `data` (`dlm pack`'s train.bin and, if present, val.bin) into the run directory `output`.

    The student has the teacher's `[model]`, `[diffusion]` and tokenizer, and trains with its optimizer
    and batch at a quarter of its learning rate; `distill` sets `[distill]` fields (rounds,
    teacher_steps, steps_per_round, divergence) and `overrides` are `--set` items applied last. Without
    teacher_steps, a distilled teacher teaches from the steps it was distilled for.
    """

    teacher, data = Path(teacher), Path(data)
    info, _ = read_model_source(teacher, use_ema=True)
    if not (data / "train.bin").is_file():
        raise UserError(
            "no train.bin here: --data takes the directory `dlm pack --output` wrote",
            path=data,
            fix="pack the distillation text with the teacher's tokenizer (dlm pack ... --tokenizer "
            f"{info.tokenizer_path})",
        )
    # `--set distill.*` first: the round count and length decide the training steps below.
    own = [item for item in overrides or [] if item.partition("=")[0].strip().startswith("distill.")]
    others = [item for item in overrides or [] if item not in own]
    given = {"teacher": str(teacher), **(distill or {})}
    recorded = (info.distillation or {}).get("steps")
    steps_inherited = "teacher_steps" not in given and isinstance(recorded, int)
    if steps_inherited:  # a student teaches from the steps it samples in
        given["teacher_steps"] = recorded
    fields = apply_overrides({"distill": given}, own, "--set")["distill"]
    try:
        section = DistillConfig.model_validate(fields)
    except ValidationError as exc:  # `dlm distill`'s own options name the fields they set
        problem = format_validation_error(exc)
        if steps_inherited and "teacher_steps" in problem:
            raise UserError(
                f"the teacher samples in the {recorded} steps it was distilled for: {problem}",
                path=teacher,
                fix="pass fewer --rounds (each halves the steps), or --teacher-steps",
            ) from None
        raise UserError(problem, path="--set" if own else None) from None
    defaults = TrainingConfig()
    inherited = {name: info.training[name] for name in INHERITED_TRAINING if name in info.training}
    learning_rate = float(info.training.get("learning_rate", defaults.learning_rate)) / LEARNING_RATE_DIVISOR
    steps = section.rounds * section.steps_per_round
    interval = max(1, section.steps_per_round // 2)
    training = {
        **inherited,
        "tokenizer": info.tokenizer_path,
        "train_data": data / "train.bin",
        "val_data": data / "val.bin" if (data / "val.bin").is_file() else None,
        "output_dir": Path(output),
        "init_from": teacher,
        "learning_rate": learning_rate,
        "min_learning_rate": learning_rate / 10,
        "max_steps": steps,
        "warmup_steps": min(steps // 10, 100),
        "log_interval": max(1, min(25, section.steps_per_round // 4)),
        "eval_interval": interval,
        "save_interval": interval,
        "budget_minutes": 0,
    }
    try:
        experiment = ExperimentConfig.model_validate(
            {
                "model": info.model.model_dump(),
                "diffusion": info.diffusion.model_dump(),
                "training": training,
                "distill": section.model_dump(),
            }
        )
    except ValidationError as exc:  # a rule across the fields: the output directory holding the teacher
        raise UserError(format_validation_error(exc)) from None
    return with_overrides(experiment, others, "--set")


def with_teacher_hash(experiment: ExperimentConfig) -> ExperimentConfig:
    """The experiment with its teacher's weights' sha256 recorded (a resume and the export check it)."""

    distill = experiment.distill
    if distill is None or distill.teacher_sha256 is not None:
        return experiment
    _, weights = read_model_source(distill.teacher, use_ema=True)
    recorded = distill.model_copy(update={"teacher_sha256": weights_sha256(weights)})
    return experiment.model_copy(update={"distill": recorded})


def distill(experiment: ExperimentConfig, **options: Any) -> TrainResult:
    """Run (or, with `resume=`, continue) the distillation `experiment` describes; `options` are those of
    `dlm.train.loop.train`. Returns how the run ended."""

    if experiment.distill is None:
        raise UserError("this config has no [distill] section", fix="train it with dlm train, or add [distill]")
    experiment = with_teacher_hash(experiment)  # a resume keeps the run's own (`dlm resume` reads config.json)
    return train(experiment, step_type=DistillStep, **options)
