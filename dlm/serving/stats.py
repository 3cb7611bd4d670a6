"""What the console shows of a running server: requests in flight and queued, tokens/s, batch
occupancy, latency percentiles. Updated by the scheduler thread and the request handlers, read by
the console; every method takes the one lock."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

WINDOW_SECONDS = 30.0  # tokens/s and occupancy over the last half minute
LATENCIES_KEPT = 1000  # p50 / p99 over the last thousand answered requests


@dataclass(frozen=True)
class StatsSnapshot:
    in_flight: int  # requests being generated
    queued: int  # requests waiting for a batch
    tokens_per_second: float  # generated tokens over the window
    occupancy: float  # rows per batch over the batch limit, mean over the window's batches
    p50_seconds: float | None
    p99_seconds: float | None
    requests: int  # answered since start
    rejected: int  # refused with 429 since start
    dropped: int  # whose client left before the answer
    errors: int  # failed inside the server (500)
    batches: int  # generate calls since start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], fraction: float) -> float | None:
    """The nearest-rank percentile (None for no values)."""

    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


class ServeStats:
    def __init__(self, max_batch_rows: int) -> None:
        self.max_batch_rows = max_batch_rows
        self._lock = threading.Lock()
        self._batches: deque[tuple[float, float, int, int]] = deque()  # (start, end, rows, generated tokens)
        self._latencies: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self.in_flight = self.queued = self.requests = self.rejected = self.dropped = self.errors = self.batches = 0

    def queue_changed(self, queued: int, in_flight: int) -> None:
        with self._lock:
            self.queued, self.in_flight = queued, in_flight

    def batch_done(self, rows: int, tokens: int, seconds: float) -> None:
        with self._lock:
            end = time.monotonic()
            self._batches.append((end - seconds, end, rows, tokens))
            self.batches += 1

    def answered(self, seconds: float) -> None:
        with self._lock:
            self.requests += 1
            self._latencies.append(seconds)

    def count(self, outcome: str) -> None:
        """One more request `rejected`, `dropped` or ended in an `errors`."""

        with self._lock:
            setattr(self, outcome, getattr(self, outcome) + 1)

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            now = time.monotonic()
            while self._batches and self._batches[0][1] < now - WINDOW_SECONDS:
                self._batches.popleft()
            batches = list(self._batches)
            latencies = list(self._latencies)
            counters = (self.requests, self.rejected, self.dropped, self.errors, self.batches)
            in_flight, queued = self.in_flight, self.queued
        span = min(WINDOW_SECONDS, now - batches[0][0]) if batches else 0.0
        tokens = sum(batch[3] for batch in batches)
        occupancy = sum(batch[2] for batch in batches) / (len(batches) * self.max_batch_rows) if batches else 0.0
        return StatsSnapshot(in_flight, queued, tokens / span if span > 0 else 0.0, occupancy,
                             percentile(latencies, 0.5), percentile(latencies, 0.99), *counters)  # fmt: skip
