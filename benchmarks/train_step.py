"""dlm's training step against the plain-PyTorch baseline's (benchmarks/baselines/plain_cpu.py), step by step.

One process holds both: the baseline's model and loss stepped exactly as plain_cpu.py steps them, and
dlm's `TrainingStep` (what `dlm train` and `dlm bench` run: corruption, forward, ELBO loss, backward,
clipping, optimizer) at the same size, `configs/bench-cpu.toml` by default. They alternate step by
step (`dlm.bench.measure.interleaved`), so both meet the machine's other load at nearly the same
moment. Model GFLOP/s count (6 x params + 12 x layers x d_model x seq) per token for both, as the
baseline does; the ratio is dlm's over the baseline's, per round.
"""

from __future__ import annotations

import importlib
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import torch
import typer

from benchmarks import harness
from dlm.bench.measure import Timing, interleaved, round_ratios, spread
from dlm.bench.throughput import synthetic_batches
from dlm.config.schema import load_config
from dlm.train.distributed import DistributedContext
from dlm.train.step import LogWindow, TrainingStep


def step_pair(config: Path, overrides: list[str]) -> tuple[Callable[[], None], Callable[[], None], float, float]:
    """The baseline's and dlm's training steps at the config's size, and the model FLOPs of a step of each."""

    if str(harness.BASELINES) not in sys.path:
        sys.path.insert(0, str(harness.BASELINES))
    baseline = importlib.import_module("plain_gpu")
    experiment = load_config(config, overrides)
    size, batch, cpu = experiment.model, experiment.training.batch_size, torch.device("cpu")
    tokens = batch * size.max_seq_len
    torch.manual_seed(0)
    model = baseline.Baseline(size.vocab_size, size.d_model, size.n_layers, size.n_heads, size.max_seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clean = torch.randint(0, size.vocab_size - 1, (batch, size.max_seq_len))

    def baseline_step() -> None:
        loss = baseline.diffusion_loss(model, clean, size.vocab_size - 1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    parameters = sum(p.numel() for p in model.parameters())
    baseline_flops = (6 * parameters + 12 * size.n_layers * size.d_model * size.max_seq_len) * tokens
    step = TrainingStep(experiment, cpu, "float32", DistributedContext())
    step.prepare()
    batches, window = synthetic_batches(size, batch, cpu, experiment.training.seed), LogWindow(cpu)
    dlm_flops = step.model.flops_per_token(size.max_seq_len) * tokens

    def dlm_step() -> None:
        step.optimizer_step(batches, window)

    return baseline_step, dlm_step, float(baseline_flops), float(dlm_flops)


def _gflops(timings: list[Timing], flops: float) -> list[float]:
    return [flops / timing.wall_s / 1e9 for timing in timings]


def train_step(
    rounds: Annotated[int, typer.Option(help="Timed steps of each, alternating.")] = 20,
    threads: Annotated[str, typer.Option(help="torch threads to measure at, comma-separated.")] = "1,2",
    config: Annotated[Path, typer.Option(help="dlm's side (the baseline takes its size).")] = harness.ROOT
    / "configs"
    / "bench-cpu.toml",
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field of dlm's config (repeatable).")
    ] = None,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """Model GFLOP/s of dlm's training step over the plain-PyTorch baseline's, at each thread count."""

    overrides = list(set_ or [])
    counts = [int(value) for value in threads.split(",")]
    run = harness.start("train-step", rounds=rounds, threads=counts, config=str(config), overrides=overrides)
    figures: dict[str, object] = {}
    raw: dict[str, object] = {}
    for count in counts:
        torch.set_num_threads(count)
        baseline_step, dlm_step, baseline_flops, dlm_flops = step_pair(config, overrides)
        timings = interleaved({"baseline": baseline_step, "dlm": dlm_step}, rounds, warmup=3, progress=harness.progress)
        baseline, dlm = _gflops(timings["baseline"], baseline_flops), _gflops(timings["dlm"], dlm_flops)
        ratios = round_ratios(dlm, baseline)
        figures[f"threads_{count}"] = {
            "baseline_gflops": statistics.median(baseline),
            "dlm_gflops": statistics.median(dlm),
            "ratio": spread(ratios),
        }
        raw[f"threads_{count}"] = {"baseline_gflops": baseline, "dlm_gflops": dlm}
        median = statistics.median(ratios)
        typer.echo(f"{count} thread(s): dlm / baseline model GFLOP/s, median of {rounds} rounds {median:.2f}")
    typer.echo(f"wrote {run.save(figures, raw, results=results)}")
