"""Training inside a wall-clock budget: a complete learning-rate schedule that ends in time.

`dlm train --minutes` and `dlm demo` both train this way. A cosine schedule stopped by a deadline
ends near its peak learning rate, the worst moment to stop. So the budget plans steps, not seconds:

1. Calibrate: time CALIBRATION_STEPS real optimizer steps (after one untimed step that pays the
   one-off costs) and set training.max_steps so that the schedule, its validations and start-up
   fill SCHEDULE_SHARE of the budget; warmup is scaled with the run length.
2. Re-fit max_steps while the run trains (`BudgetPacer`, the training loop's pacer): every
   REPLAN_EVERY of the budget, more often as it runs out, from the pace of the latest steps
   (validations and checkpoints included). The CPU is often shared and changed pace by 3x within a
   minute in our runs; a re-fit on the clock, not at fixed steps, catches a late slowdown before it
   cuts the schedule. Each re-fit anchors the cosine where it is (`training.decay_anchor_step`): the
   learning rate keeps its value and only the rest of the decay stretches or shrinks to the new
   end, so it never rises after warmup. One `train` call: nothing is rebuilt or compiled again.
3. The deadline still holds: a run slower than even the last plan stops at the budget, in the
   schedule's tail, where the learning rate is already near its floor.

The plan lives in RUN/budget-plan.json (`dlm.train.plan`, with the measurements behind it) and
in RUN/config.json (the run's own config: `dlm.train.loop.train` writes it, and again with the
first checkpoint after a re-fit). Both describe a checkpoint on disk. A later call with
the same budget finds the plan complete (or finishes an interrupted run); a larger budget stretches
the schedule from the run's latest.pt at the pace measured so far: a warm restart, the learning
rate rises from its floor to the stretched cosine's value and decays again by the new end.

Calibration is injected (`Calibrator`): the step timer is `dlm.bench.throughput.run_benchmark`, and
`bench` sits above `train` in the import layers (it times the training loop's own steps), so the
callers above both (`dlm.cli`, `dlm.demo`) pass it in. The planner stays beside the loop it drives.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.events import CheckpointEvent, Event, StartEvent, StreamSink, TrainEvent
from dlm.artifacts.run_dir import RunDir, check_run_target, run_files
from dlm.artifacts.sharded_checkpoint import latest_sharded, sharded_step
from dlm.config.schema import ExperimentConfig, with_overrides
from dlm.data.dataset import load_packed_dataset
from dlm.data.sizing import budget_advice
from dlm.errors import UserError
from dlm.runtime.device import resolve_device
from dlm.train.loop import TrainResult, train
from dlm.train.optimizer import decay_progress, learning_rate
from dlm.train.plan import TrainingPlan
from dlm.train.preflight import memory_warning

if TYPE_CHECKING:
    from dlm.train.stop import StopSignals

SCHEDULE_SHARE = 0.9  # of the time left, the planned steps may fill this much
CALIBRATION_STEPS = 3
# The schedule is re-fitted every REPLAN_EVERY of the budget (a quarter of the time left, if less),
# and whenever the run has done a quarter of the steps its plan had left (a plan far too short).
REPLAN_EVERY = 0.05
PACE_WINDOW = 3  # re-fits: a speed-up counts over the latest ones' steps, so one fast stretch does not swing it
MIN_PACED_STEPS = 5  # fewer steps than this since the last re-fit give too noisy a pace to re-fit from
# A re-fit keeps SCHEDULE_SHARE of the time left free, and never less than this share of the budget:
# the last re-fits, seconds before the end, still leave room for the final validation and save.
END_RESERVE = 0.02
VALIDATIONS, CHECKPOINTS = 4, 4  # at least this many per planned run (fewer on long GPU runs)
RESCHEDULED_FIELDS = ("max_steps", "warmup_steps", "decay_anchor_step", "decay_anchor_progress")
MIN_MEASURED_STEPS = 10  # fewer steps than this give too noisy a pace to re-plan from
# A forward pass costs a third of a training step in FLOPs; measured on 2 CPU cores it took 0.4 of
# one on a quiet machine and more under load, so plans count half.
FORWARD_SHARE = 0.5


class Calibration(Protocol):
    """What calibration measured (`dlm.bench.throughput.BenchResult` has these)."""

    @property
    def step_time_s(self) -> float: ...

    @property
    def warmup_seconds(self) -> float: ...

    @property
    def tokens_per_second(self) -> float: ...


class Calibrator(Protocol):
    """Times `steps` optimizer steps of an experiment after `warmup` untimed ones."""

    def __call__(self, experiment: ExperimentConfig, *, steps: int, warmup: int) -> Calibration: ...


def plan_schedule(
    *,
    budget_seconds: float,
    spent_seconds: float,
    seconds_per_step: float,
    base: ExperimentConfig,
    start_step: int = 0,
    warmup_steps: int | None = None,
    validation_steps: float = 0.0,
    reserve_seconds: float = 0.0,
) -> dict[str, Any] | int:
    """Schedule fields for the steps that fit in SCHEDULE_SHARE of the time left, keeping at least
    `reserve_seconds` of it free, or, when too few fit (fewer than 2 for a fresh run, 1 for a
    continued one), that number.

    `validation_steps`: one validation's cost in optimizer steps. `warmup_steps` None scales the
    config's warmup with the run length (a fresh run); a number is kept (a continued run).
    """

    training = base.training
    left = max(0.0, budget_seconds - spent_seconds)
    usable = max(0.0, min(left * SCHEDULE_SHARE, left - reserve_seconds))
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
    """The step of the run's latest checkpoint: latest.pt, read from the numbered file it links to
    (no load), or the sharded `latest` (async_checkpoint, FSDP), read from its directory's name."""

    run = RunDir(run_dir)
    latest = run.latest_checkpoint()
    sharded = latest_sharded(run_dir)
    if latest == run.latest_link and sharded is not None:
        return sharded_step(sharded)
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


