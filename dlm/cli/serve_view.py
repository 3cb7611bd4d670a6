"""What `dlm serve` shows while it runs: a rich Live panel on a terminal, JSON lines otherwise.

Both read `dlm.serving.stats.ServeStats` once a second from their own thread. The request log
(one record per HTTP request, with its request id) goes to JSON lines as they come; on a terminal
only the refused and failed requests are printed above the panel.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from dlm.cli.dashboard import sparkline
from dlm.serving.stats import ServeStats, StatsSnapshot

REFRESH_SECONDS = 1.0


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


class ServeConsole:
    """Starts with the server (`start`), renders until `close`; `request` is the server's request sink."""

    def __init__(
        self, stats: ServeStats, *, live: bool, url: str, model: str, console: Console, computes: str = ""
    ) -> None:
        """`computes`: what the model computes in and where (its parameters, dtype and device)."""

        self.stats, self.live_view, self.url, self.model, self.console = stats, live, url, model, console
        self.computes = computes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dlm-serve-console", daemon=True)
        self._live: Live | None = None
        self._rates: deque[float] = deque(maxlen=60)
        self._lock = threading.Lock()

    def _emit(self, record: dict[str, Any]) -> None:
        with self._lock:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()

    def request(self, record: dict[str, Any]) -> None:
        if not self.live_view:
            self._emit(record)
        elif record["status"] >= 400:
            self.console.print(
                f"[yellow]{record['status']}[/] {record['method']} {record['path']} "
                f"request {record['id']} ({record['seconds']:.3f} s)",
                highlight=False,
            )

    def start(self) -> None:
        if self.live_view:
            self._live = Live(self._render(self.stats.snapshot()), console=self.console, refresh_per_second=2)
            self._live.start()
        else:
            self._emit({"event": "start", "url": self.url, "model": self.model, "computes": self.computes})
        self._thread.start()

    def _render(self, snapshot: StatsSnapshot) -> Panel:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="dim")
        table.add_column()
        rows = [
            ("model", self.computes),
            (
                "in flight / queued",
                f"{snapshot.in_flight} / {snapshot.queued}  ({snapshot.admitted_tokens:,} positions admitted)",
            ),
            ("tokens/s", f"{snapshot.tokens_per_second:,.1f}  {sparkline(self._rates, 40)}"),
            ("batch occupancy", f"{snapshot.occupancy:.0%} of the rows a pass holds ({snapshot.passes} passes)"),
            ("pass time", "-" if snapshot.pass_ms is None else f"{snapshot.pass_ms:.1f} ms (mean over 30 s)"),
            ("latency p50 / p99", f"{_seconds(snapshot.p50_seconds)} / {_seconds(snapshot.p99_seconds)}"),
            (
                "first text p50 / p99",
                f"{_seconds(snapshot.p50_first_text_seconds)} / {_seconds(snapshot.p99_first_text_seconds)}",
            ),
            (
                "answered / 429 / dropped (left a batch) / errors",
                f"{snapshot.requests} / {snapshot.rejected} / {snapshot.dropped} ({snapshot.left}) / {snapshot.errors}",
            ),
        ]
        for name, value in rows:
            table.add_row(name, value)
        return Panel(
            Group(table),
            title=f"dlm serve {self.model} at {self.url}",
            title_align="left",
            subtitle="Ctrl-C or SIGTERM: finish what is running, then stop",
        )

    def _loop(self) -> None:
        last: dict[str, Any] | None = None
        while not self._stop.wait(REFRESH_SECONDS):
            snapshot = self.stats.snapshot()
            self._rates.append(snapshot.tokens_per_second)
            if self._live is not None:
                self._live.update(self._render(snapshot))
                continue
            record = {"event": "stats", **snapshot.to_dict()}
            if record != last:  # an idle server writes nothing
                self._emit(record | {"time": round(time.time(), 3)})
                last = record

    def close(self) -> None:
        if not self._thread.ident:  # never started: the server did not listen
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._live is not None:
            self._live.stop()
        else:
            self._emit({"event": "stop", **self.stats.snapshot().to_dict()})
