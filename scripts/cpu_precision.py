"""Training-step time of float32 against bfloat16 autocast on this CPU, interleaved in one process.

usage: python scripts/cpu_precision.py [--config configs/cpu.toml] [--rounds 10] [--threads N] [--json]

Both steps are dlm's own `TrainingStep` (the step `dlm train` and `dlm bench` run) at the config's
size on synthetic tokens. Each is warmed up for 2 steps, then they alternate step by step (who goes
first alternates too), so both see the same load from other work at nearly the same moment. The
ratio float32 / bfloat16 of the median step times is how many more steps bfloat16 trains in the
same time; on a CPU without AVX512-BF16 or AMX it is emulated and the ratio falls below one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("float32", "bfloat16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu.toml")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps of each precision")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    from dlm.bench.throughput import interleaved_cpu_step_seconds
    from dlm.config.schema import load_config
    from dlm.runtime.device import cpu_has_native_bfloat16

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    experiment = load_config(args.config, ["training.device=cpu"])
    runs = {precision: (experiment, precision) for precision in PRECISIONS}
    seconds = interleaved_cpu_step_seconds(runs, args.rounds)
    medians = {precision: statistics.median(values) for precision, values in seconds.items()}
    result = {
        "config": str(args.config),
        "threads": torch.get_num_threads(),
        "native_bfloat16": cpu_has_native_bfloat16(),
        "rounds": args.rounds,
        "median_step_seconds": {precision: round(value, 4) for precision, value in medians.items()},
        "float32_over_bfloat16": round(medians["float32"] / medians["bfloat16"], 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
