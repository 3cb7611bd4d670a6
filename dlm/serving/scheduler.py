"""Batching across requests: one thread gathers queued requests into one `generate` call.

Requests wait in a bounded queue. The scheduler takes the oldest one and every queued request that
can share its batch: the same number of tokens to generate, the same `n` and the same sampler
options (steps, temperature, top-p, blocks, threshold, cache, remasking), up to `max_batch_rows`
rows. Their prompts may differ in length (a block model's modulo its block size only, so that one
padded batch holds them) and each keeps its own seed: `generate(prompts=..., seeds=...)` pads them
and gives each prompt its own random stream, so a row equals the same request sampled alone up to
float rounding (`dlm.sampling.prompt_batch`, docs/reproducibility.md). Requests with other settings
wait for a later batch; a request that arrives while a batch runs joins the next. A batch that is not
full waits up to `batch_wait` seconds after its oldest request arrived for others to join it: clients
that each send their next request when the last answer comes tend to arrive a few milliseconds
apart, and without the wait the first of them would run alone. The rows of a
streaming request are watched step by step (`dlm.serving.rows.RowStream`).

A request whose client has gone leaves the queue at once; once its batch runs, its rows finish with
the batch and are discarded, unless every request of the batch has gone: then the batch stops at
its next step (a block model's next block). A step callback watches for that, and streams.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dlm.data.tokenizer import special_token_id
from dlm.errors import UserError
from dlm.model.denoiser import block_size
from dlm.sampling.generation import generate
from dlm.sampling.options import StepCallback
from dlm.serving.protocol import Generation
from dlm.serving.rows import Choice, RowStream, finish_row
from dlm.serving.stats import ServeStats

log = logging.getLogger("dlm.serving")
TextSink = Callable[[int, str], None]  # (choice index, text)


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
    on_text: TextSink | None = None  # streaming: each choice's text as it becomes final, then the rest
    cancelled: threading.Event = field(default_factory=threading.Event)  # its client has gone

    def key(self, block: int) -> tuple[Any, ...]:
        """What requests sharing a batch must agree on: the tokens to generate, `n`, the sampler options and,
        for a block model (`block` > 0), the prompts' lengths modulo the block, so that they share block
        columns and form one padded batch (`dlm.sampling.prompt_batch`)."""

        phases = frozenset(count % block for count in self.generation.prompt_tokens) if block else frozenset()
        return self.generation.length, self.generation.n, self.generation.options, phases


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


class Abandoned(Exception):
    """Every client of a batch has gone: it stops at its next step."""


class Scheduler:
    """The queue and the thread that samples it in batches."""

    def __init__(self, model: Any, tokenizer: Any, *, max_queue: int, max_batch_rows: int,
                 batch_wait: float = 0.0) -> None:  # fmt: skip
        self.model, self.tokenizer = model, tokenizer
        self.max_queue, self.max_batch_rows, self.batch_wait = max_queue, max_batch_rows, batch_wait
        self.eos = special_token_id(tokenizer, "eos")
        self.block = block_size(model.config)
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
        """The client has gone: drop `job` if it still waits, else discard its rows when its batch ends (a
        batch whose clients have all gone stops at its next step)."""

        job.cancelled.set()
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
            key = head.key(self.block)
            company = [job for job in self._queue if job.key(self.block) == key]
            waited = time.perf_counter() - head.enqueued
            if waited < self.batch_wait and sum(job.generation.rows for job in company) < self.max_batch_rows:
                self._ready.wait(self.batch_wait - waited)  # a submit wakes it early; then look again
                continue
            batch, rows = [], 0
            for job in company:
                if rows + job.generation.rows <= self.max_batch_rows:
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
            outcomes: list[Outcome | BaseException]
            try:
                outcomes = list(self._run(batch))
            except (Abandoned, UserError) as exc:  # UserError: the sampler refused the options these requests share
                outcomes = [exc] * len(batch)
            except Exception as exc:  # a bug or a device failure: each request fails, the server goes on
                log.exception("batch of requests %s failed", ", ".join(job.request_id for job in batch))
                outcomes = [exc] * len(batch)
            with self._ready:  # before any client hears: the figures must not count this batch as running
                self._running = []
                self._publish()
            for job, outcome in zip(batch, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    job.future.set_exception(outcome)
                else:
                    job.future.set_result(outcome)

    def _run(self, batch: list[Job]) -> list[Outcome]:
        """Sample the batch; each job's outcome (its streamed text sent to the end)."""

        first = batch[0].generation
        prompts = [prompt for job in batch for prompt in job.generation.prompts]
        seeds = [job.generation.seed + index for job in batch for index in range(len(job.generation.prompts))]
        streams: dict[int, tuple[Job, int, RowStream]] = {}
        row = 0
        for job in batch:
            for index in range(job.generation.rows):
                if job.on_text is not None:
                    stream = RowStream(self.tokenizer, self.model.config.mask_token_id, self.eos, job.generation.stop)
                    streams[row] = (job, index, stream)
                row += 1
        start = time.perf_counter()
        result = generate(self.model, self.tokenizer, prompts=prompts, seeds=seeds, length=first.length,
                          num_samples=first.n, stop_at_end=True, on_step=_step_watcher(batch, streams, first.length),
                          **asdict(first.options))  # fmt: skip
        seconds = time.perf_counter() - start
        self._batch_seconds = seconds
        self.stats.batch_done(len(result.token_ids), sum(result.lengths), seconds)
        row = 0
        outcomes = []
        for job in batch:
            choices = []
            for index in range(job.generation.rows):
                choice = finish_row(self.tokenizer, result.token_ids[row], result.prompt_tokens[row], self.eos,
                                    job.generation.stop)  # fmt: skip
                if row in streams and job.on_text is not None:
                    job.on_text(index, streams[row][2].finish(choice.text))
                choices.append(choice)
                row += 1
            completion_tokens = sum(choice.completion_tokens for choice in choices)
            outcomes.append(Outcome(choices, sum(job.generation.prompt_tokens), completion_tokens))
        return outcomes


def _step_watcher(batch: list[Job], streams: dict[int, tuple[Job, int, RowStream]], length: int) -> StepCallback:
    """The sampler's step callback: it streams the rows in `streams` (batch row -> job, choice, stream), and
    stops the batch (`Abandoned`) once every client of `batch` has gone."""

    def on_step(step: int, tokens: torch.Tensor) -> None:
        if all(job.cancelled.is_set() for job in batch):
            raise Abandoned
        if not streams:
            return
        generated = tokens[:, tokens.shape[1] - length :].tolist()  # one copy to the host a step, not one a row
        for row, (job, index, stream) in streams.items():
            text = stream.update(generated[row])
            if text and job.on_text is not None:
                job.on_text(index, text)

    return on_step
