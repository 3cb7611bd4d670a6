"""`dlm serve` under load: a burst of concurrent streaming clients, then many requests one after another.

It starts `dlm serve MODEL` (`benchmarks.serve.start_server`) and reads the server process's
/proc/PID/status (Linux) as it goes:
- burst: `--clients` streaming completions sent at once (asyncio and httpx, one connection each),
  `--tokens` new tokens each. Every answer must be 200 or 429 (more clients than `--max-queue` +
  `--max-batch` are told to come back); a 5xx, or a client that got no answer, fails the run (exit 1,
  after the result file is written). The server's most threads while they run is kept: it holds no
  thread per request.
- sequential: `--sequential` short completions one after another, the server's resident memory
  (VmRSS) after each thousand; the last reading over the first (taken after the first thousand,
  once its allocator has grown to what a request uses) says whether memory stays flat.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks import harness
from benchmarks.serve import start_server, stop_server
from dlm.bench.measure import timed


def status_field(pid: int, name: str) -> int:
    """A number of /proc/PID/status (`Threads`, `VmRSS` in kB)."""

    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise KeyError(name)


async def burst(url: str, pid: int, clients: int, tokens: int) -> dict[str, Any]:
    """Send `clients` streaming completions at once: their answers by status (-1: none), the server's threads."""

    import httpx

    statuses: Counter[int] = Counter()
    most_threads = status_field(pid, "Threads")
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal most_threads
        while not done.is_set():
            most_threads = max(most_threads, status_field(pid, "Threads"))
            await asyncio.sleep(0.05)

    async def client(http: httpx.AsyncClient, index: int) -> None:
        body = {"model": "model", "prompt": "ROMEO:", "max_tokens": tokens, "seed": index, "stream": True}
        try:
            async with http.stream("POST", f"{url}/v1/completions", json=body) as answer:
                async for _ in answer.aiter_lines():
                    pass
                statuses[answer.status_code] += 1
        except httpx.HTTPError as exc:
            statuses[-1] += 1
            print(f"client {index}: {exc!r}", file=sys.stderr)

    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(client(http, index) for index in range(clients)))
        done.set()
        await watcher
    return {
        "clients": clients,
        "statuses": {str(status): count for status, count in sorted(statuses.items())},
        "failures": sum(count for status, count in statuses.items() if status >= 500 or status < 0),
        "threads_after": status_field(pid, "Threads"),
        "most_threads": most_threads,
    }


def sequential(url: str, pid: int, count: int) -> tuple[dict[str, Any], list[int]]:
    """`count` two-token completions one after another: failures, and VmRSS (kB) after each thousand."""

    import httpx

    readings: list[int] = []
    failures = 0
    with httpx.Client(timeout=600) as http:
        for index in range(count):
            body = {"model": "model", "prompt": "ROMEO:", "max_tokens": 2, "seed": index}
            failures += http.post(f"{url}/v1/completions", json=body).status_code != 200
            if (index + 1) % 1000 == 0:
                readings.append(status_field(pid, "VmRSS"))
    figures = {
        "requests": count,
        "failures": failures,
        "rss_kb_first": readings[0],
        "rss_kb_last": readings[-1],
        "last_over_first": readings[-1] / readings[0],
    }
    return figures, readings


def serve_load(
    model: Annotated[Path, typer.Argument(help="The exported model directory (`dlm export`).")],
    clients: Annotated[int, typer.Option(help="Streaming clients of the burst, sent at once.")] = 256,
    sequential_requests: Annotated[
        int, typer.Option("--sequential", help="Requests one after another (under 1000: none).")
    ] = 10_000,
    tokens: Annotated[int, typer.Option(help="New tokens a burst request.")] = 8,
    max_batch: Annotated[int, typer.Option(help="The server's --max-batch.")] = 32,
    max_queue: Annotated[int, typer.Option(help="The server's --max-queue.")] = 64,
    threads: Annotated[int, typer.Option(help="The server's intra-op threads.")] = 1,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """A burst of streaming clients gets 200 or 429, never a 5xx; resident memory over many sequential requests."""

    run = harness.start(
        "serve-load",
        model=str(model),
        clients=clients,
        sequential=sequential_requests,
        tokens=tokens,
        max_batch=max_batch,
        max_queue=max_queue,
        threads=threads,
    )
    figures: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    process, url = start_server(model, max_batch, "cpu", threads, 0.0, max_queue=max_queue)
    try:
        outcome: list[Any] = []
        timing = timed(lambda: outcome.append(asyncio.run(burst(url, process.pid, clients, tokens))))
        figures["burst"] = outcome.pop() | {"seconds": timing.wall_s}
        if sequential_requests >= 1000:
            timing = timed(lambda: outcome.append(sequential(url, process.pid, sequential_requests)))
            sequential_figures, raw["rss_kb_per_thousand"] = outcome.pop()
            figures["sequential"] = sequential_figures | {"seconds": timing.wall_s}
    finally:
        stop_server(process)
    path = run.save(figures, raw, results=results)
    burst_figures = figures["burst"]
    typer.echo(
        f"burst of {clients}: statuses {burst_figures['statuses']}, {burst_figures['most_threads']} threads at most"
    )
    if "sequential" in figures:
        ratio = figures["sequential"]["last_over_first"]
        typer.echo(f"{sequential_requests} sequential: server VmRSS last / first thousand {ratio:.3f}")
    typer.echo(f"wrote {path}")
    if burst_figures["failures"]:
        typer.echo(f"error: {burst_figures['failures']} burst request(s) got a 5xx or no answer", err=True)
        raise typer.Exit(1)
