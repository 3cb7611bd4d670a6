"""Batching across requests: one engine loop advances every running request to its next model call,
then runs those calls in shared forward passes.

Requests wait in a bounded queue. The engine (one thread) starts queued requests, oldest first, as
long as their rows (prompts x `n`) fit `max_batch_rows`. A diffusion model's requests (a whole-sequence
model's without a cache, a block model's within its context) join the cohort (`dlm.serving.cohort`),
which advances them together as data and hands the round its model calls. Every other running request
is a greenlet (a coroutine of the `greenlet` package, the `serve` extra) that runs `generate` for it exactly as the
request would run alone, on a `dlm.serving.passes.RequestModel`, whose model call hands the call to
the engine and suspends the request until its logits are there. A round of the engine resumes every
running request until each has made its next call (or finished), then runs the calls in as few
passes as `dlm.serving.passes.run_calls` can make of them, and answers them. The token draws the
requests make on the way (`RequestModel.draw_tokens`) suspend them too: the round draws those of one
kind in one call (`dlm.serving.passes.run_draws`) and resumes them to their next call. So:

- requests share passes whatever their lengths (`max_tokens`), steps, seeds and sampler options, where
  their calls fit one batch (`dlm.serving.passes`; docs/serving.md says which);
- a request that arrives while others run starts at the next round, with its own seed, prompt and
  length: each request is a reverse process of its own, so it never waits for a batch to end;
- a request whose client has gone leaves the queue at once or, once running, leaves before its next
  pass, so the others' passes shrink; a request done (its length, or its end of document) leaves too;
- each request draws exactly its own random numbers and gets its own logits up to float rounding, so
  its text is what it gets alone (docs/reproducibility.md; the tests check it token for token in float64);
- the server holds one thread for all requests, however many run: no thread per request, no
  contention for the interpreter between them, and a request's state is its suspended sampler.

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
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from dlm.data.tokenizer import special_token_id
from dlm.diffusion.schedules import model_schedule
from dlm.errors import UserError
from dlm.extras import Requirement, require
from dlm.sampling.generation import generate
from dlm.sampling.options import StepCallback
from dlm.serving.cohort import Cohort, OwnSampler, joins_cohort
from dlm.serving.jobs import Answer, Finished, Job, Outcome
from dlm.serving.passes import Call, Departed, Draw, RequestModel, run_calls, run_draws
from dlm.serving.protocol import Generation
from dlm.serving.stats import ServeStats

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from dlm.model.transformer import DiffusionTransformer

log = logging.getLogger("dlm.serving")
GREENLET = Requirement("greenlet", "serve", "dlm serve")


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    pass


class SchedulerFailed(ShuttingDown):
    """The scheduler stopped on an error of its own: every request is refused (503), none waits forever."""


@dataclass(eq=False)
class _Running:
    """A running request: its job, its suspended sampler, and the model call it waits on (None: not started)."""

    job: Job
    sampler: Any  # a greenlet running `Scheduler._sample(job)`
    call: Call | Draw | None = None


class Scheduler:
    """The queue and the engine thread that advances the running requests and shares their passes."""

    def __init__(
        self,
        model: DiffusionTransformer,
        tokenizer: Tokenizer,
        *,
        max_queue: int,
        max_batch_rows: int,
        max_batch_tokens: int | None = None,
        batch_wait: float = 0.0,
        own_samplers: bool = False,
    ) -> None:
        """`own_samplers`: every request runs its own sampler and none joins the cohort (the reference the
        cohort equals, kept for comparisons: `python -m benchmarks serve --own-samplers`)."""

        self.own_samplers = own_samplers
        self.model, self.tokenizer = model, tokenizer
        self.max_queue, self.max_batch_rows, self.batch_wait = max_queue, max_batch_rows, batch_wait
        # The running requests' positions (rows x (prompt + generated)): what their caches and passes hold.
        self.max_batch_tokens = max_batch_tokens or max_batch_rows * model.config.max_seq_len
        self.eos = special_token_id(tokenizer, "eos")
        self.schedule = model_schedule(model)
        self.stats = ServeStats(max_batch_rows)
        self._queue: deque[Job] = deque()
        self._ready = threading.Condition()
        self._greenlet = require(GREENLET)
        self._running: list[Job] = []
        self._samplers: list[_Running] = []  # the engine thread's alone: the running requests' samplers
        self._cohort = Cohort(model, tokenizer, self.schedule, self.eos, self.answer)  # the engine thread's alone
        self._joining: list[Job] = []  # started, to join the cohort at the engine's next round
        self._request_seconds = 1.0  # the last request's time: what a refused client is told to wait
        self._stopping = False
        self.failure: BaseException | None = None  # what stopped the scheduler, if anything did
        self._round_started: float | None = None  # when the engine's current round began (None: it waits)
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

        if job.generation.rows > self.max_batch_rows or job.generation.tokens > self.max_batch_tokens:
            raise ValueError(
                f"{job.generation.rows} rows of {job.generation.tokens} positions do not fit a batch of "
                f"{self.max_batch_rows} rows and {self.max_batch_tokens} positions"
            )
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

    def busy_seconds(self) -> float:
        """How long the engine's current round has run (0 while it waits for work): the heartbeat that
        /health reads, a round far longer than its passes take being a stalled engine."""

        started = self._round_started
        return 0.0 if started is None else time.monotonic() - started

    def retry_after(self) -> int:
        """Seconds a refused client should wait before it tries again: the queue in front of it, from the
        last request's time (the Retry-After of a 429 and of a 503)."""

        with self._ready:
            return self._retry_after()

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
        admitted = sum(job.generation.tokens for job in self._running)
        self.stats.queue_changed(len(self._queue), len(self._running), admitted)

    def _wait_for_pass(self, call: Call | Draw) -> None:
        """A running request's model call or token draw (in its greenlet): it suspends until the engine has
        answered it."""

        if self.failure is not None:  # no pass will come
            call.answer(error=SchedulerFailed(f"the server's scheduler has stopped: {self.failure!r}"))
            return
        self._greenlet.getcurrent().parent.switch(call)

    def _company_wait(self) -> float | None:
        """Seconds the oldest request still waits for company before it starts alone (None: no such wait)."""

        if self._running or not self._queue or self.batch_wait <= 0:
            return None
        if sum(job.generation.rows for job in self._queue) >= self.max_batch_rows:
            return None
        if sum(job.generation.tokens for job in self._queue) >= self.max_batch_tokens:
            return None
        left = self.batch_wait - (time.perf_counter() - self._queue[0].enqueued)
        return left if left > 0 else None

    def _start_queued(self) -> None:
        """Under the lock: start the queued requests that fit, oldest first, each as a greenlet of the engine."""

        if self._company_wait() is not None:
            return
        rows = sum(job.generation.rows for job in self._running)
        tokens = sum(job.generation.tokens for job in self._running)
        while self._queue and self._fits(self._queue[0].generation, rows, tokens):
            job = self._queue.popleft()
            rows, tokens = rows + job.generation.rows, tokens + job.generation.tokens
            self._running.append(job)
            if not self.own_samplers and joins_cohort(self.model, job.generation):
                self._joining.append(job)
            else:
                self._start_sampler(job)
        self._publish()

    def _start_sampler(self, job: Job) -> None:
        """`job` runs its own sampler, a greenlet of the engine, from the next round on."""

        self._samplers.append(_Running(job, self._greenlet.greenlet(partial(self._sample, job))))

    def _fits(self, generation: Generation, rows: int, tokens: int) -> bool:
        """Whether `generation` joins running requests of `rows` rows and `tokens` positions: admission by
        cost, oldest first (a request that does not fit waits, and so do those behind it)."""

        return rows + generation.rows <= self.max_batch_rows and tokens + generation.tokens <= self.max_batch_tokens

    def _wait_for_work(self) -> bool:
        """Under the lock: wait until a request runs (starting the queued ones that fit); False once stopped
        with nothing left."""

        while True:
            self._start_queued()
            if self._samplers or self._joining or len(self._cohort):
                return True
            if self._stopping and not self._queue:
                return False
            self._round_started = None
            self._ready.wait(self._company_wait())

    def _next_calls(self) -> list[Call] | None:
        """One round: every running request resumed until it makes its next model call or finishes; their
        calls (None once stopped with nothing left)."""

        with self._ready:
            if not self._wait_for_work():
                return None
        self._round_started = time.monotonic()
        calls: list[Call] = []
        resumed = list(self._samplers)
        while resumed:  # the token draws the requests make on the way are drawn together, within the round
            draws: list[Draw] = []
            drawing: list[_Running] = []
            for running in resumed:
                made = running.sampler.switch()  # the request's sampler, up to its next call or draw
                if running.sampler.dead:
                    self._samplers.remove(running)
                    continue
                running.call = made
                if isinstance(made, Draw):
                    draws.append(made)
                    drawing.append(running)
                else:
                    calls.append(made)
            run_draws(draws)
            resumed = drawing
        return calls + self._cohort_calls()

    def _cohort_calls(self) -> list[Call]:
        """The cohort's round: the requests started since the last one join it, and every request in it is
        taken to its next step that reveals something; their calls."""

        with self._ready:
            joining, self._joining = self._joining, []
        for job in joining:
            try:  # a request the cohort cannot take fails alone: the cohort is unchanged until it joins
                self._cohort.join(job)
            except OwnSampler:  # it starts its own sampler at the next round
                self._start_sampler(job)
            except Exception as exc:
                self._conclude(job, exc)
        try:
            return self._cohort.calls()
        except Exception as exc:  # a bug of the cohort's: its requests fail, the server goes on
            log.exception("the cohort failed")
            for finished in self._cohort.fail(exc):
                self._conclude(*finished)
            return []

    def _settle_cohort(self) -> None:
        try:
            finished = self._cohort.settle()
        except Exception as exc:  # a bug of the cohort's: its requests fail, the server goes on
            log.exception("the cohort failed")
            finished = self._cohort.fail(exc)
        for job, outcome, tokens, seconds in finished:
            self._conclude(job, outcome, tokens, seconds)

    def _conclude(self, job: Job, outcome: Outcome | BaseException, tokens: int = 0, seconds: float = 0.0) -> None:
        """A request's end, however it was sampled: counted, logged if it failed, and answered. A refusal of
        the sampler's (`UserError`) is the client's to read, a departure is counted; any other error is a bug
        or a device failure: this request fails, the server goes on."""

        if isinstance(outcome, Outcome):
            self._generated(tokens, seconds)
        elif isinstance(outcome, Departed):
            self.stats.count("left")
        elif not isinstance(outcome, UserError):
            log.error("request %s failed", job.request_id, exc_info=outcome)
        self._finished(job, outcome)

    def _run(self) -> None:
        """The engine's thread: on an error of its own, it fails every request, queued or running, and every
        later one (`SchedulerFailed`), and /health says so, rather than leave them waiting. Everything runs
        in inference mode, which the requests' samplers (greenlets of this thread) share."""

        with torch.inference_mode():
            try:
                self._loop()
            except BaseException as exc:
                log.exception("the scheduler stopped")
                self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._ready:
            self.failure = exc
            waiting, self._queue = list(self._queue), deque()
            self._publish()
        failed = SchedulerFailed(f"the server's scheduler has stopped: {exc!r}")
        for job in waiting:
            job.future.set_exception(failed)
        for job in self._joining:
            self._finished(job, failed)
        self._joining = []
        for finished in self._cohort.fail(failed):
            self._conclude(*finished)
        for running in self._samplers:  # each sampler ends on the error and answers its client
            if not running.sampler:  # never started: nothing to unwind
                self._finished(running.job, failed)
                continue
            while not running.sampler.dead:
                if running.call is not None:
                    running.call.answer(error=failed)
                running.call = running.sampler.switch()
        self._samplers = []

    def _loop(self) -> None:
        while True:
            calls = self._next_calls()
            if calls is None:
                return
            try:
                run_calls(self.model, calls, self.stats.pass_done)
            except Exception as exc:  # a bug outside any one pass: its requests fail, the server goes on
                log.exception("forward passes failed")
                for call in calls:
                    if not call.done:
                        call.answer(error=exc)
            self._settle_cohort()

    def _sample(self, job: Job) -> None:
        """A running request's greenlet: sample it, then answer it."""

        ended: Finished = (job, RuntimeError(f"request {job.request_id} ended without an outcome"), 0, 0.0)
        try:
            ended = self._generate(job)
        except Exception as exc:
            ended = (job, exc, 0, 0.0)
        finally:  # whatever ended it: the passes must not wait for it
            self._conclude(*ended)

    def _finished(self, job: Job, outcome: Outcome | BaseException) -> None:
        with self._ready:  # before the client hears: the figures must not count it as running
            self._running.remove(job)
            self._publish()
            self._ready.notify_all()
        if isinstance(outcome, BaseException):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)

    def _generate(self, job: Job) -> Finished:
        """Sample `job` as it would be sampled alone: its outcome (its streamed text sent to the end), the
        tokens it kept and the seconds it took."""

        generation = job.generation
        answer = self.answer(job)
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
            on_step=_step_watcher(job, answer),
            **asdict(generation.options),
        )
        seconds = time.perf_counter() - start
        return job, answer.outcome(result.token_ids, result.prompt_tokens), sum(result.lengths), seconds

    def answer(self, job: Job) -> Answer:
        return Answer(job, self.tokenizer, self.model.config.mask_token_id, self.eos, self.stats.first_text)

    def _generated(self, tokens: int, seconds: float) -> None:
        self._request_seconds = seconds
        self.stats.generated(tokens, seconds)


def _step_watcher(job: Job, answer: Answer) -> StepCallback:
    """The sampler's step callback: it streams the job's rows, and ends the request (`Departed`) once its
    client has gone."""

    length = job.generation.length

    def on_step(step: int, tokens: torch.Tensor) -> None:
        if job.cancelled.is_set():
            raise Departed
        if answer.streaming:  # one copy to the host a step, not one a row
            answer.update(tokens[:, tokens.shape[1] - length :].tolist())

    return on_step
