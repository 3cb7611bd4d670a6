"""Event sinks: how training events reach people and files.

The training loop calls `sink(event)` with the typed events of `dlm.events` and knows nothing of
terminals. A person at a terminal gets `TrainingDashboard` (a rich Live view); a program, a pipe or
`--json` gets `JsonLinesSink`; the run directory always gets `JsonLinesFileSink` (metrics.jsonl).
Tests pass `list.append`. The JSON sinks also write the plain-dict events of `dlm demo`'s stages,
which share the demo's stream with the training events it passes on.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from dlm.events import (
    CheckpointEvent,
    EndEvent,
    Event,
    RunEvent,
    StartEvent,
    TrainEvent,
    ValidationEvent,
    to_json_line,
)

SPARK_CHARACTERS = "▁▂▃▄▅▆▇█"


def _json_line(event: RunEvent | Mapping[str, Any]) -> str:
    return to_json_line(event.to_dict() if isinstance(event, RunEvent) else event)


class JsonLinesSink:
    """One JSON object per event on a stream (stdout when not a TTY, or with --json)."""

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream or sys.stdout

    def __call__(self, event: RunEvent | Mapping[str, Any]) -> None:
        self.stream.write(_json_line(event) + "\n")
        self.stream.flush()


class JsonLinesFileSink:
    """Appends every event to a file (the run's metrics.jsonl), flushed per line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = path.open("a", encoding="utf-8")

    def __call__(self, event: RunEvent | Mapping[str, Any]) -> None:
        self.handle.write(_json_line(event) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def sparkline(values: Iterable[float], width: int = 48) -> str:
    """Unicode block sparkline of the last `width` finite values."""

    points = [value for value in values if math.isfinite(value)][-width:]
    if not points:
        return ""
    low, high = min(points), max(points)
    span = (high - low) or 1.0
    top = len(SPARK_CHARACTERS) - 1
    return "".join(SPARK_CHARACTERS[round((value - low) / span * top)] for value in points)


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    minutes, second = divmod(round(seconds), 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours}:{minute:02d}:{second:02d}"


def _format(value: Any, spec: str = ".4f", empty: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return empty
    return format(value, spec)


class TrainingDashboard:
    """A rich Live view of a training run, updated from events.

    Use as a context manager around `train(...)` and pass the instance as the sink.
    """

    def __init__(self, console: Console | None = None, refresh_per_second: float = 4.0):
        self.console = console or Console()
        self.start: StartEvent | None = None
        self.latest: TrainEvent | None = None
        self.validation: ValidationEvent | None = None
        self.checkpoint: CheckpointEvent | None = None
        self.status = "starting"
        self.losses: deque[float] = deque(maxlen=256)
        self.progress = Progress(
            TextColumn("[bold]step[/] {task.completed}/{task.total}"),
            BarColumn(bar_width=None),
            TextColumn("{task.percentage:>5.1f}%"),
            TimeElapsedColumn(),
            TextColumn("eta {task.fields[eta]}"),
            expand=True,
        )
        self.task = self.progress.add_task("train", total=1, completed=0, eta="-")
        self.live = Live(self.render(), console=self.console, refresh_per_second=refresh_per_second)

    def __enter__(self) -> TrainingDashboard:
        self.live.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.live.update(self.render())
        self.live.__exit__(*exc_info)

    def __call__(self, event: Event) -> None:
        if isinstance(event, StartEvent):
            self.start = event
            self.status = "training"
            self.progress.reset(self.task, total=event.max_steps, completed=event.start_step)
        elif isinstance(event, TrainEvent):
            self.latest = event
            self.losses.append(math.nan if event.loss is None else float(event.loss))
            # The loop's own estimate (steps left x recent step time) beats rich's guess from refresh times.
            self.progress.update(self.task, completed=event.step, eta=_duration(event.eta_seconds))
        elif isinstance(event, ValidationEvent):
            self.validation = event
        elif isinstance(event, CheckpointEvent):
            self.checkpoint = event
        elif isinstance(event, EndEvent):
            self.status = event.status
            self.progress.update(self.task, completed=event.step)
        self.live.update(self.render())

    def _header(self) -> Table:
        start = self.start
        table = Table.grid(padding=(0, 2))
        if start is None:
            table.add_row(f"[bold]status[/] {self.status}")
            return table
        table.add_row(
            f"[bold]run[/] {start.run_dir}",
            f"[bold]device[/] {start.device} {start.precision}",
            f"[bold]params[/] {start.parameters_human}",
            f"[bold]tokens/step[/] {start.tokens_per_step}",
            f"[bold]status[/] {self.status}",
        )
        return table

    def _metrics(self) -> Table:
        event = self.latest
        table = Table(box=None, show_header=True, header_style="bold cyan", expand=True)
        for name in ("loss", "masked acc", "lr", "grad norm", "tokens/s", "MFU", "mem GiB (peak)"):
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

    def render(self) -> Panel:
        validation, checkpoint = self.validation, self.checkpoint
        rows: list[Any] = [self._header(), self.progress, self._metrics()]
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
        return Panel(Group(*rows), title="dlm train", border_style="blue")
