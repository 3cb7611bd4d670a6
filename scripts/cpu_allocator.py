"""A CPU training step with glibc's malloc keeping freed memory (`dlm.runtime.allocator`) and without.

usage: python scripts/cpu_allocator.py [--config configs/cpu.toml] [--precision float32]
           [--steps 30] [--rounds 3] [--threads 2] [--json]

The setting is per process, so each measurement is a fresh process: `dlm`'s own `TrainingStep` on
synthetic tokens, 3 untimed steps, then --steps timed ones; the two settings alternate for --rounds
rounds, so both see the same load from other work. Prints the mean step time of each, their ratio
(the speed-up), and each process's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One measurement, run in a child process: (config, precision, steps, threads, keep) -> JSON line.
_CHILD = """
import json, resource, statistics, sys
import torch
config, precision, steps, threads, keep = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
from dlm.bench.throughput import synthetic_batches, timed_steps
from dlm.config.schema import load_config
from dlm.runtime.allocator import keep_freed_memory
from dlm.train.distributed import DistributedContext
from dlm.train.step import LogWindow, TrainingStep
if keep == "keep":
    assert keep_freed_memory(torch.device("cpu")), "this C library has no mallopt"
torch.set_num_threads(threads)
experiment = load_config(config)
cpu = torch.device("cpu")
step = TrainingStep(experiment, cpu, precision, DistributedContext())
step.prepare()
batches = synthetic_batches(experiment.model, experiment.training.batch_size, cpu, experiment.training.seed)
window = LogWindow(cpu)
for _ in range(3):
    step.optimizer_step(batches, window)
times = timed_steps(step, batches, window, steps)
peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"mean": statistics.mean(times), "peak_mib": peak_mib}))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu.toml")
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=3, help="processes of each setting, alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if min(args.steps, args.rounds, args.threads) < 1:
        parser.error("--steps, --rounds and --threads must be at least 1")
    return args


def measure(args: argparse.Namespace, keep: bool) -> dict[str, float]:
    command = [
        sys.executable,
        "-c",
        _CHILD,
        str(args.config),
        args.precision,
        str(args.steps),
        str(args.threads),
        "keep" if keep else "default",
    ]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ, **env})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"default": [], "keep": []}
    for round_index in range(args.rounds):
        order = ("default", "keep") if round_index % 2 == 0 else ("keep", "default")
        for name in order:
            runs[name].append(measure(args, name == "keep"))
    step = {name: statistics.mean(run["mean"] for run in found) for name, found in runs.items()}
    peak = {name: max(run["peak_mib"] for run in found) for name, found in runs.items()}
    report = {
        "config": str(args.config),
        "precision": args.precision,
        "threads": args.threads,
        "step_seconds": step,
        "speedup": step["default"] / step["keep"],
        "peak_mib": peak,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.config} ({args.precision}, {args.threads} threads, {args.rounds} rounds of {args.steps} steps)")
    for name in ("default", "keep"):
        print(f"  {name:8} {step[name]:.4f} s a step, peak {peak[name]:.0f} MiB")
    print(f"  keeping freed memory: {report['speedup']:.2f}x the steps per second")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
