"""The HTTP application: OpenAI's endpoints over one fixed model and its `Scheduler`.

`/v1/models`, `/v1/completions`, `/v1/chat/completions` and `/health`. A request's body is read and
checked here (`dlm.serving.protocol`), queued for a batch, and answered as JSON or as server-sent
events. The model was chosen at start: a request names it only by its id and never by a path.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations, and `Request` is
# imported inside `create_app` (fastapi is the optional `serve` extra).
import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError
from tokenizers import Tokenizer

from dlm.data.chat import ChatTemplate
from dlm.diffusion.distillation import distilled_remasking, distilled_steps
from dlm.errors import UserError
from dlm.extras import Requirement, require
from dlm.model.transformer import DiffusionTransformer
from dlm.serving.guard import Guard, RequestSink
from dlm.serving.jobs import Job, Outcome, TextSink
from dlm.serving.mailbox import LoopMailbox
from dlm.serving.passes import OutOfMemory
from dlm.serving.protocol import (
    ApiError,
    Generation,
    Limits,
    check_generation,
    sampler_error,
    validation_error,
)
from dlm.serving.scheduler import QueueFull, Scheduler, ShuttingDown
from dlm.serving.shapes import CHAT, COMPLETION, Json, ResponseShape

log = logging.getLogger("dlm.serving")
FASTAPI = Requirement("fastapi", "serve", "dlm serve")
DISCONNECT_POLL_SECONDS = 0.2  # how often a waiting request checks that its client is still there
PARSING_THREADS = 2  # requests parsed, rendered and tokenized at once, off the event loop


class ClientGone(Exception):
    pass


@dataclass(frozen=True)
class ServedModel:
    """The model a server answers with: its id in requests, the loaded model and tokenizer, its chat template."""

    name: str
    model: DiffusionTransformer
    tokenizer: Tokenizer
    template: ChatTemplate
    created: int


class HttpRequest(Protocol):
    """What the handlers use of a request (Starlette's, in the `serve` extra)."""

    scope: dict[str, Any]

    async def body(self) -> bytes: ...

    async def is_disconnected(self) -> bool: ...


def _completion_body(shape: ResponseShape, request_id: str, served: ServedModel, outcome: Outcome) -> Json:
    return {
        "id": shape.response_id(request_id),
        "object": shape.answer_object,
        "created": int(time.time()),
        "model": served.name,
        "choices": [shape.choice(index, choice) for index, choice in enumerate(outcome.choices)],
        "usage": _usage(outcome),
    }


def _usage(outcome: Outcome) -> dict[str, int]:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
    }


