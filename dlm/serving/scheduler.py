"""Batching across requests: one thread gathers queued requests into one `generate` call.

Requests wait in a bounded queue. The scheduler takes the oldest one and every queued request that
can share its batch: the same number of tokens to generate, the same `n` and the same sampler
options (steps, temperature, top-p, blocks, threshold, cache, remasking), up to `max_batch_rows`
rows. Their prompts may differ in length and each keeps its own seed: `generate(prompts=...,
seeds=...)` pads them and gives each prompt its own random stream, so a row equals the same request
sampled alone up to float rounding (`dlm.sampling.prompt_batch`, docs/reproducibility.md). Requests
with other settings wait for a later batch; a request that arrives while a batch runs joins the next.

A request whose client has gone leaves the queue at once; once its batch runs, its rows finish with
the batch and are discarded.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

from dlm.data.tokenizer import special_token_id
from dlm.sampling.generation import generate
from dlm.serving.protocol import Generation
from dlm.serving.stats import ServeStats

log = logging.getLogger("dlm.serving")


@dataclass(frozen=True)
class Choice:
    text: str
    finish_reason: str  # "stop": end of document or a stop string; "length": all its tokens
    completion_tokens: int


@dataclass(frozen=True)
class Outcome:
    choices: list[Choice]  # prompt by prompt, `n` each
    prompt_tokens: int
    completion_tokens: int


@dataclass(eq=False)  # a job is itself: the queue finds it by identity
class Job:
    """One request in the queue; `future` gets its `Outcome` or the exception that ended its batch."""

    request_id: str
    generation: Generation
    future: Future[Outcome] = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def key(self) -> tuple[Any, ...]:
        """What requests sharing a batch must agree on."""

        return self.generation.length, self.generation.n, self.generation.options


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


def stop_string_cut(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first stop string starts in `text` (None: none occurs)."""

    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return min(found) if found else None


def tokens_covering(tokenizer: Any, ids: list[int], characters: int) -> int:
    """The fewest leading tokens of `ids` whose text holds its first `characters` characters."""

    low, high = 0, len(ids)
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.decode(ids[:middle], skip_special_tokens=False)) >= characters:
            high = middle
        else:
            low = middle + 1
    return low


def finish_row(tokenizer: Any, ids: list[int], prompt_tokens: int, eos: int, stops: tuple[str, ...]) -> Choice:
    """The generated text of one row: up to its end-of-document token (kept by the sampler's cut) or
    the first stop string, whichever comes first."""

    generated = ids[prompt_tokens:]
    ended = bool(generated) and generated[-1] == eos
    body = generated[:-1] if ended else generated
    text = str(tokenizer.decode(body, skip_special_tokens=False))
    cut = stop_string_cut(text, stops)
    if cut is not None:
        return Choice(text[:cut], "stop", tokens_covering(tokenizer, body, cut))
    return Choice(text, "stop" if ended else "length", len(generated))


class Scheduler:
    """The queue and the thread that samples it in batches."""

    def __init__(self, model: Any, tokenizer: Any, *, max_queue: int, max_batch_rows: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_queue, self.max_batch_rows = max_queue, max_batch_rows
        self.eos = special_token_id(tokenizer, "eos")
        self.stats = ServeStats(max_batch_rows)
        self._queue: deque[Job] = deque()
        self._ready = threading.Condition()
        self._running: list[Job] = []
        self._batch_seconds = 1.0  # the last batch's time: what a refused client is told to wait
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="dlm-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, let the thread finish the batch it runs, fail what still waits."""

        with self._ready:
            self._stopping = True
            waiting, self._queue = list(self._queue), deque()
            self._ready.notify_all()
        for job in waiting:
            job.future.set_exception(ShuttingDown("the server is shutting down"))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise `QueueFull` (with the seconds to wait) or `ShuttingDown`."""

        if job.generation.rows > self.max_batch_rows:
            raise ValueError(f"{job.generation.rows} rows do not fit a batch of {self.max_batch_rows}")
        with self._ready:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                waiting = math.ceil(self._batch_seconds * (1 + len(self._queue) // max(1, self.max_batch_rows)))
                raise QueueFull(max(1, waiting))
            self._queue.append(job)
            self._publish()
            self._ready.notify()

    def cancel(self, job: Job) -> None:
        """The client has gone: drop `job` if it still waits, else discard its rows when its batch ends."""

        with self._ready:
            if job in self._queue:
                self._queue.remove(job)
                self._publish()

    def _publish(self) -> None:
        self.stats.queue_changed(len(self._queue), len(self._running))

    def _next_batch(self) -> list[Job]:
        """Wait for queued jobs; take the oldest and every later one with its key that fits (under the lock)."""

        while True:
            while not self._queue and not self._stopping:
                self._ready.wait()
            if self._stopping:
                return []
            head = self._queue[0]
            batch, rows = [], 0
            for job in list(self._queue):
                if job.key == head.key and rows + job.generation.rows <= self.max_batch_rows:
                    batch.append(job)
                    rows += job.generation.rows
                    self._queue.remove(job)
            return batch

    def _loop(self) -> None:
        while True:
            with self._ready:
                batch = self._next_batch()
                self._running = batch
                self._publish()
            if not batch:
                return
            try:
                self._run(batch)
            except Exception as exc:  # a bug or a device failure: each request fails, the server goes on
                log.exception("batch of requests %s failed", ", ".join(job.request_id for job in batch))
                for job in batch:
                    job.future.set_exception(exc)
            with self._ready:
                self._running = []
                self._publish()

    def _run(self, batch: list[Job]) -> None:
        first = batch[0].generation
        prompts = [prompt for job in batch for prompt in job.generation.prompts]
        seeds = [job.generation.seed + index for job in batch for index in range(len(job.generation.prompts))]
        start = time.perf_counter()
        result = generate(self.model, self.tokenizer, prompts=prompts, seeds=seeds, length=first.length,
                          num_samples=first.n, stop_at_end=True, **asdict(first.options))  # fmt: skip
        seconds = time.perf_counter() - start
        self._batch_seconds = seconds
        self.stats.batch_done(len(result.token_ids), sum(result.lengths), seconds)
        row = 0
        for job in batch:
            generation = job.generation
            choices = []
            for index in range(generation.rows):
                choices.append(finish_row(self.tokenizer, result.token_ids[row + index],
                                          result.prompt_tokens[row + index], self.eos, generation.stop))  # fmt: skip
            row += generation.rows
            outcome = Outcome(choices, sum(generation.prompt_tokens), sum(c.completion_tokens for c in choices))
            job.future.set_result(outcome)
