"""A time budget's training plan, RUN/budget-plan.json: the schedule `dlm.train.budget` planned
and the measurements behind it. Its own module so that what reads a plan (`dlm validate`'s budget
row, the dashboards) needs nothing of the planner, which sits above the training loop.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from dlm.artifacts.run_dir import RunDir
from dlm.errors import UserError
from dlm.fileio import atomic_write_json

PLAN_FORMAT = "dlm-budget-plan-v1"
EARLIER_PLAN_FORMATS = ("dlm-demo-plan-v1",)  # the same fields, written by `dlm demo` before
PLANNED_FIELDS = (
    "max_steps",
    "warmup_steps",
    "eval_interval",
    "save_interval",
    "log_interval",
    "decay_anchor_step",
    "decay_anchor_progress",
)


@dataclass
class TrainingPlan:
    """How the time budget becomes a schedule; saved as RUN/budget-plan.json."""

    budget_seconds: float
    seconds_per_step: float  # the pace last measured: calibration's, then at each re-fit
    rate_source: str  # "calibration" or "measured"
    calibration_seconds: float  # wall time of the calibration, part of the budget
    max_steps: int
    warmup_steps: int
    eval_interval: int
    save_interval: int
    log_interval: int
    trained_seconds: float = 0.0  # budget used up to the last checkpoint, calibration included
    # Where the last re-plan bent the cosine (`dlm.train.optimizer.decay_progress`); 0: not re-planned.
    decay_anchor_step: int = 0
    decay_anchor_progress: float = 0.0
    format: str = PLAN_FORMAT

    def overrides(self) -> list[str]:
        return [f"training.{name}={getattr(self, name)}" for name in PLANNED_FIELDS]

    def save(self, run_dir: Path) -> None:
        run = RunDir(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run.budget_plan, asdict(self))
        for earlier in run.budget_plan_files()[1:]:
            earlier.unlink()  # the plan now lives under the current name only

    @classmethod
    def load(cls, run_dir: Path) -> TrainingPlan | None:
        """The run's plan (a `dlm demo` run's older demo-plan.json too), or None if it has none."""

        found = RunDir(run_dir).budget_plan_files()
        if not found:
            return None
        try:
            data = json.loads(found[0].read_text(encoding="utf-8"))
            if data.get("format") not in (PLAN_FORMAT, *EARLIER_PLAN_FORMATS):
                raise ValueError(f"format {data.get('format')!r}")
            return cls(**{**data, "format": PLAN_FORMAT})
        except (ValueError, TypeError, AttributeError) as exc:
            raise UserError(
                f"unreadable training plan ({exc})", path=found[0], fix="delete the run directory to start over"
            ) from None
