"""The terminal's event sink: `TrainingDashboard`, a rich Live view of a training run.

The training loop calls `sink(event)` with the typed events of `dlm.artifacts.events` and knows
nothing of terminals. A person at a terminal gets this dashboard; a program, a pipe or `--json` gets
`dlm.artifacts.events.JsonLinesSink`, and the run directory always gets `JsonLinesFileSink`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from dlm.artifacts.events import (
    CheckpointEvent,
    EndEvent,
    Event,
    HeldoutEvent,
    RolloutEvent,
    StartEvent,
    TrainEvent,
    ValidationEvent,
)

SPARK_CHARACTERS = "▁▂▃▄▅▆▇█"
SPARK_QUANTILES = (0.05, 0.95)  # the sparkline's range: one spike must not flatten the trend
SLOWER_THAN_PLANNED = 0.7  # a measured step rate below this share of the planned one is reported


def _quantile(ordered: list[float], share: float) -> float:
    """Linear-interpolated quantile of sorted values."""

    position = share * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def sparkline(values: Iterable[float], width: int = 48) -> str:
    """Unicode block sparkline of the last `width` finite values, scaled between the 5th and 95th
    percentiles of that window (values outside are clipped): a single loss spike then tops its
    column instead of squashing the rest of the curve onto the bottom row."""

    points = [value for value in values if math.isfinite(value)][-width:]
    if not points:
        return ""
    ordered = sorted(points)
    low, high = (_quantile(ordered, share) for share in SPARK_QUANTILES)
    span = (high - low) or 1.0
    top = len(SPARK_CHARACTERS) - 1
    return "".join(SPARK_CHARACTERS[round((min(max(value, low), high) - low) / span * top)] for value in points)


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    minutes, second = divmod(round(seconds), 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours}:{minute:02d}:{second:02d}"


def _rate(value: float) -> str:
    return f"{value:.2g}" if value < 10 else f"{value:.0f}"


def _format(value: Any, spec: str = ".4f", empty: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return empty
    return format(value, spec)


REFIT_LINE_SHARE = 0.05  # a re-fitted end this much away from the last one announced gets a line


@dataclass(frozen=True)
class Budget:
    """A run trained against a wall-clock budget (`dlm.train.budget`), possibly continued by a second
    call: the dashboard then reports progress as the share of the budget used, which a re-fitted
    max_steps cannot move backwards, and a pause between two calls is not the run's end."""

    seconds: float
    spent_seconds: float = 0.0  # used before the dashboard opened (calibration, earlier calls)
    seconds_per_step: float | None = None  # the pace the schedule was planned with


