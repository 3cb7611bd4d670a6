"""`dlm serve` under 1, 4, 16 and 64 concurrent clients against `dlm.sample` one request at a time.

`serve` starts `dlm serve MODEL` in a subprocess on a free port of 127.0.0.1 (batches of up to the
largest client count) and times, for each client count C, two phases of the same C x
`--requests-per-client` requests:
- one at a time: `dlm.sample` in this process, each call alone, as a program without a server would;
- served: C clients (the `openai` client, each in its own thread) send them, each client its share
  one after another, so up to C requests wait together and share batches;
- the engine: the same, with C threads of this process submitting the requests straight to the
  server's scheduler (`dlm.serving.scheduler`, in this process, its batches as large): the engine's
  own rate, without HTTP, the clients, or the server's event loop, which on a few cores share them with it.
Every request is `--tokens` new tokens after one of a few prompts of different lengths, with its own
seed, the same sampler options on both sides (by default the sampler's, one token a step, top-p 0.9:
sent with every request, since a server left to choose takes OpenAI's 1.0) and a stop at the end of
document. Tokens/s counts the generated tokens kept over the phase's wall time; latency is per
request (one at a time: the call alone, no waiting for the calls before it). With `--stream` the
served requests stream, and each one's time from sending to its first text is kept too. A phase's
CPU seconds are this process's, plus for a served phase the server's (read from /proc: Linux only).

The phases are interleaved round by round (`dlm.bench.measure.interleaved`), so other work on shared
cores slows them alike: read the ratios, not the absolute figures. Each phase's figures are its best
round's (the least disturbed), as the documents quote them, beside the per-round ratios.

`serve-pass-cost` times only the model's forward pass of one denoising step over batches of 1, 4, ...
rows, interleaved: the most any batching of requests can save on this machine is the first row's
cost over the others'. The step is the one the options make halfway through the tokens (after a
16-token prompt): the whole sequence (a whole-sequence model without a cache), the positions from the
current block on over the cached prefix (`--cache prefix`), the block alone over the cached rest
(`--cache dual`), or one model block over the cached prefix (a block model's exact cache).

`serve` times that pass too, in the same rounds as the clients (`PASSES_A_PHASE` passes of one row and of
C rows each round, scoring 2 positions a row as a served step does): each client count's `pass_saving`
(one row's cost per row over C rows', round medians) and the served and engine rates over it
(`served_over_saving`, `engine_over_saving`), so that what batching gets and the most it could get are
read from one run on one machine, whatever else the machine is doing meanwhile.

Both the server and this process run `--threads` intra-op threads (default 1: on shared cores,
threads beyond the free ones spin against other work and can make a pass several times slower;
0: one a core, torch's own default).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import typer

import dlm
from benchmarks import harness
from dlm.bench.measure import Timing, interleaved, round_ratios, self_timed, spread, timed

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

Model = Annotated[Path, typer.Argument(help="The exported model directory (`dlm export`).")]
Tokens = Annotated[int, typer.Option(help="New tokens a request.")]
Threads = Annotated[int, typer.Option(help="Intra-op threads of this process and the server (0: one a core).")]
Device = Annotated[str, typer.Option(help="Where the model runs, on both sides.")]
BlockLength = Annotated[int | None, typer.Option(help="The sampler's block_length.")]
Cache = Annotated[Literal["prefix", "dual"] | None, typer.Option(help="The sampler's cache.")]
Results = Annotated[Path, typer.Option(help="Directory of the result file.")]
PASSES_A_PHASE = 50  # passes a pass phase times: a pass alone is a few milliseconds, too short to time
SCORED = 2  # positions a row of a pass phase scores: a served step at one token a pass reveals 1.58 on average


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(fraction * len(ordered) + 0.5) - 1)]


def requests_for(clients: int, per_client: int) -> list[tuple[str, int]]:
    return [(PROMPTS[i % len(PROMPTS)], 1000 + i) for i in range(clients * per_client)]


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

    queue = 4 * max_batch if max_queue is None else max_queue
    command = [sys.executable, "-m", "dlm", "serve", str(model), "--port", "0", "--json", "--name", "model"]
    command += ["--device", device, "--max-batch", str(max_batch), "--max-n", "1"]
    command += ["--max-queue", str(queue), "--batch-wait", str(batch_wait)]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env=os.environ | {"OMP_NUM_THREADS": str(threads)}
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"dlm serve did not start (exit status {process.wait()})")
    threading.Thread(target=process.stdout.read, daemon=True).start()  # keep its pipe drained
    return process, json.loads(line)["url"]


def stop_server(process: subprocess.Popen[str]) -> None:
    process.terminate()
    process.wait(60)


def server_cpu_seconds(pid: int) -> float:
    """The process's user + system CPU seconds from /proc/PID/stat; 0 where there is no /proc."""

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def one_at_a_time(
    model: Any, tokenizer: Any, requests: list[tuple[str, int]], tokens: int, options: dict[str, Any]
) -> Callable[[], dict[str, Any]]:
    """The phase without a server: its summary and its timing."""

    def phase() -> dict[str, Any]:
        latencies: list[float] = []
        generated = passes = 0

        def calls() -> None:
            nonlocal generated, passes
            for prompt, seed in requests:
                began = time.perf_counter()
                result = dlm.sample(
                    model, tokenizer, prompt=prompt, length=tokens, seed=seed, stop_at_end=True, **options
                )
                latencies.append(time.perf_counter() - began)
                generated += sum(result.lengths)
                passes += result.forward_passes

        timing = timed(calls)
        return summary(generated, timing.wall_s, latencies) | {
            "timing": timing,
            "tokens_per_pass": generated / max(passes, 1),
        }

    return phase


