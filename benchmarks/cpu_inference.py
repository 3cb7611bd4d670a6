"""Sampling time of a bfloat16 model computing in bfloat16 against float32 on this CPU, interleaved.

`dlm.load` upcasts a bfloat16 model to float32 on a CPU without native bfloat16
(`dlm.runtime.device.inference_dtype`); this measures what that buys, or what it would cost on a CPU
with it. The same exported model is loaded twice, in each dtype, and `dlm.sample` generates the same
request with each (one row, and `--rows` samples of one prompt as a batch), the four alternating round
by round (`dlm.bench.measure.interleaved`), so other work on shared cores slows them alike. A figure is a
generation's CPU seconds (every thread of this process); the ratio bfloat16 / float32 of the medians is
how many times faster float32 samples (below one: bfloat16 is faster).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import torch
import typer

import dlm
from benchmarks import harness
from dlm.bench.measure import interleaved, round_ratios, spread
from dlm.runtime.device import cpu_has_native_bfloat16, inference_dtype

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def cpu_inference(
    model: Annotated[Path, typer.Argument(help="An exported model directory (`dlm export`).")],
    length: Annotated[int, typer.Option(help="New tokens a sample.")] = 32,
    rows: Annotated[int, typer.Option(help="Samples of the batched generation.")] = 16,
    rounds: Annotated[int, typer.Option(min=1, help="Timed generations of each kind, alternating.")] = 8,
    threads: Annotated[int, typer.Option(help="torch threads (0: torch's own).")] = 1,
    name: Annotated[str, typer.Option(help="Name of the result file.")] = "cpu-inference",
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """CPU seconds of sampling in bfloat16 over float32 on this CPU, one row and a batch, interleaved."""

    if threads:
        torch.set_num_threads(threads)
    run = harness.start(name, model=str(model), length=length, rows=rows, rounds=rounds, threads=threads)
    loaded = {name: dlm.load(model, dtype=dtype) for name, dtype in DTYPES.items()}
    parameters = loaded["float32"][0].num_parameters

    def generation(name: str, samples: int) -> Callable[[], object]:
        network, tokenizer = loaded[name]
        return lambda: dlm.sample(network, tokenizer, prompts=["ROMEO:"], length=length, num_samples=samples, seed=1)

    batches = {"one_row": 1, "batch": rows}
    candidates = {f"{name}_{batch}": generation(name, samples) for batch, samples in batches.items() for name in DTYPES}
    timings = interleaved(candidates, rounds, progress=harness.progress)
    seconds = {name: [timing.cpu_s for timing in kept] for name, kept in timings.items()}
    figures: dict[str, object] = {
        "threads": torch.get_num_threads(),
        "native_bfloat16": cpu_has_native_bfloat16(),
        "kernels": torch.backends.cpu.get_cpu_capability(),  # what ATEN_CPU_CAPABILITY left of the CPU's
        "load_dtype": str(inference_dtype(torch.bfloat16, torch.device("cpu"), parameters)).removeprefix("torch."),
        "parameters": parameters,
    }
    for batch in batches:
        bf16, f32 = seconds[f"bfloat16_{batch}"], seconds[f"float32_{batch}"]
        figures[batch] = {
            "median_cpu_s": {"bfloat16": statistics.median(bf16), "float32": statistics.median(f32)},
            "bfloat16_over_float32": statistics.median(bf16) / statistics.median(f32),
            "rounds": spread(round_ratios(bf16, f32)),
        }
    path = run.save(figures, {"cpu_s": seconds}, results=results)
    for batch, samples in batches.items():
        ratio = figures[batch]["bfloat16_over_float32"]  # type: ignore[index]
        typer.echo(f"{samples} row(s): bfloat16 takes {ratio:.2f}x float32's CPU time")
    typer.echo(f"native bfloat16: {figures['native_bfloat16']}, dlm.load computes in {figures['load_dtype']}")
    typer.echo(f"wrote {path}")
