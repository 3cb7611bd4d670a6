"""`dlm serve` under load: a burst of concurrent streaming clients, then many requests one after another.

usage: python scripts/serve_load.py MODEL [--clients 256] [--sequential 10000] [--tokens 8]
                                    [--max-batch 32] [--max-queue 64] [--threads 1]

Starts `dlm serve MODEL` in a subprocess on a free port of 127.0.0.1 and, reading the server
process's /proc/PID/status (Linux) as it goes:

- **burst**: `--clients` streaming completions sent at once (asyncio and httpx, one connection each),
  `--tokens` new tokens each; it counts the answers by status (200 or 429 expected: more clients
  than `--max-queue` + `--max-batch` are told to come back; any 5xx is a failure) and records the
  server's most threads while they run;
- **sequential**: `--sequential` short completions one after another, the server's resident memory
  (VmRSS) after each thousand; it prints the last reading against the first (after the first
  thousand, once its allocator has grown to what a request uses).

It prints one JSON line per phase and exits 1 if the burst got a 5xx.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_bench import start_server


def status_field(pid: int, name: str) -> int:
    """A number of /proc/PID/status (`Threads`, `VmRSS` in kB)."""

    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    raise KeyError(name)


async def burst(url: str, pid: int, clients: int, tokens: int) -> dict[str, object]:
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
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(client(http, index) for index in range(clients)))
        done.set()
        await watcher
    return {
        "phase": "burst",
        "clients": clients,
        "statuses": dict(statuses),
        "seconds": time.perf_counter() - started,
        "threads_after": status_field(pid, "Threads"),
        "most_threads": most_threads,
    }


def sequential(url: str, pid: int, count: int) -> dict[str, object]:
    import httpx

    readings: list[int] = []
    failures = 0
    started = time.perf_counter()
    with httpx.Client(timeout=600) as http:
        for index in range(count):
            body = {"model": "model", "prompt": "ROMEO:", "max_tokens": 2, "seed": index}
            failures += http.post(f"{url}/v1/completions", json=body).status_code != 200
            if (index + 1) % 1000 == 0:
                readings.append(status_field(pid, "VmRSS"))
    first, last = readings[0], readings[-1]
    return {
        "phase": "sequential",
        "requests": count,
        "failures": failures,
        "seconds": time.perf_counter() - started,
        "rss_kb_per_thousand": readings,
        "last_over_first": last / first,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--sequential", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    process, url = start_server(args.model, args.max_batch, "cpu", args.threads, 0.0, max_queue=args.max_queue)
    try:
        burst_result = asyncio.run(burst(url, process.pid, args.clients, args.tokens))
        print(json.dumps(burst_result), flush=True)
        if args.sequential >= 1000:
            print(json.dumps(sequential(url, process.pid, args.sequential)), flush=True)
    finally:
        process.terminate()
        process.wait(60)
    if any(int(status) >= 500 or int(status) < 0 for status in burst_result["statuses"]):  # type: ignore[attr-defined]
        sys.exit(1)


if __name__ == "__main__":
    main()
