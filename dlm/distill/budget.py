"""`dlm distill --minutes`: rounds long enough to fill a wall-clock budget, measured first.

A distillation's rounds are fixed in steps (each round's teacher is the student as the round began),
so the budget is planned once: a few distillation steps are timed (the step timer is injected, as
`dlm.bench` sits above `dlm.distill`), and `steps_per_round` is set so that all the rounds, their
validations and saves fill BUDGET_SHARE of the time left. The run then stops at the budget whatever
happens ("paused"; `dlm resume` finishes it), never later.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Protocol

from dlm.config.schema import ExperimentConfig
from dlm.distill.run import distillation_experiment
from dlm.errors import UserError
from dlm.train.budget import CALIBRATION_STEPS, Calibration, check_minutes

BUDGET_SHARE = 0.85  # of the time left after calibration: the rest pays validations, saves and start-up


class StepTimer(Protocol):
    """Times distillation steps: `dlm.bench.throughput.run_benchmark` with the distillation step."""

    def __call__(self, experiment: ExperimentConfig, *, steps: int, warmup: int) -> Calibration: ...


def planned_steps_per_round(experiment: ExperimentConfig, minutes: float, timer: StepTimer) -> tuple[int, float]:
    """(steps per round, seconds left for the run) for `experiment`'s rounds to fill `minutes`."""

    check_minutes(minutes)
    distill = experiment.distill
    if distill is None:
        raise UserError("this config has no [distill] section", fix="plan a training run with dlm train --minutes")
    started = time.monotonic()
    measured = timer(experiment, steps=CALIBRATION_STEPS, warmup=1)
    seconds_left = minutes * 60 - (time.monotonic() - started)
    steps = int(BUDGET_SHARE * seconds_left / measured.step_time_s) // distill.rounds
    if steps < 1:
        needed = distill.rounds * measured.step_time_s / BUDGET_SHARE / 60 + (minutes - seconds_left / 60)
        raise UserError(
            f"--minutes {minutes:g} leaves no step for each of {distill.rounds} rounds at the measured "
            f"{measured.step_time_s:.2f} s per step",
            fix=f"give at least --minutes {math.ceil(needed * 10) / 10:.1f}, or fewer --rounds",
        )
    return steps, seconds_left


def budgeted_experiment(
    teacher: str | Path,
    data: str | Path,
    output: str | Path,
    minutes: float,
    timer: StepTimer,
    distill: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
) -> tuple[ExperimentConfig, float]:
    """`distillation_experiment(teacher, data, output, distill, overrides)` with its rounds planned to fill
    `minutes`, and the seconds left for the run once the steps were timed."""

    experiment = distillation_experiment(teacher, data, output, distill, overrides)
    steps, seconds_left = planned_steps_per_round(experiment, minutes, timer)
    planned = {**(distill or {}), "steps_per_round": steps}
    return distillation_experiment(teacher, data, output, planned, overrides), seconds_left
