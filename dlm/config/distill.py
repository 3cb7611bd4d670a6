"""`[distill]`: teach a student to sample in fewer steps than its teacher (`dlm distill`).

Distillation through time (SDTT): the student starts as the teacher and learns to do in one step of
the reverse process what the teacher does in two. Round after round the steps halve, the last
round's student being the next round's teacher: `teacher_steps` 64 and 3 rounds give a student
that samples in 8 steps. This module stays torch-free like the rest of the config; the objective is
`dlm.diffusion.distillation` and the loop `dlm.distill`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dlm.config.rules import FieldProblem
from dlm.diffusion.divergences import divergence_names


class DistillConfig(BaseModel):
    """Few-step distillation of a trained model (`dlm distill`): `training.max_steps` is
    `rounds` x `steps_per_round` and the student starts from the teacher's weights."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    teacher: Path = Field(description="The model to distil: an export directory, a checkpoint or a run directory.")
    method: Literal["sdtt", "certainty"] = Field(
        "sdtt",
        description="sdtt: each round matches one student step to two teacher steps (SDTT); certainty: one round "
        "of certainty forcing (dParallel) for threshold decoding: cross-entropy to the data (best: the teacher's "
        "own samples) plus certainty_weight x the student's entropy where it already predicts the data's token.",
    )
    certainty_weight: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="method = certainty: the weight of the entropy term (0 is plain fine-tuning).",
    )
    divergence: str = Field(
        "kl",
        description="What a round minimises between the teacher's two-step prediction and the student's one-step "
        "prediction, a name registered in `dlm/diffusion/divergences.py`: kl (forward, the best measured on the "
        "demo's model), reverse-kl (SDTT's choice) or tvd.",
    )
    remasking: Literal["random", "dilated"] = Field(
        "random",
        description="method = sdtt: the reveal order the student is distilled for and samples in by default "
        "(`dlm sample --remasking`): random (ancestral: each round's times drawn on the student's grid, masks at "
        "random) or dilated (the planned order: each step's masks, and the teacher's two steps, are the "
        "dilated order's).",
    )
    teacher_steps: int = Field(
        64, ge=2, description="Sampling steps of the first round's teacher (the steps it samples well in)."
    )
    rounds: int = Field(
        3, ge=1, le=10, description="Rounds of halving: the student samples in teacher_steps / 2^rounds."
    )
    steps_per_round: int = Field(100, ge=1, description="Optimizer steps of each round.")
    teacher_sha256: str | None = Field(
        None, description="sha256 of the teacher's weights, recorded when the run starts (and checked on resume)."
    )

    @property
    def halving(self) -> bool:
        """Whether rounds halve the sampling steps (SDTT); certainty forcing keeps the teacher's."""

        return self.method == "sdtt"

    @property
    def student_steps(self) -> int:
        """The sampling steps the finished student is distilled for."""

        return self.teacher_steps >> self.rounds if self.halving else self.teacher_steps

    def steps_after(self, optimizer_steps: int) -> int:
        """The sampling steps a student is distilled for after `optimizer_steps` (its completed rounds)."""

        if not self.halving:
            return self.teacher_steps
        return self.teacher_steps >> min(optimizer_steps // self.steps_per_round, self.rounds)

    def record(self, optimizer_steps: int) -> dict[str, object]:
        """What an export says of a student after `optimizer_steps`: `steps` is what sampling defaults to."""

        record: dict[str, object] = {
            "method": self.method,
            "steps": self.steps_after(optimizer_steps),
            "teacher_steps": self.teacher_steps,
            "rounds_done": min(optimizer_steps // self.steps_per_round, self.rounds),
            "divergence": self.divergence,
            "teacher_sha256": self.teacher_sha256,
            "remasking": self.remasking,
        }
        if not self.halving:
            record["certainty_weight"] = self.certainty_weight
        return record

    def round_steps(self, round_index: int) -> tuple[int, int]:
        """(teacher, student) sampling steps of round `round_index` (0-based)."""

        teacher = self.teacher_steps >> round_index
        return (teacher, teacher // 2) if self.halving else (teacher, teacher)

    @model_validator(mode="after")
    def _check_halving(self) -> DistillConfig:
        if not self.halving and self.rounds != 1:
            raise FieldProblem(
                "rounds", f"certainty forcing trains one round, not {self.rounds}", "set rounds = 1 (--rounds 1)"
            )
        if not self.halving and self.remasking != "random":
            raise FieldProblem(
                "remasking",
                "certainty forcing trains for --threshold sampling, which ranks its reveals by confidence",
                'leave remasking = "random", or use method = "sdtt"',
            )
        if self.halving and self.teacher_steps % (1 << self.rounds):
            raise FieldProblem(
                "teacher_steps",
                f"{self.teacher_steps} steps do not halve {self.rounds} times",
                f"use a multiple of {1 << self.rounds} or fewer rounds",
            )

        if self.divergence not in divergence_names():
            raise FieldProblem(
                "divergence",
                f"{self.divergence!r} is not a registered divergence",
                f"use one of: {', '.join(divergence_names())}",
            )
        return self
