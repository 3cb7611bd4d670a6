"""dlm's token draw against the textbook one: the same distribution, and the cost of each.

usage: python scripts/token_draw_cost.py [--rows 128] [--vocab 8192] [--top-p 0.9] [--rounds 20]

The textbook draw (written out below, as dlm drew tokens before 0.10) sorts each row for the top-p
cut and adds float64 Gumbel noise to every logit. `dlm.sampling.tokens.sample_tokens` draws by the
inverse of the distribution function in blocks of 64, with the nucleus by rejection (no sort, one
uniform per trial). On logits as a bfloat16 model gives them, this script

- checks that both draw from the same distribution: over 200,000 draws of one row of 64 tokens,
  each sampler's frequencies against the exact nucleus distribution (total variation), and
- times both on [rows, vocab], interleaved in one process on one thread, in CPU seconds, printing
  the median of each and their ratio. Ratios, not times, carry over between machines.

128 rows is what one step of 16 samples x 64 tokens reveals at 8 steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlm.runtime.allocator import keep_freed_memory
from dlm.sampling.tokens import filter_logits, sample_tokens


def textbook_draw(logits: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """The top-p cut by a sort, then Gumbel-max with float64 noise over the whole vocabulary."""

    logits = filter_logits(logits.double(), top_p=top_p)
    uniform = torch.rand(logits.shape, dtype=torch.float64, generator=generator)
    return (logits - uniform.clamp_min(torch.finfo(torch.float64).tiny).log().neg().log()).argmax(dim=-1)


def dlm_draw(logits: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    return sample_tokens(logits, top_p=top_p, generator=generator)


def bfloat16_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * 2.5).bfloat16().float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128, help="positions drawn at once")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory(torch.device("cpu"))  # as dlm's sampling does
    samplers = {"textbook (sort + Gumbel)": textbook_draw, "dlm (inverse CDF + rejection)": dlm_draw}

    row = bfloat16_logits(1, 64, seed=1)
    exact = filter_logits(row.double(), top_p=args.top_p).softmax(dim=-1)[0]
    draws = 200_000
    for name, draw in samplers.items():
        tokens = draw(row.expand(draws, -1), args.top_p, torch.Generator().manual_seed(2))
        frequencies = torch.bincount(tokens, minlength=64).double() / draws
        distance = float((frequencies - exact).abs().sum() / 2)
        print(f"{name:>30}: total variation from the nucleus distribution {distance:.4f}")

    logits = bfloat16_logits(args.rows, args.vocab, seed=0)
    generator = torch.Generator().manual_seed(3)
    times: dict[str, list[float]] = {name: [] for name in samplers}
    for _ in range(args.rounds):
        for name, draw in samplers.items():
            started = time.process_time()
            draw(logits, args.top_p, generator)
            times[name].append(time.process_time() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.rows} rows x {args.vocab} tokens, top-p {args.top_p}, one thread:")
    for name, median in medians.items():
        print(f"{name:>30}: {median * 1e3:8.2f} ms (median CPU time of {args.rounds})")
    textbook, ours = medians.values()
    print(f"textbook / dlm: {textbook / ours:.2f}x")


if __name__ == "__main__":
    main()
