"""Steps of a smaller model worth the same CPU time as `configs/cpu.toml`'s, timed interleaved.

usage: python scripts/step_budget.py [--config configs/cpu.toml] [--reference-steps 420]
           [--reference training.batch_size=64,model.d_model=256,model.n_heads=4]
           [--candidate model.vocab_size=2048,model.d_model=128 ...]
           [--precision float32] [--rounds 8] [--threads N] [--json]

"Ten minutes on a CPU without native bfloat16" is a step count of the reference model: 420 float32
steps of the demo's earlier CPU model (`configs/cpu.toml` with d_model 256, 4 heads) at batch 64
(1.31 s a step on a 2-core AVX2-only AMD EPYC). A smaller model, or a smaller batch, trains more
steps in that time. Every model here is dlm's own `TrainingStep` (the step `dlm train` runs; float32
unless --precision) on synthetic tokens; each is warmed up for 2 steps, then they take turns step by
step (the order rotating every round), so all see the same load from other work at nearly the same
moment. A candidate is the reference with its own overrides on top; its budget is the reference
steps times the reference's median step time over its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu.toml")
    parser.add_argument("--reference-steps", type=int, default=420, help="the reference's steps in the budget")
    parser.add_argument(
        "--reference",
        default="training.batch_size=64,model.d_model=256,model.n_heads=4",
        help="comma-separated --set overrides of the reference (default: the model and batch of the measured pace)",
    )
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--candidate",
        action="append",
        default=[],
        help="comma-separated --set overrides of one candidate (repeatable)",
    )
    parser.add_argument("--rounds", type=int, default=8, help="timed steps of each model")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.reference_steps < 1:
        parser.error("--rounds and --reference-steps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    from dlm.bench.throughput import interleaved_cpu_step_seconds
    from dlm.config.schema import load_config
    from dlm.config.shapes import count_parameters, format_parameter_count

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = ["reference", *args.candidate]
    experiments, parameters = {}, {}
    for name in names:
        # a candidate changes the reference: its overrides come after the reference's
        overrides = args.reference.split(",") + ([] if name == "reference" else name.split(","))
        precision = f"training.precision={args.precision}"
        experiment = load_config(args.config, ["training.device=cpu", precision, *filter(None, overrides)])
        experiments[name] = (experiment, args.precision)
        parameters[name] = count_parameters(experiment.model)
    seconds = interleaved_cpu_step_seconds(experiments, args.rounds)
    reference = statistics.median(seconds["reference"])
    rows = []
    for name in names:
        median = statistics.median(seconds[name])
        rows.append(
            {
                "model": name,
                "parameters": parameters[name],
                "median_step_seconds": round(median, 4),
                "speed_over_reference": round(reference / median, 3),
                "budget_steps": round(args.reference_steps * reference / median),
            }
        )
    if args.json:
        summary = {"config": str(args.config), "reference": args.reference, "precision": args.precision}
        print(json.dumps({**summary, "threads": torch.get_num_threads(), "rows": rows}))
        return 0
    print(
        f"{args.config} ({args.reference}), {torch.get_num_threads()} threads, {args.rounds} rounds, {args.precision}"
    )
    for row in rows:
        print(
            f"{row['budget_steps']:>6} steps  x{row['speed_over_reference']:<6} "
            f"{format_parameter_count(row['parameters']):>6}  {row['model']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
