"""`dlm serve` under 1, 4, 16 and 64 concurrent clients against `dlm.sample` one request at a time.

usage: python scripts/serve_bench.py MODEL [--clients 1,4,16,64] [--tokens N] [--requests-per-client N]
                                     [--rounds N] [--threads N] [--device cpu] [--batch-wait MS]
                                     [--steps N] [--block-length N] [--cache prefix|dual] [--threshold P]
                                     [--remasking NAME] [--stream]
       python scripts/serve_bench.py MODEL --pass-cost [--clients 1,4,16,64] [--tokens N] [--threads N]
                                     [--block-length N] [--cache prefix|dual]

The sampler options (`--steps`, default one a token, `--block-length`, `--cache`, `--threshold`,
`--remasking`) go to both sides alike: `dlm.sample`'s arguments and the requests' extra body fields.

`--pass-cost` times only the model's forward pass of one denoising step over batches of 1, 4, ...
rows of the benchmark's shape, interleaved, and prints the time per row: the most any batching of
requests can save on this machine is the first row's cost over the others. The step it times is the
one the options make halfway through the tokens to generate (after a 16-token prompt): the whole
sequence (a whole-sequence model without a cache), the positions from the current block on over the
cached prefix (`--cache prefix`), the block alone over the cached rest (`--cache dual`), or one
model block over the cached prefix (a block model, which always keeps its exact cache).

Both the server and this process run `--threads` intra-op threads (default 1: on shared cores,
threads beyond the free ones spin against other work and can make a pass several times slower;
0: as many as the machine has cores, torch's own default).

Starts `dlm serve MODEL` in a subprocess on a free port of 127.0.0.1 (batches of up to the largest
client count), then, for each round and each client count C, runs two phases back to back:
- one at a time: `dlm.sample` in this process on C x `--requests-per-client` prompts, each call
  alone, as a program without a server would;
- served: C clients (the `openai` client, each in its own thread) send the same requests, each
  client its share one after another, so up to C requests wait together and share batches.
Every request is `--tokens` new tokens after one of a few prompts of different lengths, with its own
seed, the sampler options above (by default the sampler's defaults, one token a step) and a stop at
the end of document, in both phases.
Tokens/s counts the generated tokens kept (up to an end of document) over the phase's wall time;
latency is per request (one at a time: the call alone, no waiting for the calls before it).

With `--stream` the served requests stream (with their usage), and the table adds each one's time
from sending to its first text (p50, p99).

The phases are interleaved round by round, so other work on shared cores slows them alike: read
the ratios, not the absolute figures. The table shows the best round of each phase (the least
disturbed) and the ratio of the served tokens/s to the one-at-a-time tokens/s of the same C.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "ROMEO:",
    "JULIET: O Romeo, Romeo, wherefore art thou",
    "To be, or not to be",
    "HAMLET:",
    "Now is the winter of our discontent",
    "KING LEAR: Blow, winds",
    "",
    "MACBETH: Is this a dagger",
]


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(fraction * len(ordered) + 0.5) - 1)]


def requests_for(clients: int, per_client: int) -> list[tuple[str, int]]:
    return [(PROMPTS[i % len(PROMPTS)], 1000 + i) for i in range(clients * per_client)]


def sampler_options(args: argparse.Namespace) -> dict[str, Any]:
    """The sampler options both sides get: `dlm.sample`'s keywords, the requests' extra body fields."""

    options = {
        "steps": args.steps or args.tokens,
        "block_length": args.block_length,
        "cache": args.cache,
        "threshold": args.threshold,
        "remasking": args.remasking,
    }
    return {name: value for name, value in options.items() if value is not None}


def one_at_a_time(
    model: Any, tokenizer: Any, requests: list[tuple[str, int]], tokens: int, options: dict[str, Any]
) -> dict[str, float]:
    import dlm

    latencies, generated = [], 0
    start = time.perf_counter()
    for prompt, seed in requests:
        began = time.perf_counter()
        result = dlm.sample(model, tokenizer, prompt=prompt, length=tokens, seed=seed, stop_at_end=True, **options)
        latencies.append(time.perf_counter() - began)
        generated += sum(result.lengths)
    return summary(generated, time.perf_counter() - start, latencies)


def served(
    url: str, requests: list[tuple[str, int]], clients: int, tokens: int, options: dict[str, Any], stream: bool = False
) -> dict[str, float]:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    latencies: list[float] = []
    first_texts: list[float] = []
    generated = [0]
    lock = threading.Lock()

    def run(share: list[tuple[str, int]]) -> None:
        for prompt, seed in share:
            began = time.perf_counter()
            if stream:
                first, count = streamed(prompt, seed)
            else:
                answer = client.completions.create(
                    model="model", prompt=prompt, max_tokens=tokens, seed=seed, extra_body=options
                )
                first, count = None, answer.usage.completion_tokens if answer.usage else 0
            with lock:
                latencies.append(time.perf_counter() - began)
                generated[0] += count
                if first is not None:
                    first_texts.append(first - began)

    def streamed(prompt: str, seed: int) -> tuple[float | None, int]:
        """The time of the stream's first text, and the tokens its usage counts."""

        first, count = None, 0
        for chunk in client.completions.create(
            model="model",
            prompt=prompt,
            max_tokens=tokens,
            seed=seed,
            extra_body=options,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
            if chunk.usage:
                count = chunk.usage.completion_tokens
        return first, count

    threads = [threading.Thread(target=run, args=(requests[i::clients],)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result = summary(generated[0], time.perf_counter() - start, latencies)
    if first_texts:
        result |= {"first_text_p50": statistics.median(first_texts), "first_text_p99": percentile(first_texts, 0.99)}
    return result


def summary(tokens: int, seconds: float, latencies: list[float]) -> dict[str, float]:
    return {
        "tokens_per_second": tokens / seconds,
        "p50": statistics.median(latencies),
        "p99": percentile(latencies, 0.99),
        "tokens": tokens,
    }


def start_server(
    model: Path, max_batch: int, device: str, threads: int, batch_wait: float, max_queue: int | None = None
) -> tuple[subprocess.Popen[str], str]:
    """`dlm serve MODEL` on a free port of 127.0.0.1 (one sample a request, a queue of `max_queue`, by
    default four batches), its console drained; the process and its URL."""

    command = [
        sys.executable,
        "-m",
        "dlm",
        "serve",
        str(model),
        "--port",
        "0",
        "--json",
        "--name",
        "model",
        "--device",
        device,
        "--max-batch",
        str(max_batch),
        "--max-n",
        "1",
        "--max-queue",
        str(4 * max_batch if max_queue is None else max_queue),
        "--batch-wait",
        str(batch_wait),
    ]
    environment = os.environ | {"OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        sys.exit(f"error: dlm serve did not start (exit status {process.wait()})")
    start = json.loads(line)
    threading.Thread(target=process.stdout.read, daemon=True).start()  # keep its pipe drained
    return process, start["url"]


def step_pass(model: Any, rows: int, tokens: int, cache_mode: str | None, block_length: int | None, device: str) -> Any:
    """The forward pass of one denoising step halfway through `tokens` after a 16-token prompt, for `rows`
    rows, as a function to time: its cache, if any, is filled beforehand."""

    import torch

    from dlm.model.attention import KVCache
    from dlm.model.denoiser import block_size

    block = block_size(model.config) or (block_length if cache_mode else None)
    width = min(model.config.max_seq_len, tokens + 16)  # the benchmark's shape: a short prompt, then the tokens
    sequence = torch.randint(3, model.config.vocab_size, (rows, width), device=device)
    if block is None:  # the whole sequence, the tokens to generate scored
        scored = torch.zeros_like(sequence, dtype=torch.bool)
        scored[:, width - tokens :] = True
        return lambda: model(sequence, scored)
    start = (width - tokens // 2) // block * block  # the current block, halfway through
    end = min(start + block, width)
    fed_end = width if cache_mode == "prefix" else end
    cache = KVCache(committing=True)
    kept = sequence[:, :start] if cache_mode != "dual" else torch.cat((sequence[:, :start], sequence[:, end:]), 1)
    with torch.inference_mode():
        model(kept, torch.zeros_like(kept, dtype=torch.bool), cache=cache)
    cache.committing, cache.length = False, start  # the fed block's rotary positions start at the block
    fed = sequence[:, start:fed_end]
    scored = torch.zeros_like(fed, dtype=torch.bool)
    scored[:, : end - start] = True
    return lambda: model(fed, scored, cache=cache)


def pass_cost(
    model: Any,
    counts: list[int],
    tokens: int,
    device: str,
    cache_mode: str | None,
    block_length: int | None,
    rounds: int = 8,
) -> None:
    """Median seconds per row of one step's forward pass at each batch size, the sizes interleaved."""

    import torch

    passes = {count: step_pass(model, count, tokens, cache_mode, block_length, device) for count in counts}
    times: dict[int, list[float]] = {count: [] for count in counts}
    with torch.inference_mode():
        for round_ in range(rounds + 1):  # the first round warms up
            for count in counts:
                start = time.perf_counter()
                passes[count]()
                if round_:
                    times[count].append((time.perf_counter() - start) / count)
    first = statistics.median(times[counts[0]])
    print("| rows a pass | ms per row | saved against the first |")
    print("|---:|---:|---:|")
    for count in counts:
        per_row = statistics.median(times[count])
        print(f"| {count} | {per_row * 1000:.2f} | {first / per_row:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of both sides (0: one a core)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-wait", type=float, default=0.0, help="the server's --batch-wait (ms)")
    parser.add_argument("--pass-cost", action="store_true", help="time the forward pass per row instead")
    parser.add_argument("--steps", type=int, help="denoising steps (default: one a token)")
    parser.add_argument("--block-length", type=int)
    parser.add_argument("--cache", choices=["prefix", "dual"])
    parser.add_argument("--threshold", type=float)
    parser.add_argument("--remasking")
    parser.add_argument("--stream", action="store_true", help="served requests stream: time to first text too")
    args = parser.parse_args()
    counts = [int(count) for count in args.clients.split(",")]
    threads = args.threads or os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(threads)  # this process and the server: the same threads
    options = sampler_options(args)

    import torch

    import dlm

    torch.set_num_threads(threads)
    model, tokenizer = dlm.load(args.model, device=args.device)
    if args.pass_cost:
        pass_cost(model, counts, args.tokens, args.device, args.cache, args.block_length)
        return
    process, url = start_server(args.model, max(counts), args.device, threads, args.batch_wait)
    best: dict[tuple[str, int], dict[str, float]] = {}
    try:
        for _ in range(args.rounds):
            for clients in counts:
                requests = requests_for(clients, args.requests_per_client)
                alone = one_at_a_time(model, tokenizer, requests, args.tokens, options)
                serving = served(url, requests, clients, args.tokens, options, args.stream)
                for phase, result in (("alone", alone), ("served", serving)):
                    key = (phase, clients)
                    if key not in best or result["tokens_per_second"] > best[key]["tokens_per_second"]:
                        best[key] = result
                    print(json.dumps({"phase": phase, "clients": clients, **result}), file=sys.stderr)
    finally:
        process.terminate()
        process.wait(60)
    first = " | p50 first text served | p99 first text served" if args.stream else ""
    print(
        "| clients | one at a time tok/s | served tok/s | served / one at a time | p50 alone | p99 alone "
        f"| p50 served | p99 served{first} |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:" + ("|---:|---:" if args.stream else "") + "|")
    for clients in counts:
        alone, server = best[("alone", clients)], best[("served", clients)]
        firsts = f" | {server['first_text_p50']:.3f} s | {server['first_text_p99']:.3f} s" if args.stream else ""
        print(
            f"| {clients} | {alone['tokens_per_second']:.0f} | {server['tokens_per_second']:.0f} | "
            f"{server['tokens_per_second'] / alone['tokens_per_second']:.1f}x | {alone['p50']:.3f} s | "
            f"{alone['p99']:.3f} s | {server['p50']:.3f} s | {server['p99']:.3f} s{firsts} |"
        )


if __name__ == "__main__":
    main()
