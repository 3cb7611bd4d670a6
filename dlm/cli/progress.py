"""One progress display for long CLI operations: a rich bar for a person watching, otherwise a JSON
`progress` line at most once a second (and once at the end), so logs stay readable and parseable."""

from __future__ import annotations

import json
import time
from types import TracebackType
from typing import IO, Any, TypeVar

from rich.console import Console

_View = TypeVar("_View", bound="ProgressView")


class ProgressView:
    """`show(done, total, text, fields)`: `text` goes beside the bar, `fields` into the JSON line."""

    def __init__(self, description: str, as_json: bool, console: Console, stream: IO[str]) -> None:
        self.description, self.as_json = description, as_json
        self.console, self.stream = console, stream
        self.started = time.perf_counter()
        self.last_line = 0.0
        self.finished = False
        self.bar: Any = None
        self.task: Any = None

    @property
    def elapsed(self) -> float:
        return max(time.perf_counter() - self.started, 1e-9)

    def __enter__(self: _View) -> _View:
        if not self.as_json:
            # lazy: only a running command needs it; `dlm --help` does without
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.fields[text]}"),
                console=self.console,
                transient=self.console.stderr,  # a bar on stderr makes way for the report after it
            )
            self.bar.start()
            self.task = self.bar.add_task(self.description, total=None, text="")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.bar is not None:
            self.bar.stop()

    def show(self, done: int, total: int, text: str, fields: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total, text=text)
            return
        now = time.perf_counter()
        if now - self.last_line >= 1.0 or (done >= total and not self.finished):
            self.last_line, self.finished = now, done >= total
            self.stream.write(json.dumps({"event": "progress", **fields}) + "\n")
            self.stream.flush()
