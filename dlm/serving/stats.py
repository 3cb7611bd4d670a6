"""What the console shows of a running server: requests in flight and queued with the positions
admitted, tokens/s, batch occupancy (rows per shared forward pass) and the mean pass time, latency
and time-to-first-text (streaming) percentiles, and the counts of requests answered,
refused, dropped (their client left) and of those among them whose rows left a running batch.
Updated by the scheduler's engine (and the requests' samplers in it) and the request handlers, read by the
console; every method takes the one lock."""

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
    queued: int  # requests waiting to start
    tokens_per_second: float  # generated tokens over the window
    occupancy: float  # rows per forward pass over the batch limit, mean over the window's passes
    p50_seconds: float | None
    p99_seconds: float | None
    requests: int  # answered since start
    rejected: int  # refused with 429 since start
    dropped: int  # whose client left before the answer
    left: int  # of those, the ones whose rows left a running batch (the others left the queue)
    errors: int  # failed inside the server (500)
    passes: int  # forward passes since start (each shared by the requests it served)
    timed_out: int = 0  # answered 504: past the server's --request-timeout
    admitted_tokens: int = 0  # positions (rows x (prompt + max_tokens)) of the requests running now
    pass_ms: float | None = None  # mean host time of a forward pass over the window (on CUDA: its launch)
    p50_first_text_seconds: float | None = None  # streaming requests: arrival to their first text
    p99_first_text_seconds: float | None = None

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
        self._passes: deque[tuple[float, int, float]] = deque()  # (end, rows, seconds)
        self._generated: deque[tuple[float, float, int]] = deque()  # (start, end, tokens) of each finished request
        self._latencies: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self._first_texts: deque[float] = deque(maxlen=LATENCIES_KEPT)
        self.admitted_tokens = 0
        self.in_flight = self.queued = self.requests = self.rejected = self.dropped = self.left = self.errors = 0
        self.passes = self.timed_out = 0
        self.pass_rows, self.pass_seconds = 0, 0.0  # over every pass so far (the snapshot's are the window's)

    def queue_changed(self, queued: int, in_flight: int, admitted_tokens: int) -> None:
        with self._lock:
            self.queued, self.in_flight, self.admitted_tokens = queued, in_flight, admitted_tokens

    def pass_done(self, rows: int, seconds: float) -> None:
        """One forward pass over `rows` rows, which took `seconds`."""

        with self._lock:
            self._passes.append((time.monotonic(), rows, seconds))
            self.passes += 1
            self.pass_rows += rows
            self.pass_seconds += seconds

    def first_text(self, seconds: float) -> None:
        """A streaming request sent its first text `seconds` after it arrived."""

        with self._lock:
            self._first_texts.append(seconds)

    def generated(self, tokens: int, seconds: float) -> None:
        """A request sampled `tokens` tokens over its last `seconds`."""

        with self._lock:
            end = time.monotonic()
            self._generated.append((end - seconds, end, tokens))

    def answered(self, seconds: float) -> None:
        with self._lock:
            self.requests += 1
            self._latencies.append(seconds)

    def count(self, outcome: str) -> None:
        """One more request `rejected`, `dropped`, `left`, `timed_out` or ended in an `errors`."""

        with self._lock:
            setattr(self, outcome, getattr(self, outcome) + 1)

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            now = time.monotonic()
            while self._passes and self._passes[0][0] < now - WINDOW_SECONDS:
                self._passes.popleft()
            while self._generated and self._generated[0][1] < now - WINDOW_SECONDS:
                self._generated.popleft()
            passes, generated = list(self._passes), list(self._generated)
            latencies, first_texts = list(self._latencies), list(self._first_texts)
            counters = (self.requests, self.rejected, self.dropped, self.left, self.errors, self.passes, self.timed_out)
            in_flight, queued, admitted = self.in_flight, self.queued, self.admitted_tokens
        span = min(WINDOW_SECONDS, now - min(start for start, _, _ in generated)) if generated else 0.0
        tokens = sum(count for _, _, count in generated)
        occupancy = sum(rows for _, rows, _ in passes) / (len(passes) * self.max_batch_rows) if passes else 0.0
        pass_ms = 1000 * sum(seconds for _, _, seconds in passes) / len(passes) if passes else None
        return StatsSnapshot(
            in_flight,
            queued,
            tokens / span if span > 0 else 0.0,
            occupancy,
            percentile(latencies, 0.5),
            percentile(latencies, 0.99),
            *counters,
            admitted_tokens=admitted,
            pass_ms=pass_ms,
            p50_first_text_seconds=percentile(first_texts, 0.5),
            p99_first_text_seconds=percentile(first_texts, 0.99),
        )