def request(
    client: Any, prompt: str, seed: int, tokens: int, options: dict[str, Any], stream: bool
) -> tuple[float | None, int]:
    """One completion: the moment of its first text (streamed only), and the tokens its usage counts."""

    body: dict[str, Any] = {
        "model": "model",
        "prompt": prompt,
        "max_tokens": tokens,
        "seed": seed,
        "extra_body": options,
    }
    if not stream:
        answer = client.completions.create(**body)
        return None, answer.usage.completion_tokens if answer.usage else 0
    first, count = None, 0
    for chunk in client.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.usage:
            count = chunk.usage.completion_tokens
    return first, count


def client_phase(
    requests: list[tuple[str, int]],
    clients: int,
    send: Callable[[str, int], tuple[float | None, int]],
    server_cpu: Callable[[], float] = lambda: 0.0,
) -> dict[str, Any]:
    """`clients` threads share the requests, each sending its share one after another with `send(prompt,
    seed)` (the moment of its first text, None unstreamed, and the tokens it got); the summary and the
    timing, with the CPU seconds `server_cpu()` adds (a server in another process)."""

    latencies: list[float] = []
    first_texts: list[float] = []
    generated = [0]
    lock = threading.Lock()

    def run(share: list[tuple[str, int]]) -> None:
        for prompt, seed in share:
            began = time.perf_counter()
            first, count = send(prompt, seed)
            with lock:
                latencies.append(time.perf_counter() - began)
                generated[0] += count
                if first is not None:
                    first_texts.append(first - began)

    def all_clients() -> None:
        threads = [threading.Thread(target=run, args=(requests[i::clients],)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    server_before = server_cpu()
    timing = timed(all_clients)
    timing = Timing(cpu_s=timing.cpu_s + server_cpu() - server_before, wall_s=timing.wall_s)
    result = summary(generated[0], timing.wall_s, latencies) | {"timing": timing}
    if first_texts:
        result |= {
            "first_text_p50": statistics.median(first_texts),
            "first_text_p99": percentile(first_texts, 0.99),
        }
    return result


def in_engine(
    scheduler: Any,
    tokenizer: Any,
    requests: list[tuple[str, int]],
    clients: int,
    tokens: int,
    options: dict[str, Any],
    stream: bool,
) -> Callable[[], dict[str, Any]]:
    """The engine phase: `clients` threads submit their share to `scheduler` (in this process) one after
    another; its summary and its timing."""

    from dlm.sampling.options import SamplingOptions, sampling_remasking
    from dlm.serving.jobs import Job
    from dlm.serving.protocol import Generation

    sampling = SamplingOptions(**options | {"remasking": sampling_remasking(scheduler.model, options.get("remasking"))})

    def send(prompt: str, seed: int) -> tuple[float | None, int]:
        counts = (len(tokenizer.encode(prompt).ids),)
        generation = Generation((prompt,), counts, tokens, 1, seed, sampling, (), stream, False, False)
        heard: list[float] = []

        def on_text(index: int, text: str) -> None:
            if text and not heard:
                heard.append(time.perf_counter())

        job = Job(str(seed), generation, on_text=on_text if stream else None)
        scheduler.submit(job)
        count = job.future.result().completion_tokens
        return (heard[0] if heard else None), count

    def phase() -> dict[str, Any]:
        stats = scheduler.stats
        before = stats.passes, stats.pass_rows, stats.pass_seconds
        result = client_phase(requests, clients, send)
        passes, rows, seconds = (
            now - then for now, then in zip((stats.passes, stats.pass_rows, stats.pass_seconds), before, strict=True)
        )
        return result | {
            "tokens_per_pass": result["tokens"] / max(passes, 1),
            "rows_per_pass": rows / max(passes, 1),  # request rows a pass advanced
            "pass_share": seconds / result["timing"].wall_s,  # of the phase's wall time, in forward passes
        }

    return phase


def served(
    url: str,
    pid: int,
    requests: list[tuple[str, int]],
    clients: int,
    tokens: int,
    options: dict[str, Any],
    stream: bool,
) -> Callable[[], dict[str, Any]]:
    """The served phase: `clients` threads of `openai` clients share the requests; its summary and its timing
    (with the server's CPU)."""

    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    return lambda: client_phase(
        requests,
        clients,
        lambda prompt, seed: request(client, prompt, seed, tokens, options, stream),
        lambda: server_cpu_seconds(pid),
    )


def serve(
    model: Model,
    clients: Annotated[str, typer.Option(help="Concurrent clients, comma-separated.")] = "1,4,16,64",
    tokens: Tokens = 32,
    requests_per_client: Annotated[int, typer.Option(help="Requests each client sends, one after another.")] = 2,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds of every phase.")] = 2,
    threads: Threads = 1,
    device: Device = "cpu",
    batch_wait: Annotated[float, typer.Option(help="The server's --batch-wait (ms).")] = 0.0,
    steps: Annotated[int | None, typer.Option(help="Denoising steps (default: one a token).")] = None,
    block_length: BlockLength = None,
    cache: Cache = None,
    threshold: Annotated[float | None, typer.Option(help="The sampler's threshold.")] = None,
    remasking: Annotated[str | None, typer.Option(help="The sampler's remasking.")] = None,
    top_p: Annotated[
        float, typer.Option(help="The sampler's top-p, sent with every request (a server left to choose takes 1.0).")
    ] = 0.9,
    stream: Annotated[bool, typer.Option(help="Served requests stream: time to first text too.")] = False,
    own_samplers: Annotated[
        bool, typer.Option(help="One more phase: the engine with every request on its own sampler (no cohort).")
    ] = False,
    name: Annotated[str, typer.Option(help="Name of the result file.")] = "serve",
    results: Results = harness.RESULTS,
) -> None:
    """Tokens/s and latency of dlm serve at each client count against dlm.sample one request at a time."""

    counts = [int(count) for count in clients.split(",")]
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)  # before the stamp, which records it
    given: dict[str, Any] = {"steps": steps or tokens, "block_length": block_length, "cache": cache}
    given |= {"threshold": threshold, "remasking": remasking, "top_p": top_p}  # the same sampling on both sides
    options = {name: value for name, value in given.items() if value is not None}  # the rest: the sampler's defaults
    run = harness.start(
        name,
        model=str(model),
        clients=counts,
        tokens=tokens,
        requests_per_client=requests_per_client,
        rounds=rounds,
        threads=threads,
        device=device,
        batch_wait=batch_wait,
        options=options,
        stream=stream,
        own_samplers=own_samplers,
    )
    loaded, tokenizer = dlm.load(model, device=device)
    process, url = start_server(model, max(counts), device, threads, batch_wait)
    from dlm.serving.scheduler import Scheduler

    engines = [
        Scheduler(
            loaded,
            tokenizer,
            max_queue=4 * max(counts),
            max_batch_rows=max(counts),
            batch_wait=batch_wait / 1000,
            own_samplers=own,
        )
        for own in ((False, True) if own_samplers else (False,))
    ]
    engine = engines[0]
    for each in engines:
        each.start()
    phases: dict[str, list[dict[str, Any]]] = {}
    candidates: dict[str, Callable[[], Timing]] = {}
    for count in counts:
        requests = requests_for(count, requests_per_client)
        measures = [
            ("alone", one_at_a_time(loaded, tokenizer, requests, tokens, options)),
            ("served", served(url, process.pid, requests, count, tokens, options, stream)),
            ("engine", in_engine(engine, tokenizer, requests, count, tokens, options, stream)),
        ]
        if own_samplers:
            measures.append(("samplers", in_engine(engines[-1], tokenizer, requests, count, tokens, options, stream)))
        for phase, measure in measures:
            name = f"{phase}_{count}"
            phases[name] = []
            candidates[name] = recording(measure, phases[name])
    per_row_ms: dict[int, list[float]] = {count: [] for count in sorted({1, *counts})}
    for count, kept in per_row_ms.items():
        candidates[f"pass_{count}"] = pass_phase(loaded, count, tokens, cache, block_length, device, kept)
    try:
        interleaved(candidates, rounds, warmup=0, timer=self_timed, progress=harness.progress)
    finally:
        stop_server(process)
        for each in engines:
            each.stop(60)
    figures = {
        f"clients_{count}": with_pass_saving(
            client_figures(
                phases[f"alone_{count}"],
                phases[f"served_{count}"],
                phases[f"engine_{count}"],
                samplers=phases.get(f"samplers_{count}"),
            ),
            per_row_ms,
            count,
        )
        for count in counts
    }
    raw = {
        name: [without_timing(result) | {"cpu_s": result["timing"].cpu_s} for result in kept]
        for name, kept in phases.items()
    }
    raw |= {f"pass_{count}": [{"ms_per_row": ms} for ms in kept] for count, kept in per_row_ms.items()}
    path = run.save(figures, raw, results=results)
    typer.echo(table(figures, stream))
    typer.echo(f"wrote {path}")


def recording(measure: Callable[[], dict[str, Any]], into: list[dict[str, Any]]) -> Callable[[], Timing]:
    """A self-timed candidate that keeps each round's summary."""

    def candidate() -> Timing:
        into.append(measure())
        timing: Timing = into[-1]["timing"]
        return timing

    return candidate


def without_timing(result: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in result.items() if key != "timing"}


def pass_phase(
    model: Any, rows: int, tokens: int, cache: str | None, block_length: int | None, device: str, into: list[float]
) -> Callable[[], Timing]:
    """A self-timed candidate: `PASSES_A_PHASE` forward passes of one denoising step over `rows` rows
    (`step_pass`), each round's milliseconds per row kept in `into`."""

    step = synchronized(step_pass(model, rows, tokens, cache, block_length, device, SCORED), device)

    def candidate() -> Timing:
        def passes() -> None:
            with torch.inference_mode():
                for _ in range(PASSES_A_PHASE):
                    step()

        timing = timed(passes)
        into.append(1000 * timing.wall_s / PASSES_A_PHASE / rows)
        return timing

    return candidate


def with_pass_saving(figures: dict[str, Any], per_row_ms: dict[int, list[float]], count: int) -> dict[str, Any]:
    """`figures` with the shared pass's saving per row at `count` rows (one row's cost over its, the rounds'
    medians) and the served and engine rates over one at a time against that saving."""

    saving = statistics.median(per_row_ms[1]) / statistics.median(per_row_ms[count])
    return figures | {
        "pass_saving": saving,
        "served_over_saving": figures["speedup"] / saving,
        "engine_over_saving": figures["engine_speedup"] / saving,
    }


def client_figures(
    alone: list[dict[str, Any]],
    serving: list[dict[str, Any]],
    engine: list[dict[str, Any]],
    samplers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One client count's figures: each phase's best round, the ratios of the best, the per-round ratios
    (and the engine's over the engine with every request on its own sampler, given `samplers`)."""

    def best(rounds: list[dict[str, Any]]) -> dict[str, Any]:
        top = max(rounds, key=lambda result: result["tokens_per_second"])
        return without_timing(top) | {
            "cpu_ms_per_token": statistics.median(1000 * r["timing"].cpu_s / max(r["tokens"], 1) for r in rounds)
        }

    speeds = {
        name: [result["tokens_per_second"] for result in rounds]
        for name, rounds in (("alone", alone), ("served", serving))
    }
    alone_best, served_best, engine_best = best(alone), best(serving), best(engine)
    figures = {
        "alone": alone_best,
        "served": served_best,
        "engine": engine_best,
        "speedup": served_best["tokens_per_second"] / alone_best["tokens_per_second"],
        "engine_speedup": engine_best["tokens_per_second"] / alone_best["tokens_per_second"],
        "round_speedup": spread(round_ratios(speeds["served"], speeds["alone"])),
    }
    if samplers:
        samplers_best = best(samplers)
        figures |= {
            "samplers": samplers_best,
            "samplers_speedup": samplers_best["tokens_per_second"] / alone_best["tokens_per_second"],
            "engine_over_samplers": spread(
                round_ratios(
                    [result["tokens_per_second"] for result in engine],
                    [result["tokens_per_second"] for result in samplers],
                )
            ),
        }
    return figures


def table(figures: dict[str, Any], stream: bool) -> str:
    """The figures as a Markdown table, a row per client count (the columns each row has)."""

    sample: dict[str, Any] = next(iter(figures.values()), {})
    extra = [
        ("p50 first text served", lambda row: f"{row['served']['first_text_p50']:.3f} s", stream),
        ("p99 first text served", lambda row: f"{row['served']['first_text_p99']:.3f} s", stream),
        ("own samplers / one at a time", lambda row: f"{row['samplers_speedup']:.1f}x", "samplers" in sample),
        ("pass saving per row", lambda row: f"{row['pass_saving']:.2f}x", "pass_saving" in sample),
        ("served / pass saving", lambda row: f"{row['served_over_saving']:.2f}", "pass_saving" in sample),
    ]
    extra = [column for column in extra if column[2]]
    names = "| clients | one at a time tok/s | served tok/s | served / one at a time | engine / one at a time "
    names += "| p50 alone | p99 alone | p50 served | p99 served |"
    lines = [names + "".join(f" {name} |" for name, _, _ in extra), "|" + "---:|" * (9 + len(extra))]
    for key, row in figures.items():
        alone, server = row["alone"], row["served"]
        cells = [key.removeprefix("clients_")]
        cells += [f"{alone['tokens_per_second']:.0f}", f"{server['tokens_per_second']:.0f}", f"{row['speedup']:.1f}x"]
        cells += [f"{row['engine_speedup']:.1f}x"]
        cells += [f"{figure:.3f} s" for figure in (alone["p50"], alone["p99"], server["p50"], server["p99"])]
        cells += [cell(row) for _, cell, _ in extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def synchronized(step: Callable[[], object], device: str) -> Callable[[], object]:
    """`step`, waiting on CUDA for its kernels to finish: a timer then times the pass, not its launch."""

    if torch.device(device).type != "cuda":
        return step

    def go() -> None:
        step()
        torch.cuda.synchronize()

    return go


def step_pass(
    model: Any,
    rows: int,
    tokens: int,
    cache_mode: str | None,
    block_length: int | None,
    device: str,
    scored: int | None = None,
) -> Callable[[], object]:
    """The forward pass of one denoising step halfway through `tokens` after a 16-token prompt, for `rows`
    rows, as a function to time: its cache, if any, is filled beforehand. It scores `scored` positions a
    row (None: every position it could reveal, as a ranked step does)."""

    from dlm.model.attention import KVCache
    from dlm.model.denoiser import block_size

    block = block_size(model.config) or (block_length if cache_mode else None)
    width = min(model.config.max_seq_len, tokens + 16)  # the benchmark's shape: a short prompt, then the tokens
    sequence = torch.randint(3, model.config.vocab_size, (rows, width), device=device)
    if block is None:  # the whole sequence, the tokens to generate scored
        outputs = torch.zeros_like(sequence, dtype=torch.bool)
        outputs[:, width - tokens : width - tokens + (tokens if scored is None else scored)] = True
        return lambda: model(sequence, outputs)
    start = (width - tokens // 2) // block * block  # the current block, halfway through
    end = min(start + block, width)
    fed_end = width if cache_mode == "prefix" else end
    cache = KVCache(committing=True)
    kept = sequence[:, :start] if cache_mode != "dual" else torch.cat((sequence[:, :start], sequence[:, end:]), 1)
    with torch.inference_mode():
        model(kept, torch.zeros_like(kept, dtype=torch.bool), cache=cache)
    cache.committing, cache.length = False, start  # the fed block's rotary positions start at the block
    fed = sequence[:, start:fed_end]
    outputs = torch.zeros_like(fed, dtype=torch.bool)
    outputs[:, : end - start if scored is None else min(scored, end - start)] = True
    return lambda: model(fed, outputs, cache=cache)


def serve_pass_cost(
    model: Model,
    clients: Annotated[str, typer.Option(help="Rows a pass (the batch sizes), comma-separated.")] = "1,4,16,64",
    tokens: Tokens = 32,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds of every batch size.")] = 8,
    threads: Threads = 1,
    device: Device = "cpu",
    block_length: BlockLength = None,
    cache: Cache = None,
    scored: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Positions a row scores (default: 2, as many as a step at one token a pass reveals in a row "
            "that reveals any, 1.58 on average; 0: every position of the block, as a ranked step scores).",
        ),
    ] = 2,
    name: Annotated[str, typer.Option(help="Name of the result file.")] = "serve-pass-cost",
    results: Results = harness.RESULTS,
) -> None:
    """Milliseconds per row of one denoising step's forward pass at each batch size: what batching can save."""

    counts = [int(count) for count in clients.split(",")]
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    run = harness.start(
        name,
        model=str(model),
        rows=counts,
        tokens=tokens,
        rounds=rounds,
        threads=threads,
        device=device,
        block_length=block_length,
        cache=cache,
        scored=scored,
    )
    loaded, _ = dlm.load(model, device=device)
    passes = {
        f"rows_{count}": synchronized(
            step_pass(loaded, count, tokens, cache, block_length, device, scored or None), device
        )
        for count in counts
    }
    with torch.inference_mode():
        timings = interleaved(passes, rounds, warmup=1, progress=harness.progress)
    per_row = {
        name: [1000 * t.wall_s / count for t in timings[name]] for name, count in zip(passes, counts, strict=True)
    }
    first = statistics.median(per_row[f"rows_{counts[0]}"])
    figures = {
        name: {"ms_per_row": statistics.median(values), "saved": first / statistics.median(values)}
        for name, values in per_row.items()
    }
    path = run.save(figures, {"ms_per_row": per_row}, results=results)
    lines = ["| rows a pass | ms per row | saved against the first |", "|---:|---:|---:|"]
    lines += [
        f"| {name.removeprefix('rows_')} | {row['ms_per_row']:.2f} | {row['saved']:.2f}x |"
        for name, row in figures.items()
    ]
    typer.echo("\n".join(lines))
    typer.echo(f"wrote {path}")
