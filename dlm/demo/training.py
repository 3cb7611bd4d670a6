"""The demo's training stage: a complete learning-rate schedule inside a wall-clock budget.

A cosine schedule stopped by a deadline ends near its peak learning rate, the worst moment to stop.
So the demo plans steps, not seconds:

1. Calibrate: time CALIBRATION_STEPS real optimizer steps (`dlm.bench`, after one untimed step
   that pays the one-off costs) and set training.max_steps so that the schedule, its validations
   and start-up fill SCHEDULE_SHARE of the budget; warmup is scaled with the run length.
2. On the CPU, which is often shared and changed pace by 3x within a minute in our runs, train in
   segments of half the steps left (the last ones short) and re-plan max_steps after each from the
   pace it really kept (start-up, validation and checkpoints included). The learning rate then
   follows a cosine fitted to the time actually left, with small steps where the plan changes. A
   GPU trains in one segment: it is rarely shared, and every segment would pay torch.compile again.
3. The deadline still holds: a run slower than even the last plan stops at the budget, in the
   schedule's tail, where the learning rate is already near its floor.

The plan lives in RUN/demo-plan.json (with the measurements behind it) and in RUN/config.json (the
run's own config, as `dlm train` writes it). A later call with the same --minutes finds the plan
complete (or finishes an interrupted run); a larger --minutes stretches the schedule from the
run's latest.pt over the larger budget at the pace measured so far: a warm restart, the learning
rate rises from its floor to the stretched cosine's value and decays again by the new end.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dlm.artifacts.events import CheckpointEvent, Event, StreamSink, TrainEvent
from dlm.config.schema import ExperimentConfig, with_overrides
from dlm.errors import UserError
from dlm.fileio import atomic_write_json

PLAN_FORMAT, PLAN_NAME = "dlm-demo-plan-v1", "demo-plan.json"
SCHEDULE_SHARE = 0.9  # of the time left, the planned steps may fill this much
CALIBRATION_STEPS = 3
MIN_SEGMENT_SHARE = 0.08  # CPU segments halve down to this share of the run (each restart costs ~2 s)
VALIDATIONS, CHECKPOINTS = 4, 4  # at least this many per planned run (fewer on long GPU runs)
MIN_MEASURED_STEPS = 10  # fewer steps than this give too noisy a pace to re-plan from
# A forward pass costs a third of a training step in FLOPs; measured on 2 CPU cores it took 0.4 of
# one on a quiet machine and more under load, so plans count half.
FORWARD_SHARE = 0.5


@dataclass
class TrainingPlan:
    """How the time budget becomes a schedule; saved as RUN/demo-plan.json."""

    budget_seconds: float
    seconds_per_step: float  # the pace max_steps was last planned with
    rate_source: str  # "calibration" or "measured"
    calibration_seconds: float  # wall time of the calibration, part of the budget
    max_steps: int
    warmup_steps: int
    eval_interval: int
    save_interval: int
    log_interval: int
    trained_seconds: float = 0.0  # budget used up to the last checkpoint, calibration included
    format: str = PLAN_FORMAT

    def overrides(self) -> list[str]:
        names = ("max_steps", "warmup_steps", "eval_interval", "save_interval", "log_interval")
        return [f"training.{name}={getattr(self, name)}" for name in names]

    def save(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_dir / PLAN_NAME, asdict(self))

    @classmethod
    def load(cls, run_dir: Path) -> TrainingPlan | None:
        path = run_dir / PLAN_NAME
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != PLAN_FORMAT:
                raise ValueError(f"format {data.get('format')!r}")
            return cls(**data)
        except (ValueError, TypeError, AttributeError) as exc:
            raise UserError(
                f"unreadable demo plan ({exc})", path=path, fix="delete the run directory to start over"
            ) from None


def plan_schedule(
    *,
    budget_seconds: float,
    spent_seconds: float,
    seconds_per_step: float,
    base: ExperimentConfig,
    start_step: int = 0,
    warmup_steps: int | None = None,
    validation_steps: float = 0.0,
) -> dict[str, Any] | int:
    """Schedule fields for the steps that fit in SCHEDULE_SHARE of the time left, or, when too few
    fit (fewer than 2 for a fresh run, 1 for a continued one), that number.

    `validation_steps`: one validation's cost in optimizer steps. `warmup_steps` None scales the
    config's warmup with the run length (a fresh run); a number is kept (a continued run).
    """

    training = base.training
    usable = max(0.0, budget_seconds - spent_seconds) * SCHEDULE_SHARE
    steps = int(usable / seconds_per_step)
    validations = max(VALIDATIONS, steps / training.eval_interval)
    steps = int((usable - validations * validation_steps * seconds_per_step) / seconds_per_step)
    if steps < (2 if start_step == 0 else 1):
        return max(steps, 0)
    max_steps = start_step + steps
    if warmup_steps is None:
        # The config's share of the run, but at least 10% of a short run (never more than the
        # config's own warmup): a handful of warmup steps to lr 2e-3 makes Adam's first steps wild.
        share = round(steps * training.warmup_steps / training.max_steps)
        warmup_steps = max(share, min(training.warmup_steps, steps // 10))
    return {
        "max_steps": max_steps,
        "warmup_steps": min(warmup_steps, max_steps - 1),
        "eval_interval": max(1, min(training.eval_interval, steps // VALIDATIONS)),
        "save_interval": max(1, min(training.save_interval, steps // CHECKPOINTS)),
        "log_interval": max(1, min(training.log_interval, steps // 100)),
    }


def latest_step(run_dir: Path) -> int | None:
    """The step of the run's latest.pt, read from the numbered file it links to (no load)."""

    from dlm.artifacts.checkpoint import load_checkpoint
    from dlm.artifacts.run_dir import RunDir

    run = RunDir(run_dir)
    latest = run.latest
    if not latest.exists():
        return None
    for step, path in reversed(run.checkpoints()):
        if path.samefile(latest):
            return step
    return int(load_checkpoint(latest)["step"])  # a copy, on filesystems without hard links


