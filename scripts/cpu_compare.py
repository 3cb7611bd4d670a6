"""CPU throughput of dlm's training step against a plain-PyTorch baseline, interleaved in one run.

usage: python scripts/cpu_compare.py [--mode steps|processes] [--rounds N] [--threads N] [--json]

The baseline is scripts/baselines/plain_cpu.py (--baseline), built on scripts/baselines/plain_gpu.py.
--mode processes: each round runs the baseline's own script (`plain_cpu.py`, its default size), then
  `dlm bench --device cpu --config configs/bench-cpu.toml` (the same size), each in its own process
  with 3 warmup and 10 timed steps; medians and best-of-rounds over the rounds.
--mode steps (default): one process holds both training steps, the baseline's (its `Baseline` and
  `diffusion_loss`, stepped exactly as `plain_cpu.py` does) and dlm's `TrainingStep` (the step
  `dlm bench` times), and alternates them step by step, so both see the same load from other
  processes at nearly the same moment; --rounds is then the number of timed steps of each.
Model GFLOP/s = (6 x params + 12 x layers x d_model x seq) x tokens/s for both, as the baseline counts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASELINE_LINE = re.compile(r"tokens/s=(?P<tokens>[\d.]+) model_GFLOP/s=(?P<gflops>[\d.]+) step_s=(?P<step>[\d.]+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, default=ROOT / "scripts" / "baselines" / "plain_cpu.py")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "bench-cpu.toml")
    parser.add_argument("--mode", choices=("steps", "processes"), default="steps")
    parser.add_argument("--rounds", type=int, default=20, help="timed steps of each (steps) or process pairs")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both sides")
    parser.add_argument(
        "--dlm-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of dlm's config, e.g. training.compile=true (repeatable)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def run_baseline(baseline: Path, env: dict[str, str]) -> dict[str, float]:
    # The baseline's defaults are the size of configs/bench-cpu.toml: 3 warmup + 10 timed steps.
    output = subprocess.run([sys.executable, str(baseline)], capture_output=True, text=True, check=True, env=env)
    match = BASELINE_LINE.search(output.stdout)
    if match is None:
        raise RuntimeError(f"unexpected baseline output: {output.stdout!r}")
    return {
        "tokens_per_second": float(match["tokens"]),
        "gflops": float(match["gflops"]),
        "step_s": float(match["step"]),
    }


def run_dlm(config: Path, overrides: list[str], env: dict[str, str]) -> dict[str, float]:
    command = [
        sys.executable,
        "-m",
        "dlm",
        "bench",
        "--config",
        str(config),
        "--device",
        "cpu",
        "--steps",
        "10",
        "--warmup",
        "3",
        "--json",
    ]
    for override in overrides:
        command += ["--set", override]
    output = subprocess.run(command, capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    (row,) = json.loads(output.stdout)["results"]
    return {
        "tokens_per_second": row["tokens_per_second"],
        "gflops": row["model_flops_per_second"] / 1e9,
        "step_s": row["step_time_s"],
    }


def step_pair(
    baseline_path: Path, config: Path, overrides: list[str]
) -> tuple[Callable[[], None], Callable[[], None], float, float]:
    """The baseline's and dlm's training steps at the config's size, and the model FLOPs of one step of each."""

    import torch

    sys.path[:0] = [str(baseline_path.parent), str(ROOT)]
    baseline = importlib.import_module("plain_gpu")
    from dlm.bench.throughput import synthetic_batches
    from dlm.config.schema import load_config
    from dlm.train.distributed import DistributedContext
    from dlm.train.step import LogWindow, TrainingStep

    experiment = load_config(config, overrides)
    size, batch, cpu = experiment.model, experiment.training.batch_size, torch.device("cpu")
    tokens = batch * size.max_seq_len
    # The baseline exactly as plain_cpu.py builds and steps it.
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
    return baseline_step, lambda: step.optimizer_step(batches, window), baseline_flops, dlm_flops


def run_steps(args: argparse.Namespace) -> dict[str, list[float]]:
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    baseline_step, dlm_step, baseline_flops, dlm_flops = step_pair(args.baseline, args.config, args.dlm_set)
    for _ in range(3):  # warmup, as plain_cpu.py
        baseline_step()
        dlm_step()
    gflops: dict[str, list[float]] = {"baseline": [], "dlm": []}
    for index in range(args.rounds):
        # Alternate who goes first, so neither side always follows the other's cache pollution.
        order = [("baseline", baseline_step, baseline_flops), ("dlm", dlm_step, dlm_flops)]
        for name, step, flops in order if index % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            step()
            gflops[name].append(flops / (time.perf_counter() - started) / 1e9)
    return gflops


def run_processes(args: argparse.Namespace) -> dict[str, list[float]]:
    env = dict(os.environ)
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    gflops: dict[str, list[float]] = {"baseline": [], "dlm": []}
    for index in range(args.rounds):
        baseline, dlm = run_baseline(args.baseline, env), run_dlm(args.config, args.dlm_set, env)
        gflops["baseline"].append(baseline["gflops"])
        gflops["dlm"].append(dlm["gflops"])
        print(f"round {index}: baseline {baseline['gflops']:.1f}, dlm {dlm['gflops']:.1f} GFLOP/s", file=sys.stderr)
    return gflops


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gflops = run_steps(args) if args.mode == "steps" else run_processes(args)
    summary: dict[str, Any] = {
        "mode": args.mode,
        "threads": args.threads,
        "rounds": args.rounds,
        "dlm_set": args.dlm_set,
        "gflops": gflops,
    }
    for statistic, reduce in (("median", statistics.median), ("best", max)):
        baseline, dlm = reduce(gflops["baseline"]), reduce(gflops["dlm"])
        summary[statistic] = {"baseline": round(baseline, 2), "dlm": round(dlm, 2), "ratio": round(dlm / baseline, 3)}
    if args.json:
        print(json.dumps(summary))
    else:
        for statistic in ("median", "best"):
            figures = summary[statistic]
            print(
                f"{statistic} model GFLOP/s over {args.rounds} ({args.mode}): baseline {figures['baseline']:.1f}, "
                f"dlm {figures['dlm']:.1f}, ratio dlm / baseline {figures['ratio']:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
