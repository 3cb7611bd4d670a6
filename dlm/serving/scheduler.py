"""Batching across requests: each running request samples on its own, and their forward passes are shared.

Requests wait in a bounded queue. The scheduler thread starts queued requests, oldest first, as long
as their rows (prompts x `n`) fit `max_batch_rows`, each in a thread of its own that runs `generate`
for it exactly as the request would run alone, on a `dlm.serving.passes.RequestModel`. Whenever every
running request waits for a forward pass (or has finished), the scheduler runs their calls in as few
passes as `dlm.serving.passes.run_calls` can make of them, and every request goes on to its next
step. So:

- requests share passes whatever their lengths (`max_tokens`), steps, seeds and sampler options, where
  their calls fit one batch (`dlm.serving.passes`; docs/serving.md says which);
- a request that arrives while others run starts at their next pass, with its own seed, prompt and
  length: each request is a reverse process of its own, so it never waits for a batch to end;
- a request whose client has gone leaves the queue at once or, once running, leaves before its next
  pass, so the others' passes shrink; a request done (its length, or its end of document) leaves too;
- each request draws exactly its own random numbers and gets its own logits up to float rounding, so
  its text is what it gets alone (docs/reproducibility.md; the tests check it token for token in float64).

When nothing runs, the oldest request may wait up to `batch_wait` seconds after it arrived for others
to start with it: clients that each send their next request when the last answer comes tend to
arrive a few milliseconds apart. The rows of a streaming request are watched step by step
(`dlm.serving.rows.RowStream`).
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
from dlm.diffusion.schedules import model_schedule
from dlm.errors import UserError
from dlm.sampling.generation import generate
from dlm.sampling.options import StepCallback
from dlm.serving.passes import Call, Departed, RequestModel, run_calls
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


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


class SchedulerFailed(ShuttingDown):
    """The scheduler stopped on an error of its own: every request is refused (503), none waits forever."""


class Scheduler:
    """The queue, the thread that shares the running requests' passes, and a thread per running request."""

    def __init__(
        self, model: Any, tokenizer: Any, *, max_queue: int, max_batch_rows: int, batch_wait: float = 0.0
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_queue, self.max_batch_rows, self.batch_wait = max_queue, max_batch_rows, batch_wait
        self.eos = special_token_id(tokenizer, "eos")
        self.schedule = model_schedule(model)
        self.stats = ServeStats(max_batch_rows)
        self._queue: deque[Job] = deque()
        self._ready = threading.Condition()
        self._running: list[Job] = []
        self._calls: list[Call] = []  # the running requests' calls waiting for a pass
        self._busy = 0  # running requests that are sampling, neither waiting for a pass nor finished
        self._request_seconds = 1.0  # the last request's time: what a refused client is told to wait
        self._stopping = False
        self.failure: BaseException | None = None  # what stopped the scheduler, if anything did
        self._thread = threading.Thread(target=self._run, name="dlm-scheduler", daemon=True)

    def start(self) -> None:
        self.model.eval()  # the requests' stand-ins never change the mode: passes run in eval mode
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, let the running ones finish, fail what still waits."""

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
            if self.failure is not None:
                raise SchedulerFailed(f"the server's scheduler has stopped: {self.failure!r}")
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(self._retry_after())
            self._queue.append(job)
            self._publish()
            self._ready.notify_all()

    def retry_after_if_full(self) -> int | None:
        """Seconds a client should wait when the queue is full now (None: there is room): checked before
        a request is even parsed, so a flood of requests costs the event loop no tokenizing."""

        with self._ready:
            return self._retry_after() if len(self._queue) >= self.max_queue else None

    def _retry_after(self) -> int:
        """Under the lock: the seconds the queue in front of a new request will take, from the last request's."""

        return max(1, math.ceil(self._request_seconds * (1 + len(self._queue) // max(1, self.max_batch_rows))))

    def cancel(self, job: Job) -> None:
        """The client has gone: drop `job` if it still waits, else its rows leave before their next pass."""

        job.cancelled.set()
        with self._ready:
            if job in self._queue:
                self._queue.remove(job)
                self._publish()

    def _publish(self) -> None:
        self.stats.queue_changed(len(self._queue), len(self._running))

    def _wait_for_pass(self, call: Call) -> None:
        """A running request's model call (from its thread): it waits for the next pass."""

        with self._ready:
            if self.failure is not None:  # no pass will come
                call.answer(error=SchedulerFailed(f"the server's scheduler has stopped: {self.failure!r}"))
                return
            self._calls.append(call)
            self._busy -= 1
            self._ready.notify_all()

    def _company_wait(self) -> float | None:
        """Seconds the oldest request still waits for company before it starts alone (None: no such wait)."""

        if self._running or not self._queue or self.batch_wait <= 0:
            return None
        if sum(job.generation.rows for job in self._queue) >= self.max_batch_rows:
            return None
        left = self.batch_wait - (time.perf_counter() - self._queue[0].enqueued)
        return left if left > 0 else None

    def _start_queued(self) -> bool:
        """Start the queued requests that fit, oldest first (under the lock); whether any started."""

        if self._company_wait() is not None:
            return False
        rows = sum(job.generation.rows for job in self._running)
        started = False
        while self._queue and rows + self._queue[0].generation.rows <= self.max_batch_rows:
            job = self._queue.popleft()
            thread = threading.Thread(
                target=self._sample, args=(job,), name=f"dlm-request-{job.request_id}", daemon=True
            )
            try:
                thread.start()
            except RuntimeError as exc:  # the system's thread limit: this request fails, the others go on
                log.error("request %s could not start: %s", job.request_id, exc)
                job.future.set_exception(ShuttingDown(f"the server cannot start the request now ({exc})"))
                continue
            rows += job.generation.rows
            self._running.append(job)
            self._busy += 1
            started = True
        self._publish()  # the queue changed whether or not a request started (one may have failed to)
        return started

    def _next_calls(self) -> list[Call] | None:
        """Under the lock: wait until every running request waits for a pass (starting the queued ones that
        fit, which then reach their first call), and take the calls; None once stopped with nothing left."""

        while True:
            if self._busy == 0:
                if self._start_queued():
                    continue
                if self._calls:
                    calls, self._calls = self._calls, []
                    self._busy += len(calls)  # each goes on sampling once answered
                    return calls
                if self._stopping and not self._queue:
                    return None
            self._ready.wait(self._company_wait() if self._busy == 0 else None)

    def _run(self) -> None:
        """The scheduler's thread: on an error of its own, it fails every request, queued or running, and
        every later one (`SchedulerFailed`), and /health says so, rather than leave them waiting."""

        try:
            self._loop()
        except BaseException as exc:
            log.exception("the scheduler stopped")
            with self._ready:
                self.failure = exc
                waiting, self._queue = list(self._queue), deque()
                calls, self._calls = self._calls, []
                self._publish()
            failed = SchedulerFailed(f"the server's scheduler has stopped: {exc!r}")
            for job in waiting:
                job.future.set_exception(failed)
            for call in calls:
                call.answer(error=failed)  # their request threads end and answer their clients

    def _loop(self) -> None:
        while True:
            with self._ready:
                calls = self._next_calls()
            if calls is None:
                return
            try:
                with torch.inference_mode():
                    run_calls(self.model, calls, self.stats.pass_done)
            except Exception as exc:  # a bug outside any one pass: its requests fail, the server goes on
                log.exception("forward passes failed")
                for call in calls:
                    if not call.done.is_set():
                        call.answer(error=exc)

    def _sample(self, job: Job) -> None:
        """A running request's thread: sample it, then answer it."""

        outcome: Outcome | BaseException = RuntimeError(f"request {job.request_id} ended without an outcome")
        try:
            outcome = self._generate(job)
        except Departed as exc:
            self.stats.count("left")
            outcome = exc
        except UserError as exc:  # the sampler refused the request's options
            outcome = exc
        except Exception as exc:  # a bug or a device failure: this request fails, the server goes on
            log.exception("request %s failed", job.request_id)
            outcome = exc
        finally:  # whatever ended it: the passes must not wait for it
            with self._ready:  # before the client hears: the figures must not count it as running
                self._running.remove(job)
                self._busy -= 1
                self._publish()
                self._ready.notify_all()
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

    def _generate(self, job: Job) -> Outcome:
        """Sample `job` as it would be sampled alone; its outcome (its streamed text sent to the end)."""

        generation = job.generation
        streams: dict[int, tuple[int, RowStream]] = {}
        if job.on_text is not None:
            for row in range(generation.rows):
                streams[row] = (
                    row,
                    RowStream(self.tokenizer, self.model.config.mask_token_id, self.eos, generation.stop),
                )
        model = RequestModel(self.model, self._wait_for_pass, job.cancelled)
        start = time.perf_counter()
        result = generate(
            model,
            self.tokenizer,
            prompts=list(generation.prompts),
            length=generation.length,
            seeds=[generation.seed + index for index in range(len(generation.prompts))],
            num_samples=generation.n,
            stop_at_end=True,
            schedule=self.schedule,
            on_step=_step_watcher(job, streams, generation.length),
            **asdict(generation.options),
        )
        seconds = time.perf_counter() - start
        self._request_seconds = seconds
        self.stats.generated(sum(result.lengths), seconds)
        choices = []
        for row in range(generation.rows):
            choice = finish_row(
                self.tokenizer, result.token_ids[row], result.prompt_tokens[row], self.eos, generation.stop
            )
            if row in streams and job.on_text is not None:
                job.on_text(row, streams[row][1].finish(choice.text))
            choices.append(choice)
        completion_tokens = sum(choice.completion_tokens for choice in choices)
        return Outcome(choices, sum(generation.prompt_tokens), completion_tokens)


def _step_watcher(job: Job, streams: dict[int, tuple[int, RowStream]], length: int) -> StepCallback:
    """The sampler's step callback: it streams the rows in `streams` (row -> choice, stream), and ends the
    request (`Departed`) once its client has gone."""

    def on_step(step: int, tokens: torch.Tensor) -> None:
        if job.cancelled.is_set():
            raise Departed
        if not streams:
            return
        generated = tokens[:, tokens.shape[1] - length :].tolist()  # one copy to the host a step, not one a row
        for row, (index, stream) in streams.items():
            text = stream.update(generated[row])
            if text and job.on_text is not None:
                job.on_text(index, text)

    return on_step
