"""`dlm serve`: load a model once, then answer OpenAI's API on a local port until SIGTERM or Ctrl-C.

On SIGTERM (or SIGINT) the server stops accepting connections, lets the requests it holds (queued or
generating) finish within `grace_seconds`, stops the scheduler and returns; the process exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlm.artifacts.loading import load_model_with_info
from dlm.choices import ComputeDtype
from dlm.data.chat import ChatTemplate
from dlm.errors import UserError
from dlm.extras import Requirement, require
from dlm.runtime.allocator import keep_freed_memory
from dlm.runtime.device import compute_dtype, resolve_device
from dlm.runtime.threads import configure_cpu_threads
from dlm.sampling.dispatch import check_samplable
from dlm.sampling.options import SamplingOptions
from dlm.serving.app import FASTAPI, ServedModel, create_app
from dlm.serving.guard import RequestSink
from dlm.serving.protocol import Limits
from dlm.serving.scheduler import GREENLET, Scheduler

UVICORN = Requirement("uvicorn", "serve", "dlm serve")


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no key asked
    limits: Limits = field(default_factory=Limits)
    max_queue: int = 64  # requests waiting to start; more are answered 429
    max_batch_rows: int = 32  # rows (prompts x n) of the requests run together
    max_batch_tokens: int | None = None  # their positions, rows x (prompt + generated); None: rows x context
    batch_wait: float = 0.0  # seconds the oldest request waits for company when nothing runs
    grace_seconds: float = 30.0  # how long a shutdown waits for the requests it holds
    name: str | None = None  # the model's id in requests (default: the model directory's name)

    def __post_init__(self) -> None:
        limits = self.limits
        at_least_one = {
            "--max-queue": self.max_queue,
            "--max-batch": self.max_batch_rows,
            "--max-batch-tokens": self.max_batch_tokens,
            "--default-max-tokens": limits.default_max_tokens,
            "--max-n": limits.max_n,
            "--max-tokens": limits.max_tokens,
            "--max-prompt-tokens": limits.max_prompt_tokens,
            "--max-body-bytes": limits.max_body_bytes,
        }
        for option, value in at_least_one.items():
            if value is not None and value < 1:
                raise UserError(f"{option} must be at least 1 (got {value})")
        if not 0 <= self.port < 65536:
            raise UserError(f"--port must be in [0, 65535] (got {self.port})", fix="0 picks a free port")
        if not 0 < self.limits.stall_seconds < float("inf"):
            raise UserError(f"--stall-seconds must be a number of seconds > 0 (got {self.limits.stall_seconds})")
        timeout = self.limits.request_timeout
        if timeout is not None and not 0 < timeout < float("inf"):
            raise UserError(f"--request-timeout must be a number of seconds > 0 (got {timeout})")
        if not 0 <= self.grace_seconds < float("inf"):
            raise UserError(f"--grace must be a number of seconds >= 0 (got {self.grace_seconds})")
        if not 0 <= self.batch_wait <= 10:
            raise UserError(f"--batch-wait must be in [0, 10000] ms (got {self.batch_wait * 1000:g})")
        if self.api_key is not None and not self.api_key.strip():
            raise UserError("the API key is empty", fix="pass a non-empty --api-key or DLM_API_KEY, or neither")
        if self.limits.max_n > self.max_batch_rows:
            raise UserError(
                f"--max-n ({self.limits.max_n}) is more than --max-batch ({self.max_batch_rows})",
                fix="raise --max-batch or lower --max-n",
            )


def check_requirements() -> None:
    """Before the model loads: one error naming the `serve` extra when fastapi, uvicorn or greenlet is missing."""

    for requirement in (FASTAPI, UVICORN, GREENLET):
        require(requirement)


def load_served(
    path: str | Path, *, device: str = "cpu", dtype: ComputeDtype = "auto", name: str | None = None
) -> ServedModel:
    """The model at `path` (any source `dlm.load` reads) with its chat template, as a `ServedModel`."""

    wanted = compute_dtype(dtype)
    resolved = resolve_device(device)
    configure_cpu_threads(resolved)  # one thread per free core: more would spin against other work
    keep_freed_memory(resolved)  # on the CPU each request's steps reuse the memory of the last
    loaded = load_model_with_info(path, resolved, wanted)
    # A model no request could sample (a causal import not yet adapted) stops here, not at every request.
    check_samplable(loaded.model.config, SamplingOptions())
    template = ChatTemplate.for_tokenizer(loaded.info.tokenizer_path)
    template.check()  # a broken template stops the server before it listens
    served_name = name or Path(path).resolve().name
    return ServedModel(served_name, loaded.model, loaded.tokenizer, template, int(time.time()))


@contextmanager
def _signals_end_the_server() -> Iterator[None]:
    """uvicorn handles SIGINT and SIGTERM while it runs and raises them again once it has shut down;
    this handler (restored under uvicorn's) takes that second signal, so a graceful shutdown exits 0."""

    def handled(signum: int, frame: Any) -> None:
        pass

    if threading.current_thread() is not threading.main_thread():  # no signals there (a server in a test)
        yield
        return
    previous = {sig: signal.signal(sig, handled) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_can_listen(host: str, port: int) -> None:
    """Before uvicorn starts: one error line when the address cannot be bound (taken, unknown, not ours)."""

    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:  # socket.gaierror included
        raise UserError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            fix="choose another --port, or a --host of this machine",
        ) from None


class Server:
    """One model behind OpenAI's API; `run` blocks until a signal (or `stop`) ends it."""

    def __init__(self, served: ServedModel, settings: ServeSettings, on_request: RequestSink | None = None) -> None:
        uvicorn = require(UVICORN)
        self.settings = settings
        self.scheduler = Scheduler(
            served.model,
            served.tokenizer,
            max_queue=settings.max_queue,
            max_batch_rows=settings.max_batch_rows,
            max_batch_tokens=settings.max_batch_tokens,
            batch_wait=settings.batch_wait,
        )
        app = create_app(
            served,
            self.scheduler,
            limits=settings.limits,
            api_key=settings.api_key,
            on_request=on_request or (lambda record: None),
        )
        config = uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=settings.grace_seconds,
            lifespan="on",
        )
        self._server = uvicorn.Server(config)

    @property
    def started(self) -> bool:
        return bool(self._server.started)

    @property
    def port(self) -> int:
        """The bound port (the one asked, or the one the system chose for port 0)."""

        for server in getattr(self._server, "servers", []):
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.settings.port

    def run(self, on_started: Callable[[], None] | None = None) -> None:
        """Serve until SIGTERM / SIGINT (in the main thread) or `stop`, then shut down gracefully."""

        _check_can_listen(self.settings.host, self.settings.port)

        async def serving() -> bool:
            try:
                await self._server.serve()
            except SystemExit:  # how uvicorn reports a failed start, after logging why
                return False
            return True

        async def main() -> bool:
            task = asyncio.create_task(serving())
            while not self._server.started and not task.done():
                await asyncio.sleep(0.05)
            if self._server.started and on_started is not None:
                on_started()
            return await task

        with _signals_end_the_server():
            served = asyncio.run(main())
        if not served:
            raise UserError(
                f"cannot listen on {self.settings.host}:{self.settings.port}", fix="choose another --port or --host"
            )

    def stop(self) -> None:
        """Begin the graceful shutdown (from another thread)."""

        self._server.should_exit = True
