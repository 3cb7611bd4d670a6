"""Where the time of the dual-cache sampler goes: cache refreshes, block passes, work outside the model.

usage: python scripts/generation_time_split.py MODEL [--samples N] [--length N] [--steps N]
           [--block-length N] [--runs N]

Samples MODEL (an export directory or checkpoint) unconditionally with `--cache dual` on one CPU
thread and prints, per run, the seconds of the whole run, of all model calls, of the refresh
passes among them (a full pass at every block boundary) and of everything outside the model
(sampling over the vocabulary, row selection, Python). Shares, not absolute times, are what
carry over between machines.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import dlm
    from dlm.sampling import fast as decoding
    from dlm.sampling.generation import generate

    model, tokenizer = dlm.load(args.model)
    spent = {"model": 0.0, "refresh": 0.0}
    started: list[float] = []
    model.register_forward_pre_hook(lambda module, inputs: started.append(time.perf_counter()))

    def record(module: Any, inputs: Any, output: Any) -> None:
        spent["model"] += time.perf_counter() - started.pop()

    model.register_forward_hook(record)
    refresh = decoding._FastReverse._refresh

    def timed_refresh(self: Any, *inputs: Any) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return refresh(self, *inputs)
        finally:
            spent["refresh"] += time.perf_counter() - start

    setattr(decoding._FastReverse, "_refresh", timed_refresh)  # noqa: B010 (a method swapped for timing)
    options = {
        "length": args.length,
        "steps": args.steps,
        "num_samples": args.samples,
        "block_length": args.block_length,
        "cache": "dual",
        "seed": 0,
    }
    generate(model, tokenizer, **(options | {"length": 8, "steps": 2}))  # warm-up
    for _ in range(args.runs):
        spent.update(model=0.0, refresh=0.0)
        total = generate(model, tokenizer, **options).seconds
        outside = total - spent["model"]
        print(
            f"total {total:.3f} s: model {spent['model']:.3f} (refresh passes {spent['refresh']:.3f}, "
            f"{spent['refresh'] / total:.0%}), outside the model {outside:.3f} ({outside / total:.0%})"
        )


if __name__ == "__main__":
    main()
