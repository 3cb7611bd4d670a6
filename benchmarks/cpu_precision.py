"""Training-step time of float32 against bfloat16 autocast on this CPU, interleaved in one process.

Both steps are dlm's own `TrainingStep` (the step `dlm train` and `dlm bench` run) at the config's
size on synthetic tokens (`dlm.bench.throughput.interleaved_cpu_step_seconds`). Each is warmed up
for 2 steps, then they alternate step by step (who goes first rotates too), so both see the same
load from other work at nearly the same moment. The ratio float32 / bfloat16 of the median step
times is how many more steps bfloat16 trains in the same time; on a CPU without AVX512-BF16 or AMX
it is emulated and the ratio falls below one.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Annotated

import torch
import typer

from benchmarks import harness
from dlm.bench.measure import round_ratios, spread
from dlm.bench.throughput import interleaved_cpu_step_seconds
from dlm.config.schema import load_config
from dlm.runtime.device import cpu_has_native_bfloat16

PRECISIONS = ("float32", "bfloat16")


def cpu_precision(
    config: Annotated[Path, typer.Option(help="The run whose step is timed.")] = harness.ROOT / "configs" / "cpu.toml",
    rounds: Annotated[int, typer.Option(min=1, help="Timed steps of each precision, alternating.")] = 10,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: torch's own).")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field of the config (repeatable).")
    ] = None,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """Training-step time of float32 over bfloat16 autocast on this CPU, dlm's own step, interleaved."""

    if threads is not None:
        torch.set_num_threads(threads)
    overrides = ["training.device=cpu", *(set_ or [])]
    run = harness.start("cpu-precision", config=str(config), rounds=rounds, threads=threads, overrides=overrides)
    experiment = load_config(config, overrides)
    seconds = interleaved_cpu_step_seconds({precision: (experiment, precision) for precision in PRECISIONS}, rounds)
    medians = {precision: statistics.median(values) for precision, values in seconds.items()}
    figures = {
        "threads": torch.get_num_threads(),
        "native_bfloat16": cpu_has_native_bfloat16(),
        "median_step_s": medians,
        "float32_over_bfloat16": medians["float32"] / medians["bfloat16"],
        "float32_over_bfloat16_rounds": spread(round_ratios(seconds["float32"], seconds["bfloat16"])),
    }
    path = run.save(figures, {"step_s": seconds}, results=results)
    typer.echo(
        f"{figures['threads']} thread(s), native bfloat16 {figures['native_bfloat16']}: median step "
        f"float32 {medians['float32']:.4f} s, bfloat16 {medians['bfloat16']:.4f} s, "
        f"float32 / bfloat16 {figures['float32_over_bfloat16']:.3f} over {rounds} rounds; wrote {path}"
    )