def check_minutes(minutes: float) -> None:
    """A budget must be a positive, finite number of minutes."""

    if not minutes > 0 or not math.isfinite(minutes):
        raise UserError(f"--minutes must be a positive number (got {minutes})", fix="for example --minutes 10")


def packed_blocks(experiment: ExperimentConfig, path: str | Path | None) -> int:
    """The number of blocks in the packed data at `path` (0 for None)."""

    if path is None:
        return 0
    return len(load_packed_dataset(Path(path).expanduser(), experiment.model.max_seq_len))


def validation_blocks(experiment: ExperimentConfig) -> int:
    """The number of blocks in the config's validation data (0 without any): what validations cost."""

    return packed_blocks(experiment, experiment.training.val_data)


class BudgetedTraining:
    """Calibrate, plan and train one run within `minutes`, or finish or continue it (module docstring).

    Reports to `emit` the training loop's own events and dicts: `{prefix}_stage` (stage calibrate
    or train; status running, done or reused, with the plan's fields), `{prefix}_replan` at each re-fit
    of max_steps and `{prefix}_note`. `output_option` names where the run lives and `start_over`
    how to replace a run there, for refusals.
    `overwrite` starts over in a directory that holds a run; `stop`, `allow_data_change` go to `train`.
    """

    def __init__(
        self,
        experiment: ExperimentConfig,
        minutes: float,
        *,
        calibrate: Calibrator,
        emit: StreamSink,
        val_blocks: int | None = None,
        event_prefix: str = "budget",
        output_option: str = "training.output_dir",
        start_over: str = "pass --overwrite to start over",
        overwrite: bool = False,
        allow_data_change: bool = False,
        stop: StopSignals | None = None,
    ):
        check_minutes(minutes)
        self.experiment, self.minutes, self.calibrator, self.emit = experiment, minutes, calibrate, emit
        self.val_blocks = validation_blocks(experiment) if val_blocks is None else val_blocks
        self.prefix, self.output_option, self.start_over = event_prefix, output_option, start_over
        self.overwrite, self.allow_data_change, self.stop = overwrite, allow_data_change, stop
        self.run_dir = Path(experiment.training.output_dir).expanduser()
        self.budget = minutes * 60.0
        self.last_learning_rate: float | None = None

    def stage(self, name: str, status: str, **figures: Any) -> None:
        self.emit({"event": f"{self.prefix}_stage", "stage": name, "status": status, **figures})

    def note(self, message: str) -> None:
        self.emit({"event": f"{self.prefix}_note", "message": message})

    def run(self) -> tuple[TrainingPlan, int, TrainResult | None]:
        """Plan and train; returns (plan, step reached, the last TrainResult, or None if reused)."""

        plan, step = TrainingPlan.load(self.run_dir), latest_step(self.run_dir)
        if self.overwrite:
            plan = step = None
        elif step is not None and plan is None:
            raise UserError(
                f"holds a training run that --minutes did not plan (trained to step {step})",
                path=self.run_dir,
                fix=f"choose another {self.output_option}, or {self.start_over}",
            )
        if step is None or plan is None:
            # A run this budget planned but never saved a checkpoint of is redone; any other is kept.
            check_run_target(self.run_dir, None, self.overwrite or plan is not None)
            plan = self.calibrate()
        else:
            self.stage("calibrate", "reused", **asdict(plan))
            continued = self.continued(plan, step)
            if continued is None:
                self.stage(
                    "train",
                    "reused",
                    step=step,
                    max_steps=plan.max_steps,
                    trained_seconds=round(plan.trained_seconds, 1),
                )
                return plan, step, None
            plan = continued
            plan.save(self.run_dir)
        self.check_epochs(plan)
        detail = f"{plan.max_steps} steps in {self.minutes:g} minutes"
        self.stage("train", "running", detail=detail, **asdict(plan))
        started = time.perf_counter()
        result = self.train_to_plan(plan, step)
        # The learning rate the run ended with shows whether the schedule was (nearly) complete.
        self.stage(
            "train",
            "done",
            outcome=result.status,
            step=result.step,
            max_steps=plan.max_steps,
            learning_rate=self.last_learning_rate,
            min_learning_rate=self.experiment.training.min_learning_rate,
            seconds=round(time.perf_counter() - started, 2),
        )
        return plan, result.step, result

    def calibrate(self) -> TrainingPlan:
        """Time a few steps and plan the schedule from them. The plan is saved when training
        starts: a refused or killed start then leaves the directory as it was."""

        device = self.experiment.training.device
        warning = memory_warning(self.experiment, resolve_device(device))  # its steps come before the loop's
        if warning is not None:
            self.note(warning)
        self.stage("calibrate", "running", detail=f"timing {CALIBRATION_STEPS} training steps on {device}")
        started = time.perf_counter()
        bench = self.calibrator(self.experiment, steps=CALIBRATION_STEPS, warmup=1)
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
        self.stage(
            "calibrate", "done", seconds=round(wall, 2), tokens_per_second=bench.tokens_per_second, **asdict(plan)
        )
        return plan

    def check_epochs(self, plan: TrainingPlan) -> None:
        """A note when the plan repeats the training data more often than `dlm.data.sizing` advises:
        a fast device and a small corpus can plan far more epochs than the config's max_steps."""

        training, seq_len = self.experiment.training, self.experiment.model.max_seq_len
        blocks = packed_blocks(self.experiment, training.train_data)
        per_step = training.batch_size * training.gradient_accumulation_steps
        fewer_by = "pass fewer minutes, to plan at most"
        advice = budget_advice(plan.max_steps, per_step, seq_len, blocks, fewer_by=fewer_by)
        if advice.too_large:
            self.note(f"{advice.detail}; {advice.fix}")

    def continued(self, plan: TrainingPlan, step: int) -> TrainingPlan | None:
        """The plan to go on from `step` within this call's budget, or None: nothing to train."""

        # Finished: trained to its plan, or stopped where not one more step fit in its budget.
        finished = step >= plan.max_steps or isinstance(self.schedule_left(plan, plan.seconds_per_step, step), int)
        if finished and self.budget <= plan.budget_seconds:
            return None
        if not finished and self.budget == plan.budget_seconds:
            return plan  # an interrupted run: carry on with its own schedule
        trained = plan.trained_seconds - plan.calibration_seconds
        measured = step >= MIN_MEASURED_STEPS and trained > 0
        pace = trained / step if measured else plan.seconds_per_step
        fields = plan_schedule(
            budget_seconds=self.budget,
            spent_seconds=plan.trained_seconds,
            seconds_per_step=pace,
            base=self.experiment,
            start_step=step,
            warmup_steps=plan.warmup_steps,
        )
        if isinstance(fields, int):
            self.note(
                f"the budget of {self.minutes:g} minutes is used up ({plan.trained_seconds / 60:.1f} minutes "
                f"so far): training stays at step {step}"
            )
            return None
        source = "measured" if measured else "calibration"
        new = TrainingPlan(
            self.budget, pace, source, plan.calibration_seconds, **fields, trained_seconds=plan.trained_seconds
        )
        if not finished:  # an interrupted run given another budget: its learning rate goes on from here
            self.bend_schedule(plan, step)  # the share of the decay done, on the curve it trained on
            new.decay_anchor_step, new.decay_anchor_progress = plan.decay_anchor_step, plan.decay_anchor_progress
        if finished:
            stretched = with_overrides(self.experiment, new.overrides(), "the time budget's plan").training
            rate = learning_rate(step, stretched)
            self.note(
                f"continuing from step {step} to {new.max_steps} within {self.minutes:g} minutes: the cosine "
                f"is stretched, so the learning rate rises from its floor to {rate:.2e} (a warm restart) and "
                "decays again by the new end"
            )
        return new

    def train_to_plan(self, plan: TrainingPlan, step: int | None) -> TrainResult:
        """One `train` call to plan.max_steps, which `BudgetPacer` re-fits as the run goes."""

        experiment = with_overrides(self.experiment, plan.overrides(), "the time budget's plan")
        started, before = time.perf_counter(), plan.trained_seconds
        pacer = BudgetPacer(self, plan, before, started)

        def sink(event: Event) -> None:
            if isinstance(event, TrainEvent):
                self.last_learning_rate = event.learning_rate
            if isinstance(event, StartEvent):
                plan.save(self.run_dir)  # after `train` has cleared what a run it replaces left behind
            elif isinstance(event, CheckpointEvent):
                # The budget used so far, as of work safely on disk (a killed run redoes the rest), with
                # the schedule that checkpoint trained with.
                spent = before + time.perf_counter() - started
                replace(pacer.plan_at(event.step), trained_seconds=spent).save(self.run_dir)
            self.emit(event)

        result = train(
            experiment,
            resume=None if step is None else RunDir(self.run_dir).latest_checkpoint(),
            # No checkpoint yet: whatever a replaced run (or a killed first call) left goes.
            overwrite=step is None and bool(run_files(self.run_dir)),
            max_run_seconds=max(self.budget - before, 1.0),
            sink=sink,
            allow_data_change=self.allow_data_change,
            stop=self.stop,
            pacer=pacer,
        )
        plan.trained_seconds = before + time.perf_counter() - started
        plan.save(self.run_dir)  # the pace too: a later call judges by it whether this run is done
        return result

    def bend_schedule(self, plan: TrainingPlan, step: int) -> None:
        """Anchor the cosine at `step` before the plan's max_steps moves: the decay goes on from the share
        done so far, so the learning rate keeps its value here and only the rest of the curve changes."""

        if step > plan.warmup_steps:
            training = with_overrides(self.experiment, plan.overrides(), "the time budget's plan").training
            plan.decay_anchor_step, plan.decay_anchor_progress = step, min(decay_progress(step, training), 0.999)

    def schedule_left(self, plan: TrainingPlan, pace: float, step: int) -> dict[str, Any] | int:
        """The steps from `step` that still fit in the plan's budget at `pace` (`plan_schedule`), the
        END_RESERVE kept free."""

        return plan_schedule(
            budget_seconds=plan.budget_seconds,
            spent_seconds=plan.trained_seconds,
            seconds_per_step=pace,
            base=self.experiment,
            start_step=step,
            warmup_steps=plan.warmup_steps,
            reserve_seconds=END_RESERVE * plan.budget_seconds,
        )