class TrainingDashboard:
    """A rich Live view of a training run, updated from events.

    Use as a context manager around `train(...)` and pass the instance as the sink. The clock runs
    from the dashboard's opening across every `train` call it is shown, and the percentage never
    goes down: with a `Budget` it is the share of the budget used, else the furthest step / max_steps.
    """

    def __init__(
        self,
        console: Console | None = None,
        refresh_per_second: float = 4.0,
        *,
        budget: Budget | None = None,
        clock: Callable[[], float] = time.monotonic,
        title: str = "dlm train",
        accuracy: str = "masked acc",
    ):
        """`accuracy`: the name of the training figure `masked_accuracy` (a distillation's is the student's
        agreement with its two-step teacher's favourite token, not with the data)."""

        self.console, self.title, self.accuracy = console or Console(), title, accuracy
        self.budget, self.clock = budget, clock
        self.opened = clock()
        self.planned_seconds_per_step = None if budget is None else budget.seconds_per_step
        self.start: StartEvent | None = None
        self.latest: TrainEvent | None = None
        self.validation: ValidationEvent | None = None
        self.checkpoint: CheckpointEvent | None = None
        self.rollout: RolloutEvent | None = None  # an RL run's (`dlm rl`)
        self.heldout: HeldoutEvent | None = None
        self.rewards: deque[float] = deque(maxlen=256)
        self.status = "starting"
        self.step, self.max_steps, self.fraction = 0, 0, 0.0
        self.replans = 0
        self.announced_end = 0  # the end the last announced re-fit named
        self.losses: deque[float] = deque(maxlen=256)
        self.live = Live(console=self.console, refresh_per_second=refresh_per_second, get_renderable=self.render)

    def __enter__(self) -> TrainingDashboard:
        self.live.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.live.refresh()
        self.live.__exit__(kind, value, trace)

    def elapsed(self) -> float:
        return self.clock() - self.opened + (0.0 if self.budget is None else self.budget.spent_seconds)

    def replan(self, seconds_per_step: float, max_steps: int | None = None) -> bool:
        """The schedule was re-fitted at this pace, to end at `max_steps` (a budgeted run). Whether
        the end moved by REFIT_LINE_SHARE or more since the last re-fit that said so: a run re-fits
        every few seconds, and a line for each would bury the dashboard."""

        baseline = self.announced_end or self.max_steps  # the end the run started with, until one is announced
        self.planned_seconds_per_step = seconds_per_step
        self.max_steps = self.max_steps if max_steps is None else max_steps
        self.replans += 1
        if baseline and abs(self.max_steps - baseline) < REFIT_LINE_SHARE * baseline:
            return False
        self.announced_end = self.max_steps
        return True

    def finish(self, status: str) -> None:
        """How a budgeted run ended, once no further `train` call follows."""

        self.status = status
        self._refresh()

    def __call__(self, event: Event) -> None:
        if isinstance(event, StartEvent):
            self.start, self.status = event, "training"
            self.step, self.max_steps = event.start_step, event.max_steps
        elif isinstance(event, TrainEvent):
            self.latest = event
            self.losses.append(math.nan if event.loss is None else float(event.loss))
            self.step, self.max_steps = event.step, event.max_steps
        elif isinstance(event, ValidationEvent):
            self.validation = event
        elif isinstance(event, CheckpointEvent):
            self.checkpoint = event
        elif isinstance(event, RolloutEvent):
            self.rollout = event
            self.rewards.append(event.mean_reward)
        elif isinstance(event, HeldoutEvent):
            self.heldout = event
        elif isinstance(event, EndEvent):
            self.step = event.step
            # Under a budget a pause ends one `train` call of several: the owner calls finish().
            if self.budget is None or event.status != "paused":
                self.status = event.status
            if event.status == "complete":
                self.fraction = 1.0
        self._refresh()

    def _refresh(self) -> None:
        if self.live.is_started:  # a dashboard fed without its Live (tests render it themselves)
            self.live.refresh()

    def progress_fraction(self) -> float:
        if self.budget is not None:
            current = self.elapsed() / self.budget.seconds
        else:
            current = self.step / self.max_steps if self.max_steps else 0.0
        self.fraction = min(1.0, max(self.fraction, current))
        return self.fraction

    def _progress(self) -> Table:
        fraction = self.progress_fraction()
        eta = None if self.latest is None or self.status != "training" else self.latest.eta_seconds
        clock = _duration(self.elapsed())
        if self.budget is not None:
            clock += f" of {_duration(self.budget.seconds)}"
        table = Table.grid(padding=(0, 1), expand=True)
        table.add_column(no_wrap=True)
        table.add_column(ratio=1)
        for _ in range(3):
            table.add_column(no_wrap=True, justify="right")
        table.add_row(
            f"[bold]step[/] {self.step}/{self.max_steps or '-'}",
            ProgressBar(total=1.0, completed=fraction),
            f"{fraction:>6.1%}",
            clock,
            f"eta {_duration(eta)}",
        )
        return table

    def _pace_warning(self) -> Text | None:
        """Said when the steps run well below the pace the schedule was planned with."""

        event, start, planned = self.latest, self.start, self.planned_seconds_per_step
        if event is None or start is None or not planned or not start.tokens_per_step:
            return None
        measured, wanted = event.tokens_per_second / start.tokens_per_step, 1.0 / planned
        if measured >= SLOWER_THAN_PLANNED * wanted:
            return None
        return Text(f"machine busier than planned: {_rate(measured)} steps/s against {_rate(wanted)}", style="yellow")

    def _header(self) -> Table:
        start = self.start
        table = Table.grid(padding=(0, 2))
        if start is None:
            table.add_row(f"[bold]status[/] {self.status}")
            return table
        params = start.parameters_human
        if start.trainable_parameters is not None and start.trainable_parameters < start.parameters:
            params += f" ({100 * start.trainable_parameters / start.parameters:.2g}% trained)"
        table.add_row(
            f"[bold]run[/] {start.run_dir}",
            f"[bold]device[/] {start.device} {start.precision}",
            f"[bold]params[/] {params}",
            f"[bold]tokens/step[/] {start.tokens_per_step}",
            f"[bold]status[/] {self.status}",
        )
        return table

    def _metrics(self) -> Table:
        event = self.latest
        table = Table(box=None, show_header=True, header_style="bold cyan", expand=True)
        for name in ("loss", self.accuracy, "lr", "grad norm", "tokens/s", "MFU", "mem GiB (peak)"):
            table.add_column(name, justify="right")
        if event is None:
            table.add_row(*["-"] * 5, "n/a", "-")
            return table
        memory, peak = event.allocated_gib, event.peak_allocated_gib
        table.add_row(
            _format(event.loss),
            _format(event.masked_accuracy, ".3f"),
            _format(event.learning_rate, ".2e"),
            _format(event.grad_norm, ".3f"),
            _format(event.tokens_per_second, ",.0f"),
            _format(event.mfu, ".1%", "n/a"),
            f"{_format(memory, '.2f')} ({_format(peak, '.2f')})" if memory else "-",
        )
        return table

    def _loss_by_noise(self, buckets: list[float | None]) -> Text:
        # Bucket j of n holds the times t in [j / n, (j + 1) / n): n comes from the event itself.
        edges = [index / len(buckets) for index in range(len(buckets) + 1)]
        cells = [f"{edges[j]:.3g}-{edges[j + 1]:.3g}: {_format(value, '.2f')}" for j, value in enumerate(buckets)]
        return Text("loss by t  " + "  ".join(cells), style="dim")

    def _rl_lines(self) -> list[Text]:
        """An RL run's rewards: the latest window, its curve, and the held-out accuracy."""

        lines = []
        rollout, heldout = self.rollout, self.heldout
        if rollout is not None:
            lines.append(
                Text(
                    f"reward {rollout.mean_reward:.3f}  accuracy {rollout.accuracy:.3f}  flat groups "
                    f"{rollout.flat_groups:.0%}  KL {rollout.kl:.4f}  clipped {rollout.clip_fraction:.1%}  "
                    f"rollout {rollout.rollout_seconds:.2f} s  update {rollout.update_seconds:.2f} s"
                    + ("" if rollout.estimator_variance is None else f"  estimate var {rollout.estimator_variance:.3g}")
                )
            )
            lines.append(Text(f"reward  {sparkline(self.rewards)}", style="green"))
            lines.append(Text(f"sample  {rollout.sample}", style="dim", overflow="ellipsis", no_wrap=True))
        if heldout is not None:
            lines.append(
                Text(
                    f"held-out accuracy {heldout.accuracy:.3f} +- {heldout.stderr:.3f} on {heldout.prompts} prompts "
                    f"at step {heldout.step}",
                    style="bold",
                )
            )
        return lines

    def render(self) -> Panel:
        validation, checkpoint = self.validation, self.checkpoint
        rows: list[Any] = [self._header(), self._progress(), self._metrics()]
        if self.latest is not None and self.latest.phase:
            rows.append(Text(self.latest.phase, style="magenta"))
        rows += self._rl_lines()
        if self.start is not None and self.start.cpu_threads:
            rows.append(Text(f"cpu threads: {self.start.cpu_threads}", style="dim"))
        if self.start is not None and self.start.batch_note:
            rows.append(Text(self.start.batch_note, style="yellow" if "changed" in self.start.batch_note else "dim"))
        if self.start is not None and self.start.precision_note:
            rows.append(Text(self.start.precision_note, style="yellow"))
        if self.budget is not None and self.planned_seconds_per_step and self.max_steps:
            replanned = f", re-planned {self.replans}x" if self.replans else ""
            rows.append(
                Text(
                    f"plan: step {self.max_steps} at {self.planned_seconds_per_step:.3g} s per step{replanned}",
                    style="dim",
                )
            )
        warning = self._pace_warning()
        if warning is not None:
            rows.append(warning)
        if self.losses:
            rows.append(Text(f"loss {sparkline(self.losses)}", style="green"))
        if self.latest is not None and self.latest.loss_by_t:
            rows.append(self._loss_by_noise(self.latest.loss_by_t))
        if validation is not None:
            rows.append(
                Text(
                    f"validation @ {validation.step}: loss {_format(validation.loss)}  "
                    f"masked acc {_format(validation.masked_accuracy, '.3f')}"
                )
            )
        if checkpoint is not None:
            rows.append(Text(f"checkpoint @ {checkpoint.step}: {checkpoint.path}", style="dim"))
        return Panel(Group(*rows), title=self.title, border_style="blue")