def _read_exception(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _event(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _queue_full(max_queue: int, retry_after: int) -> ApiError:
    return ApiError(
        429,
        f"the server is busy: its queue holds {max_queue} requests; retry after {retry_after} s",
        kind="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after)},
    )


class Endpoints:
    """The routes' work, apart from FastAPI's wiring."""

    def __init__(self, served: ServedModel, scheduler: Scheduler, limits: Limits) -> None:
        self.served, self.scheduler, self.limits = served, scheduler, limits
        # A fixed pool: the server's threads do not grow with its connections.
        self.parsing = ThreadPoolExecutor(max_workers=PARSING_THREADS, thread_name_prefix="dlm-parse")
        self._mailbox: LoopMailbox | None = None

    def mailbox(self) -> LoopMailbox:
        """The running event loop's mailbox for streamed text (made at its first stream)."""

        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = LoopMailbox(loop)
        return self._mailbox

    def models(self) -> Json:
        return {"object": "list", "data": [self.model(self.served.name)]}

    def model(self, name: str) -> Json:
        """The model object of `name` (`GET /v1/models/{name}`): this server's one model, else 404."""

        if name != self.served.name:
            served = self.served.name
            message = f"the model {name!r} does not exist; this server serves {served!r}"
            raise ApiError(404, message, param="model", code="model_not_found")
        return {"id": name, "object": "model", "created": self.served.created, "owned_by": "dlm"}

    async def read(self, request: HttpRequest, shape: ResponseShape) -> Generation:
        """The request's generation, parsed, rendered and tokenized off the event loop (in the small
        `parsing` pool), so that a long prompt never holds up the other connections."""

        raw = await request.body()
        return await asyncio.get_running_loop().run_in_executor(self.parsing, self.parse, raw, shape)

    def parse(self, raw: bytes, shape: ResponseShape) -> Generation:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"the body is not valid JSON ({str(exc)[:200]})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        try:
            parsed = shape.request_model.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        prompts = shape.prompts(parsed, self.served.template)
        generation = check_generation(
            parsed,
            prompts,
            chat=shape is CHAT,
            served=self.served.name,
            config=self.served.model.config,
            tokenizer=self.served.tokenizer,
            limits=self.limits,
            model_steps=distilled_steps(self.served.model),
            model_remasking=distilled_remasking(self.served.model),
        )
        if generation.rows > self.scheduler.max_batch_rows:
            raise ApiError(
                400,
                f"n times the prompts is {generation.rows} rows, more than a batch holds "
                f"({self.scheduler.max_batch_rows})",
                param="n",
            )
        if generation.tokens > self.scheduler.max_batch_tokens:
            raise ApiError(
                400,
                f"the request's rows hold {generation.tokens} positions (prompt and max_tokens, times n), more "
                f"than a batch holds ({self.scheduler.max_batch_tokens}); ask for fewer tokens or samples",
                param="max_tokens",
            )
        return generation

    def refuse_if_full(self) -> None:
        retry_after = self.scheduler.retry_after_if_full()
        if retry_after is not None:
            self.scheduler.stats.count("rejected")
            raise _queue_full(self.scheduler.max_queue, retry_after)

    def submit(self, request_id: str, generation: Generation, on_text: TextSink | None = None) -> Job:
        job = Job(request_id, generation, on_text=on_text)
        try:
            self.scheduler.submit(job)
        except QueueFull as exc:
            self.scheduler.stats.count("rejected")
            raise _queue_full(self.scheduler.max_queue, exc.retry_after) from None
        except ShuttingDown as exc:
            raise self._unavailable(str(exc)) from None
        return job

    async def wait(
        self, request: HttpRequest, job: Job, texts: asyncio.Queue[tuple[int, str]] | None = None
    ) -> AsyncGenerator[tuple[int, str] | Outcome, None]:
        """The texts a streaming job sends as they come, then its outcome; `ClientGone` (the job dropped)
        when the client leaves first."""

        waiter = asyncio.wrap_future(job.future)
        getter: asyncio.Future[tuple[int, str]] | None = None
        try:
            while True:
                if texts is not None and getter is None:
                    getter = asyncio.ensure_future(texts.get())
                waiting: set[asyncio.Future[Any]] = {waiter} if getter is None else {waiter, getter}
                await asyncio.wait(waiting, timeout=self._poll_seconds(job), return_when=asyncio.FIRST_COMPLETED)
                if self._past_deadline(job) and not waiter.done():  # a stream's texts do not keep it going
                    raise self._timed_out(job)
                if getter is not None and getter.done():
                    yield getter.result()
                    getter = None
                elif waiter.done():
                    while texts is not None and not texts.empty():  # sent before the outcome, not yet read
                        yield texts.get_nowait()
                    yield waiter.result()
                    return
                elif await request.is_disconnected():
                    raise ClientGone
        except (ShuttingDown, OutOfMemory) as exc:
            raise self._unavailable(f"the request did not run: {exc}") from None
        except UserError as exc:  # the sampler's own checks (steps for the blocks, a block model's options)
            raise sampler_error(exc) from None
        finally:
            if getter is not None:
                getter.cancel()
            if not job.future.done():
                if not job.cancelled.is_set():  # the client left (a request past its deadline was counted)
                    self.scheduler.cancel(job)
                    self.scheduler.stats.count("dropped")
                waiter.add_done_callback(_read_exception)  # nobody will: asyncio would log it as lost

    def _unavailable(self, message: str) -> ApiError:
        """503, with the seconds to wait before a retry (shutting down, a stopped scheduler, out of memory)."""

        retry_after = str(self.scheduler.retry_after())
        return ApiError(503, message, kind="server_error", headers={"Retry-After": retry_after})

    def _past_deadline(self, job: Job) -> bool:
        timeout = job.generation.timeout
        return timeout is not None and time.perf_counter() - job.enqueued > timeout

    def _poll_seconds(self, job: Job) -> float:
        """How long to wait for the job before looking at its client again: no later than its deadline."""

        timeout = job.generation.timeout
        if timeout is None:
            return DISCONNECT_POLL_SECONDS
        left = job.enqueued + timeout - time.perf_counter()
        return min(DISCONNECT_POLL_SECONDS, max(left, 0.0) + 1e-3)  # just past it, where it is due

    def _timed_out(self, job: Job) -> ApiError:
        """Past its deadline: the request leaves the queue or its batch (before its next pass), and 504."""

        self.scheduler.cancel(job)
        self.scheduler.stats.count("timed_out")
        return ApiError(
            504,
            f"the request took more than its {job.generation.timeout:g} s (its own timeout, or the server's "
            "--request-timeout)",
            kind="server_error",
            code="timeout",
        )

    async def outcome(self, request: HttpRequest, job: Job) -> Outcome:
        async with aclosing(self.wait(request, job)) as items:
            async for item in items:
                assert isinstance(item, Outcome)
                return item
        raise AssertionError("a job ends with its outcome")

    def answer(self, shape: ResponseShape, request_id: str, job: Job, outcome: Outcome) -> Json:
        self.scheduler.stats.answered(time.perf_counter() - job.enqueued)
        return _completion_body(shape, request_id, self.served, outcome)

    async def stream(
        self,
        request: HttpRequest,
        shape: ResponseShape,
        request_id: str,
        job: Job,
        texts: asyncio.Queue[tuple[int, str]],
    ) -> AsyncIterator[str]:
        """Server-sent events: each choice's text as it becomes final (`dlm.serving.rows`), then the finish
        reasons, the usage when asked, and `[DONE]`."""

        response_id, created, rows = shape.response_id(request_id), int(time.time()), job.generation.rows

        def chunk(choices: list[Json], **extra: Any) -> str:
            return _event(
                {
                    "id": response_id,
                    "object": shape.chunk_object,
                    "created": created,
                    "model": self.served.name,
                    "choices": choices,
                    **extra,
                }
            )

        try:
            openings = [opening for index in range(rows) if (opening := shape.opening(index)) is not None]
            if openings:
                yield chunk(openings)
            async with aclosing(self.wait(request, job, texts)) as items:
                async for item in items:
                    if isinstance(item, Outcome):
                        outcome = item
                        break
                    index, text = item
                    if text:
                        yield chunk([shape.piece(index, text)])
            self.scheduler.stats.answered(time.perf_counter() - job.enqueued)
            # The last events in one write (one send and system call, not one an event).
            tail = [chunk([shape.ending(index, choice.finish_reason)]) for index, choice in enumerate(outcome.choices)]
            if job.generation.include_usage:
                tail.append(chunk([], usage=_usage(outcome)))
            yield "".join([*tail, _event("[DONE]")])
        except ClientGone:
            return
        except ApiError as exc:
            yield _event(exc.body())
        except Exception:  # headers are sent: the error goes in the stream, the traceback to the log
            log.exception("request %s failed while streaming", request_id)
            self.scheduler.stats.count("errors")
            yield _event(ApiError(500, f"internal error (request {request_id})", kind="server_error").body())


def create_app(
    served: ServedModel, scheduler: Scheduler, *, limits: Limits, api_key: str | None, on_request: RequestSink
) -> Any:
    """The ASGI application (FastAPI inside `Guard`); it starts the scheduler and stops it at shutdown."""

    fastapi = require(FASTAPI)
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    endpoints = Endpoints(served, scheduler, limits)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)
            endpoints.parsing.shutdown(wait=False)

    app = fastapi.FastAPI(title="dlm serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Any, exc: ApiError) -> Any:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Any, exc: StarletteHTTPException) -> Any:  # no such route or method
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind).body()
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Any, exc: Exception) -> Any:  # the traceback goes to the log (Guard)
        scheduler.stats.count("errors")
        request_id = request.scope.get("state", {}).get("request_id", "?")
        return JSONResponse(
            ApiError(500, f"internal error (request {request_id})", kind="server_error").body(), status_code=500
        )

    @app.get("/health")
    async def health() -> Any:
        snapshot = scheduler.stats.snapshot()
        figures = {"model": served.name, "in_flight": snapshot.in_flight, "queued": snapshot.queued}
        if scheduler.failure is not None:  # requests are refused: a load balancer must take it out
            return JSONResponse({"status": "error", "error": repr(scheduler.failure), **figures}, status_code=503)
        busy = scheduler.busy_seconds()
        if busy > limits.stall_seconds:  # one round (its passes) far past what it should take: stalled
            return JSONResponse({"status": "stalled", "round_seconds": busy, **figures}, status_code=503)
        return {"status": "ok", **figures}

    @app.get("/v1/models")
    async def models() -> Any:
        return endpoints.models()

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Any:
        return endpoints.model(name)

    async def complete(request: HttpRequest, shape: ResponseShape) -> Any:
        request_id = request.scope["state"]["request_id"]
        endpoints.refuse_if_full()  # before the body is parsed and tokenized
        generation = await endpoints.read(request, shape)
        if generation.stream:
            texts: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
            mailbox = endpoints.mailbox()

            def on_text(index: int, text: str) -> None:  # from the scheduler's thread
                mailbox.put(texts, (index, text))

            job = endpoints.submit(request_id, generation, on_text)
            return StreamingResponse(
                endpoints.stream(request, shape, request_id, job, texts),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        job = endpoints.submit(request_id, generation)
        try:
            outcome = await endpoints.outcome(request, job)
        except ClientGone:
            return Response(status_code=499)
        return endpoints.answer(shape, request_id, job, outcome)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, CHAT)

    return Guard(app, api_key=api_key, max_body_bytes=limits.max_body_bytes, on_request=on_request)
