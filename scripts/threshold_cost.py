"""The cost of a threshold pass against a plain pass: the per-pass time ratio on one tiny model.

usage: python scripts/threshold_cost.py [--vocab N] [--length N] [--samples N] [--rounds N] [--threshold P]

Builds an untrained whole-sequence model (vocabulary `--vocab`, context `--length`), then alternates
plain sampling (ancestral, the defaults: a pass samples only the positions it reveals), plain
sampling with `confidence` remasking (a pass samples every masked position, as a threshold pass
must) and `--threshold` sampling, all with one step per token, `--rounds` times each, on one CPU
thread. It prints the per-pass time of each (the fastest run of each: the least disturbed) and the
ratios. Only ratios carry over between machines: the samplers run interleaved, so other work on
shared cores slows them alike.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=0.9)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from dlm.config.schema import ModelConfig
    from dlm.model.transformer import DiffusionTransformer
    from dlm.sampling.dispatch import denoise
    from dlm.sampling.options import SamplingOptions

    config = ModelConfig(
        vocab_size=args.vocab, max_seq_len=args.length, d_model=64, n_layers=2, n_heads=2, pad_vocab_multiple=64
    )
    torch.manual_seed(0)
    model = DiffusionTransformer(config).eval()
    tokens = torch.full((args.samples, args.length), config.mask_token_id)
    fill = torch.ones(args.length, dtype=torch.bool)
    settings = {
        "plain": SamplingOptions(steps=args.length),
        "plain confidence": SamplingOptions(steps=args.length, remasking="confidence"),
        "threshold": SamplingOptions(steps=args.length, threshold=args.threshold),
    }
    best = dict.fromkeys(settings, float("inf"))
    with torch.inference_mode():
        for round_index in range(args.rounds + 1):
            for name, options in settings.items():
                start = time.perf_counter()
                _, passes = denoise(model, tokens, fill, options, generator=torch.Generator().manual_seed(0))
                if round_index > 0:  # the first round warms the kernels up, untimed
                    best[name] = min(best[name], (time.perf_counter() - start) / passes)
    print("per pass: " + ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in best.items()))
    print(
        f"threshold / plain {best['threshold'] / best['plain']:.2f}, "
        f"threshold / plain confidence {best['threshold'] / best['plain confidence']:.2f}"
    )


if __name__ == "__main__":
    main()
