"""`dlm serve MODEL`: an OpenAI-compatible server for a model (docs/serving.md)."""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dlm.cli.common import DeviceOption, DtypeOption, JsonOption, console, err_console, wants_json

if TYPE_CHECKING:
    from dlm.model.transformer import DiffusionTransformer

DEFAULT_BODY_BYTES = 1 << 20


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


ModelArgument = Annotated[Path, typer.Argument(metavar="MODEL", help="Exported model directory (or a checkpoint).")]
HostOption = Annotated[str, typer.Option("--host", help="Address to listen on; 0.0.0.0 exposes the server.")]
PortOption = Annotated[int, typer.Option("--port", help="Port to listen on (0: any free one).")]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="DLM_API_KEY",
        show_envvar=True,
        show_default=False,
        help="Require 'Authorization: Bearer KEY' on every request but /health.",
    ),
]
NameOption = Annotated[
    str | None, typer.Option("--name", help="The model's id in requests (default: MODEL's name).", show_default=False)
]
MaxTokensOption = Annotated[
    int | None,
    typer.Option(
        "--max-tokens",
        show_default=False,
        help="Most tokens a request may generate (default: the model's context; a block model's window).",
    ),
]
MaxNOption = Annotated[int, typer.Option("--max-n", help="Most samples (n) or prompts per request.")]
MaxPromptOption = Annotated[
    int | None,
    typer.Option("--max-prompt-tokens", show_default=False, help="Longest prompt (default: the model's context)."),
]
MaxBodyOption = Annotated[int, typer.Option("--max-body-bytes", help="Largest request body; larger ones get 413.")]
MaxQueueOption = Annotated[int, typer.Option("--max-queue", help="Requests waiting to start; more get 429.")]
MaxBatchOption = Annotated[int, typer.Option("--max-batch", help="Rows (prompts x n) of the requests run together.")]
MaxBatchTokensOption = Annotated[
    int | None,
    typer.Option(
        "--max-batch-tokens",
        show_default=False,
        help="Positions (rows x (prompt + max_tokens)) of the requests run together: queued requests start "
        "oldest first while they fit (default: --max-batch x the model's context).",
    ),
]
DefaultMaxTokensOption = Annotated[
    int | None,
    typer.Option(
        "--default-max-tokens",
        show_default=False,
        help="Tokens a request without max_tokens generates, at most its room (default: 256, "
        "dlm.serving.protocol.DEFAULT_MAX_TOKENS).",
    ),
]
BatchWaitOption = Annotated[
    float,
    typer.Option(
        "--batch-wait", help="Milliseconds the oldest request waits for others to start with it, when nothing runs."
    ),
]
GraceOption = Annotated[float, typer.Option("--grace", help="Seconds a shutdown waits for the requests it holds.")]
RequestTimeoutOption = Annotated[
    float | None,
    typer.Option(
        "--request-timeout",
        show_default=False,
        help="Seconds a request may take from its arrival to "
        "its answer; past them it leaves its batch and gets 504 (default: no deadline).",
    ),
]


StallOption = Annotated[
    float,
    typer.Option(
        "--stall-seconds",
        help="/health answers 503 (stalled) while one round of the engine (its passes) has run this long.",
    ),
]


def serve_command(
    model: ModelArgument,
    host: HostOption = "127.0.0.1",
    port: PortOption = 8000,
    api_key: ApiKeyOption = None,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    name: NameOption = None,
    max_tokens: MaxTokensOption = None,
    default_max_tokens: DefaultMaxTokensOption = None,
    max_n: MaxNOption = 8,
    max_prompt_tokens: MaxPromptOption = None,
    max_body_bytes: MaxBodyOption = DEFAULT_BODY_BYTES,
    max_queue: MaxQueueOption = 64,
    max_batch: MaxBatchOption = 32,
    max_batch_tokens: MaxBatchTokensOption = None,
    batch_wait: BatchWaitOption = 0.0,
    grace: GraceOption = 30.0,
    request_timeout: RequestTimeoutOption = None,
    stall_seconds: StallOption = 60.0,
    json_output: JsonOption = False,
) -> None:
    """Serve MODEL with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, /health."""

    # lazy: keeps torch out of `dlm --help` and of every other command's start
    from dlm.serving.protocol import Limits
    from dlm.serving.server import Server, ServeSettings, check_requirements, load_served

    limits = Limits(
        max_tokens=max_tokens,
        max_n=max_n,
        max_prompt_tokens=max_prompt_tokens,
        max_body_bytes=max_body_bytes,
        request_timeout=request_timeout,
        stall_seconds=stall_seconds,
        **({} if default_max_tokens is None else {"default_max_tokens": default_max_tokens}),
    )
    settings = ServeSettings(
        host=host,
        port=port,
        api_key=api_key,
        limits=limits,
        max_queue=max_queue,
        max_batch_rows=max_batch,
        max_batch_tokens=max_batch_tokens,
        batch_wait=batch_wait / 1000,
        grace_seconds=grace,
        name=name,
    )
    check_requirements()
    served = load_served(model, device=device, dtype=dtype, name=name)
    from dlm.cli.serve_view import ServeConsole

    view: ServeConsole | None = None

    def request(record: dict[str, object]) -> None:
        if view is not None:
            view.request(record)

    server = Server(served, settings, on_request=request)
    live = not wants_json(json_output) and sys.stderr.isatty()
    view = ServeConsole(
        server.scheduler.stats,
        live=live,
        url=f"http://{host}:{port}",
        model=served.name,
        console=console,
        computes=_computes(served.model),
    )

    def started() -> None:
        assert view is not None
        if api_key is None and not _is_loopback(host):
            err_console.print(
                f"[yellow]warning:[/] serving on {host} without --api-key: anyone who reaches it can use it"
            )
        view.url = f"http://{host}:{server.port}"
        view.start()

    try:
        server.run(on_started=started)
    finally:
        view.close()


def _computes(model: DiffusionTransformer) -> str:
    """What the served model computes in, where: a bfloat16 export served in float32 on a CPU without
    native bfloat16 says so."""

    from dlm.config.shapes import format_parameter_count
    from dlm.runtime.device import dtype_name

    weight = next(iter(model.parameters()))
    return f"{format_parameter_count(model.num_parameters)} parameters in {dtype_name(weight.dtype)} on {weight.device}"


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
