"""The top-p cut on logits from a bfloat16 model: the values-only cut against the indexed sort.

usage: python scripts/top_p_cut_cost.py [--rows 1024] [--vocab 8192] [--top-p 0.9] [--rounds 20]

A bfloat16 model's logits, widened to float64 for sampling, hold many exact ties, so the nucleus
boundary often falls inside a run of equal logits. `dlm.sampling.tokens._nucleus_cut` finds the
cut from the sorted values alone and keeps the tied tokens lowest id first, exactly as the
reference `_sorted_drop` (a stable sort with indices) does. This script checks that the two agree
on every row, counts the rows tied at the cut, and times both, interleaved in one process on one
thread, printing the median time of each and their ratio. Ratios, not times, carry over between
machines.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dlm.sampling.tokens import _nucleus_cut, _sorted_drop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024, help="positions sampled at once (batch x masked)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    # A trained model's logits spread over several units; rounding to bfloat16 is what makes ties.
    logits = (torch.randn(args.rows, args.vocab, generator=generator) * 3).bfloat16().double()
    fast = _nucleus_cut(logits, args.top_p)
    reference = _sorted_drop(logits, args.top_p)
    assert fast is not None and torch.equal(fast, reference), "the values-only cut must equal the indexed sort"
    kept = (~reference).sum(dim=-1)
    sorted_values = logits.sort(dim=-1, descending=True).values
    last = sorted_values.gather(-1, (kept - 1)[:, None])
    after = sorted_values.gather(-1, kept.clamp_max(args.vocab - 1)[:, None])
    tied = int(((kept < args.vocab)[:, None] & (after == last)).sum())
    times: dict[str, list[float]] = {"values-only cut": [], "indexed sort": []}
    for _ in range(args.rounds):
        for name, cut in (("values-only cut", _nucleus_cut), ("indexed sort", _sorted_drop)):
            started = time.perf_counter()
            cut(logits, args.top_p)
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.rows} rows x {args.vocab} tokens, top-p {args.top_p}: {tied} rows tied at the cut; equal: yes")
    for name, median in medians.items():
        print(f"{name:>16}: {median * 1e3:8.2f} ms (median of {args.rounds})")
    print(f"indexed sort / values-only cut: {medians['indexed sort'] / medians['values-only cut']:.2f}x")


if __name__ == "__main__":
    main()
