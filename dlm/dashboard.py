"""Event sinks: how training events reach people and files.

The training loop calls `sink(event)` with plain dicts and knows nothing of terminals. A person at a
terminal gets `TrainingDashboard` (a rich Live view); a program, a pipe or `--json` gets
`JsonLinesSink`; the run directory always gets `JsonLinesFileSink` (metrics.jsonl). Tests pass
`list.append`.
"""

from __future__ import annotations

import json
import math
import sys
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

Event = dict[str, Any]
Sink = Callable[[Event], None]

SPARK_CHARACTERS = "▁▂▃▄▅▆▇█"


def to_json_line(event: Event) -> str:
    """One compact JSON object; non-finite floats become null so every line stays valid JSON."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [clean(item) for item in value]
        return value

    return json.dumps(clean(event), default=str, allow_nan=False)


class JsonLinesSink:
    """One JSON object per event on a stream (stdout when not a TTY, or with --json)."""

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream or sys.stdout

    def __call__(self, event: Event) -> None:
        self.stream.write(to_json_line(event) + "\n")
        self.stream.flush()


class JsonLinesFileSink:
    """Appends every event to a file (the run's metrics.jsonl), flushed per line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = path.open("a", encoding="utf-8")

    def __call__(self, event: Event) -> None:
        self.handle.write(to_json_line(event) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def fan_out(sinks: Iterable[Sink]) -> Sink:
    """A sink that forwards each event to several sinks."""

    targets = list(sinks)

    def forward(event: Event) -> None:
        for target in targets:
            target(event)

    return forward


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
        self.start: Event = {}
        self.latest: Event = {}
        self.validation: Event = {}
        self.checkpoint: Event = {}
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
        kind = event.get("event")
        if kind == "start":
            self.start = event
            self.status = "training"
            self.progress.reset(self.task, total=event["max_steps"], completed=event["start_step"])
        elif kind == "train":
            self.latest = event
            self.losses.append(float(event["loss"]) if event["loss"] is not None else math.nan)
            # The loop's own estimate (steps left x recent step time) beats rich's guess from refresh times.
            self.progress.update(self.task, completed=event["step"], eta=_duration(event.get("eta_seconds")))
        elif kind == "validation":
            self.validation = event
        elif kind == "checkpoint":
            self.checkpoint = event
        elif kind in ("complete", "paused", "interrupted", "stopped"):
            self.status = kind
            self.progress.update(self.task, completed=event.get("step", 0))
        self.live.update(self.render())

    def _header(self) -> Table:
        start = self.start
        table = Table.grid(padding=(0, 2))
        table.add_row(
            f"[bold]run[/] {start.get('run_dir', '')}",
            f"[bold]device[/] {start.get('device', '')} {start.get('precision', '')}",
            f"[bold]params[/] {start.get('parameters_human', '')}",
            f"[bold]tokens/step[/] {start.get('tokens_per_step', '')}",
            f"[bold]status[/] {self.status}",
        )
        return table

    def _metrics(self) -> Table:
        event = self.latest
        table = Table(box=None, show_header=True, header_style="bold cyan", expand=True)
        for name in ("loss", "masked acc", "lr", "grad norm", "tokens/s", "MFU", "mem GiB (peak)"):
            table.add_column(name, justify="right")
        # The names `dlm.runtime.memory_stats` gives the training loop's train events.
        memory = event.get("allocated_gib")
        peak = event.get("peak_allocated_gib")
        table.add_row(
            _format(event.get("loss")),
            _format(event.get("masked_accuracy"), ".3f"),
            _format(event.get("learning_rate"), ".2e"),
            _format(event.get("grad_norm"), ".3f"),
            _format(event.get("tokens_per_second"), ",.0f"),
            _format(event.get("mfu"), ".1%", "n/a"),
            f"{_format(memory, '.2f')} ({_format(peak, '.2f')})" if memory else "-",
        )
        return table

    def _loss_by_noise(self) -> Text:
        buckets = self.latest.get("loss_by_t") or []
        # Bucket j of n holds the times t in [j / n, (j + 1) / n): n comes from the event itself.
        edges = [index / len(buckets) for index in range(len(buckets) + 1)]
        cells = [f"{edges[j]:.3g}-{edges[j + 1]:.3g}: {_format(value, '.2f')}" for j, value in enumerate(buckets)]
        return Text("loss by t  " + "  ".join(cells), style="dim")

    def render(self) -> Panel:
        validation = self.validation
        rows: list[Any] = [self._header(), self.progress, self._metrics()]
        if self.losses:
            rows.append(Text(f"loss {sparkline(self.losses)}", style="green"))
        if self.latest.get("loss_by_t"):
            rows.append(self._loss_by_noise())
        if validation:
            rows.append(
                Text(
                    f"validation @ {validation['step']}: loss {_format(validation.get('loss'))}  "
                    f"masked acc {_format(validation.get('masked_accuracy'), '.3f')}"
                )
            )
        if self.checkpoint:
            rows.append(Text(f"checkpoint @ {self.checkpoint['step']}: {self.checkpoint['path']}", style="dim"))
        return Panel(Group(*rows), title="dlm train", border_style="blue")
