"""Sampling time of a model computing in bfloat16 and float16 against float32 on this CPU, interleaved.

`dlm.load` upcasts a 16-bit model to float32 on a CPU that only emulates its dtype
(`dlm.runtime.device.inference_dtype`); this measures what that buys, or what it would cost on a CPU
that has it. The same exported model is loaded once in each dtype, and `dlm.sample` generates the same
request with each (one row, and `--rows` samples of one prompt as a batch), all of them alternating
round by round (`dlm.bench.measure.interleaved`), so other work on shared cores slows them alike. A
figure is a generation's CPU seconds (every thread of this process); the ratio of a 16-bit dtype's
median to float32's is how many times faster float32 samples (below one: the 16-bit dtype is faster).
Beside the speed, in the same run, the quality of each dtype's samples (`--quality-seeds` batches of
`--rows` samples): judge perplexity under the model itself in float32 (its Monte Carlo ELBO), unigram
entropy and distinct bigrams, each as a change against float32's samples.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

import dlm
from benchmarks import harness
from dlm.bench.generation import distinct_ngrams, judge_nll, quality_changes, unigram_entropy
from dlm.bench.measure import interleaved, round_ratios, spread
from dlm.runtime.device import cpu_has_native_bfloat16, cpu_has_native_float16, dtype_name, inference_dtype

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HALVES = ("bfloat16", "float16")  # each compared with float32


def cpu_inference(
    model: Annotated[Path, typer.Argument(help="An exported model directory (`dlm export`).")],
    length: Annotated[int, typer.Option(help="New tokens a sample.")] = 32,
    rows: Annotated[int, typer.Option(help="Samples of the batched generation.")] = 16,
    rounds: Annotated[int, typer.Option(min=1, help="Timed generations of each kind, alternating.")] = 8,
    threads: Annotated[int, typer.Option(help="torch threads (0: torch's own).")] = 1,
    quality_seeds: Annotated[int, typer.Option(min=1, help="Batches of --rows samples judged per dtype.")] = 4,
    name: Annotated[str, typer.Option(help="Name of the result file.")] = "cpu-inference",
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """CPU seconds of sampling in bfloat16 and float16 over float32 on this CPU, one row and a batch."""

    if threads:
        torch.set_num_threads(threads)
    run = harness.start(
        name, model=str(model), length=length, rows=rows, rounds=rounds, threads=threads, quality_seeds=quality_seeds
    )
    loaded = {dtype: dlm.load(model, dtype=torch_dtype) for dtype, torch_dtype in DTYPES.items()}
    parameters = loaded["float32"][0].num_parameters

    def generation(dtype: str, samples: int) -> Callable[[], object]:
        network, tokenizer = loaded[dtype]
        return lambda: dlm.sample(network, tokenizer, prompts=["ROMEO:"], length=length, num_samples=samples, seed=1)

    batches = {"one_row": 1, "batch": rows}
    candidates = {
        f"{dtype}_{batch}": generation(dtype, samples) for batch, samples in batches.items() for dtype in DTYPES
    }
    timings = interleaved(candidates, rounds, progress=harness.progress)
    seconds = {candidate: [timing.cpu_s for timing in kept] for candidate, kept in timings.items()}
    cpu = torch.device("cpu")
    figures: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "native_bfloat16": cpu_has_native_bfloat16(),
        "native_float16": cpu_has_native_float16(),
        "kernels": torch.backends.cpu.get_cpu_capability(),  # what ATEN_CPU_CAPABILITY left of the CPU's
        "load_dtype": {half: dtype_name(inference_dtype(DTYPES[half], cpu, parameters)) for half in HALVES},
        "parameters": parameters,
    }
    for batch in batches:
        single = seconds[f"float32_{batch}"]
        figures[batch] = {"median_cpu_s": {dtype: statistics.median(seconds[f"{dtype}_{batch}"]) for dtype in DTYPES}}
        for half in HALVES:
            halved = seconds[f"{half}_{batch}"]
            figures[batch][f"{half}_over_float32"] = statistics.median(halved) / statistics.median(single)
            figures[batch][f"{half}_rounds"] = spread(round_ratios(halved, single))
    figures["quality"] = _quality(loaded, length, rows, quality_seeds)
    path = run.save(figures, {"cpu_s": seconds}, results=results)
    for batch, samples in batches.items():
        ratios = ", ".join(f"{half} {figures[batch][f'{half}_over_float32']:.2f}x" for half in HALVES)
        typer.echo(f"{samples} row(s), CPU time over float32's: {ratios}")
    loads = ", ".join(f"{half} as {dtype}" for half, dtype in figures["load_dtype"].items())
    quality = figures["quality"]
    for half in HALVES:
        change = quality[half]
        typer.echo(
            f"{half} samples against float32's: judge perplexity {change['perplexity_change']:+.1%}, "
            f"entropy {change['entropy_change']:+.1%}, distinct-2 {change['distinct_2_change']:+.1%}"
        )
    typer.echo(f"native bfloat16 {figures['native_bfloat16']}, float16 {figures['native_float16']}; dlm.load: {loads}")
    typer.echo(f"wrote {path}")


def _quality(loaded: dict[str, Any], length: int, rows: int, seeds: int) -> dict[str, dict[str, float]]:
    """Each dtype's samples (`seeds` batches of `rows`, seeds 0, 1, ...) judged by the model in float32:
    judge perplexity, unigram entropy and distinct-2, and for a 16-bit dtype their changes against float32's."""

    judge = loaded["float32"][0]
    figures: dict[str, dict[str, float]] = {}
    for dtype, (network, tokenizer) in loaded.items():
        generated: list[list[int]] = []
        for seed in range(seeds):
            result = dlm.sample(network, tokenizer, prompts=["ROMEO:"], length=length, num_samples=rows, seed=seed)
            generated += [ids[start:] for ids, start in zip(result.token_ids, result.prompt_tokens, strict=True)]
        figures[dtype] = {
            "judge_perplexity": math.exp(judge_nll(judge, generated)),
            "unigram_entropy_bits": unigram_entropy(generated),
            "distinct_2": distinct_ngrams(generated),
        }
    for half in HALVES:
        figures[half] |= quality_changes(figures[half], figures["float32"])
    return figures