def validation_steps(experiment: ExperimentConfig, val_blocks: int) -> float:
    """One validation's cost in optimizer steps: a forward pass per batch, each about
    FORWARD_SHARE of a training step (forward and backward)."""

    training = experiment.training
    batches = min(training.eval_batches, math.ceil(val_blocks / training.batch_size))
    return batches * FORWARD_SHARE / training.gradient_accumulation_steps


class TrainingStage:
    """The calibrate and train stages of one `run_demo` call."""

    def __init__(self, experiment: ExperimentConfig, minutes: float, val_blocks: int, emit: StreamSink):
        self.experiment, self.minutes, self.val_blocks, self.emit = experiment, minutes, val_blocks, emit
        self.run_dir = Path(experiment.training.output_dir)
        self.budget = minutes * 60.0
        self.last_learning_rate: float | None = None

    def stage(self, name: str, status: str, **figures: Any) -> None:
        self.emit({"event": "demo_stage", "stage": name, "status": status, **figures})

    def run(self) -> tuple[TrainingPlan, int, Any]:
        """Plan and train; returns (plan, step reached, the last TrainResult, or None if reused)."""

        plan, step = TrainingPlan.load(self.run_dir), latest_step(self.run_dir)
        if step is not None and plan is None:
            raise UserError("holds a training run the demo did not plan", path=self.run_dir,
                            fix="choose another --output")  # fmt: skip
        if step is None or plan is None:
            plan = self.calibrate()
        else:
            self.stage("calibrate", "reused", **asdict(plan))
            continued = self.continued(plan, step)
            if continued is None:
                self.stage("train", "reused", step=step, max_steps=plan.max_steps,
                           trained_seconds=round(plan.trained_seconds, 1))  # fmt: skip
                return plan, step, None
            plan = continued
            plan.save(self.run_dir)
        detail = f"{plan.max_steps} steps in {self.minutes:g} minutes"
        self.stage("train", "running", detail=detail, **asdict(plan))
        started = time.perf_counter()
        result = self.train_segments(plan, step)
        # The learning rate the run ended with shows whether the schedule was (nearly) complete.
        self.stage("train", "done", outcome=result.status, step=result.step, max_steps=plan.max_steps,
                   learning_rate=self.last_learning_rate, min_learning_rate=self.experiment.training.min_learning_rate,
                   seconds=round(time.perf_counter() - started, 2))  # fmt: skip
        return plan, result.step, result

    def calibrate(self) -> TrainingPlan:
        from dlm.bench.throughput import run_benchmark

        device = self.experiment.training.device
        self.stage("calibrate", "running", detail=f"timing {CALIBRATION_STEPS} training steps on {device}")
        started = time.perf_counter()
        bench = run_benchmark(self.experiment, steps=CALIBRATION_STEPS, warmup=1)
        wall = time.perf_counter() - started
        # The first step's one-off costs (allocation, compilation) come again when training starts.
        startup = max(0.0, bench.warmup_seconds - bench.step_time_s)
        fields = plan_schedule(
            budget_seconds=self.budget,
            spent_seconds=wall + startup,
            seconds_per_step=bench.step_time_s,
            base=self.experiment,
            validation_steps=validation_steps(self.experiment, self.val_blocks),
        )
        if isinstance(fields, int):
            needed = (wall + startup + 20 * bench.step_time_s) / SCHEDULE_SHARE / 60
            raise UserError(
                f"--minutes {self.minutes:g} leaves time for {fields} training steps of {bench.step_time_s:.2f} s "
                f"on {device}",
                fix=f"pass --minutes {math.ceil(needed * 10) / 10:g} or more",
            )
        plan = TrainingPlan(self.budget, bench.step_time_s, "calibration", wall, **fields, trained_seconds=wall)
        plan.save(self.run_dir)
        self.stage("calibrate", "done", seconds=round(wall, 2), tokens_per_second=bench.tokens_per_second,
                   **asdict(plan))  # fmt: skip
        return plan

    def continued(self, plan: TrainingPlan, step: int) -> TrainingPlan | None:
        """The plan to go on from `step` within this call's budget, or None: nothing to train."""

        from dlm.train.optimizer import learning_rate

        finished = step >= plan.max_steps or plan.trained_seconds >= plan.budget_seconds
        if finished and self.budget <= plan.budget_seconds:
            return None
        if not finished and self.budget == plan.budget_seconds:
            return plan  # an interrupted run: carry on with its own schedule
        trained = plan.trained_seconds - plan.calibration_seconds
        measured = step >= MIN_MEASURED_STEPS and trained > 0
        pace = trained / step if measured else plan.seconds_per_step
        fields = plan_schedule(budget_seconds=self.budget, spent_seconds=plan.trained_seconds, seconds_per_step=pace,
                               base=self.experiment, start_step=step, warmup_steps=plan.warmup_steps)  # fmt: skip
        if isinstance(fields, int):
            self.emit({"event": "demo_note", "message": f"the budget of {self.minutes:g} minutes is used up "
                       f"({plan.trained_seconds / 60:.1f} minutes so far): training stays at step {step}"})  # fmt: skip
            return None
        source = "measured" if measured else "calibration"
        new = TrainingPlan(self.budget, pace, source, plan.calibration_seconds, **fields,
                           trained_seconds=plan.trained_seconds)  # fmt: skip
        if finished:
            stretched = with_overrides(self.experiment, new.overrides(), "the demo's plan").training
            self.emit({"event": "demo_note", "message": (
                f"continuing from step {step} to {new.max_steps} within {self.minutes:g} minutes: the cosine is "
                f"stretched, so the learning rate rises from its floor to {learning_rate(step, stretched):.2e} "
                "(a warm restart) and decays again by the new end")})  # fmt: skip
        return new

    def train_segments(self, plan: TrainingPlan, step: int | None) -> Any:
        """Train to plan.max_steps. On the CPU in segments of half the steps left (down to
        MIN_SEGMENT_SHARE of the run), re-planning max_steps after each from the pace it kept: the
        re-plans come closer together towards the end, where a slowdown would cut the schedule."""

        shortest = math.ceil(MIN_SEGMENT_SHARE * (plan.max_steps - (step or 0)))
        segmented = self.experiment.training.device == "cpu"
        while True:
            start = step or 0
            left = plan.max_steps - start
            end = start + left // 2 if segmented and left >= 2 * shortest else plan.max_steps
            started = time.perf_counter()
            result = self.segment(plan, step, end - start)
            step = result.step
            if result.status != "paused" or step < end or step >= plan.max_steps:
                return result  # complete, interrupted, or stopped by the deadline
            pace = (time.perf_counter() - started) / (step - start)
            fields = plan_schedule(budget_seconds=self.budget, spent_seconds=plan.trained_seconds,
                                   seconds_per_step=pace, base=self.experiment, start_step=step,
                                   warmup_steps=plan.warmup_steps)  # fmt: skip
            if isinstance(fields, int):
                return result  # not one more step fits
            previous = plan.max_steps
            plan.max_steps, plan.warmup_steps = fields["max_steps"], fields["warmup_steps"]
            plan.seconds_per_step, plan.rate_source = pace, "measured"
            plan.save(self.run_dir)
            self.emit({"event": "demo_replan", "step": step, "seconds_per_step": round(pace, 4),
                       "previous_max_steps": previous, "max_steps": plan.max_steps})  # fmt: skip

    def segment(self, plan: TrainingPlan, step: int | None, steps: int) -> Any:
        """One `train` call of at most `steps` steps, keeping plan.trained_seconds current."""

        from dlm.artifacts.run_dir import RunDir
        from dlm.train.loop import train

        experiment = with_overrides(self.experiment, plan.overrides(), "the demo's plan")
        started, before = time.perf_counter(), plan.trained_seconds

        def sink(event: Event) -> None:
            if isinstance(event, TrainEvent):
                self.last_learning_rate = event.learning_rate
            if isinstance(event, CheckpointEvent):
                # The budget used so far, as of work safely on disk (a killed run redoes the rest).
                plan.trained_seconds = before + time.perf_counter() - started
                plan.save(self.run_dir)
            self.emit(event)

        result = train(
            experiment,
            resume=None if step is None else RunDir(self.run_dir).latest,
            # No checkpoint yet: whatever a killed first segment left in the demo's run dir goes.
            overwrite=step is None,
            max_run_steps=steps,
            max_run_seconds=max(self.budget - before, 1.0),
            sink=sink,
        )
        plan.trained_seconds = before + time.perf_counter() - started
        plan.save(self.run_dir)
        return result