class BudgetPacer:
    """Re-fits a budgeted run's max_steps while it trains (`dlm.train.trainer.Pacer`; the module
    docstring's step 2). Keeps every schedule it set, so that each checkpoint's plan is saved with
    the schedule that checkpoint trained with."""

    def __init__(self, training: BudgetedTraining, plan: TrainingPlan, spent_before: float, started: float):
        self.training, self.plan = training, plan
        self.spent_before, self.started = spent_before, started
        self.marks: deque[tuple[float, int]] = deque(maxlen=PACE_WINDOW)  # (clock, step) at the latest re-fits
        self.due, self.due_step = 0.0, 0
        self.plans: list[tuple[int, TrainingPlan]] = [(-1, replace(plan))]  # (set after step, schedule)

    def __call__(self, step: int) -> dict[str, Any] | None:
        now = time.perf_counter()
        if not self.marks:  # the first step paid the one-off costs: the pace is measured from here
            self.mark(now, step)
            return None
        on_time = now >= self.due and step - self.marks[-1][1] >= MIN_PACED_STEPS
        if not on_time and step < self.due_step:
            return None
        # The slower of the latest steps' pace and the window's: a slowdown shortens the plan at once
        # (running into the deadline would stop the decay midway), a speed-up lengthens it gradually.
        # Only enough latest steps count: one that ran a validation alone would swing the plan.
        recent = [mark for mark in (self.marks[0], self.marks[-1]) if step - mark[1] >= MIN_PACED_STEPS]
        pace = max((now - since) / (step - first) for since, first in recent or [self.marks[0]])
        plan = self.plan
        plan.seconds_per_step, plan.rate_source = pace, "measured"
        plan.trained_seconds = self.spent_before + now - self.started
        fields = self.training.schedule_left(plan, pace, step)
        if isinstance(fields, int) or fields["max_steps"] == plan.max_steps:
            self.mark(now, step)
            return None  # on plan; or not one more step fits, and the deadline ends the run in its tail
        previous = plan.max_steps
        self.training.bend_schedule(plan, step)
        plan.max_steps, plan.warmup_steps = fields["max_steps"], fields["warmup_steps"]
        self.plans.append((step, replace(plan)))
        self.mark(now, step)  # the next re-fit is due by the schedule as it now stands
        self.training.emit(
            {
                "event": f"{self.training.prefix}_replan",
                "step": step,
                "seconds_per_step": round(pace, 4),
                "previous_max_steps": previous,
                "max_steps": plan.max_steps,
            }
        )
        return {name: getattr(plan, name) for name in RESCHEDULED_FIELDS}

    def mark(self, now: float, step: int) -> None:
        self.marks.append((now, step))
        left = self.training.budget - (self.spent_before + now - self.started)
        self.due = now + min(REPLAN_EVERY * self.training.budget, left / 4)
        self.due_step = step + max(1, (self.plan.max_steps - step) // 4)

    def plan_at(self, step: int) -> TrainingPlan:
        """The schedule a checkpoint at `step` trained with: a re-fit after that very step comes
        after its save."""

        return next(plan for taken, plan in reversed(self.plans) if taken < step)
