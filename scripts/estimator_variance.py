"""Monte Carlo variance of the ELBO's two estimators (bernoulli and exact-count) on one model.

usage: python scripts/estimator_variance.py MODEL --data DATA [--sequences 64] [--repeats 32]
       [--mc-samples 1 8] [--seed 0] [--json]

MODEL is anything `dlm eval` reads (a checkpoint, a run directory or an export); DATA a `dlm pack`
directory (its val split) or .bin file. For each estimator and each K of --mc-samples, the first
--sequences blocks are scored --repeats times with independent noise (`dlm.diffusion.objective.elbo_nll`,
K antithetic samples each, as `dlm eval --mc-samples K` does). Per sequence, the variance of the
K-sample estimate across repeats is the Monte Carlo variance; its mean over sequences, bernoulli's
over exact-count's, is how many times more samples bernoulli needs for the same standard error.
Both estimate the same bound, so their mean difference must be zero within its standard error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from dlm.artifacts.loading import load_model_with_info
from dlm.data.dataset import load_packed_dataset
from dlm.diffusion.objective import ESTIMATORS, elbo_nll, noise_seed, split_batch
from dlm.diffusion.schedules import model_schedule
from dlm.model.denoiser import block_size, masked_logits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=32)
    parser.add_argument("--mc-samples", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.sequences < 1 or args.repeats < 2 or min(args.mc_samples) < 1:
        parser.error("--sequences and --mc-samples must be at least 1, --repeats at least 2")
    return args


def estimates(
    model: Any, batch: Any, estimator: str, samples: int, repeats: int, seed: int, eps: float
) -> torch.Tensor:
    """[repeats, S] K-sample estimates of the negative ELBO per token, independent noise per repeat."""

    clean, loss_mask = split_batch(batch)
    config = model.config
    block = block_size(config)

    def logits(noisy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return masked_logits(model, noisy, mask, clean)

    rows = []
    for repeat in range(repeats):
        generator = torch.Generator().manual_seed(noise_seed(seed, samples, repeat))
        mean, _ = elbo_nll(
            logits,
            clean,
            config.mask_token_id,
            samples,
            eps,
            generator,
            schedule=model_schedule(model),
            block_size=block,
            loss_mask=loss_mask,
            estimator=estimator,
        )
        rows.append(mean.double())
    return torch.stack(rows)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    loaded = load_model_with_info(args.model, "cpu", dtype=torch.float32)
    model, eps = loaded.model, loaded.info.diffusion.mask_eps
    dataset = load_packed_dataset(args.data, model.config.max_seq_len, split="val")
    items = [dataset[i] for i in range(min(args.sequences, len(dataset)))]
    if isinstance(items[0], tuple):
        batch: Any = (torch.stack([ids for ids, _ in items]), torch.stack([mask for _, mask in items]))
    else:
        batch = torch.stack([torch.as_tensor(item) for item in items])
    rows = []
    with torch.no_grad():
        for samples in args.mc_samples:
            drawn = {name: estimates(model, batch, name, samples, args.repeats, args.seed, eps) for name in ESTIMATORS}
            variance = {name: float(values.var(dim=0).mean()) for name, values in drawn.items()}
            means = {name: float(values.mean()) for name, values in drawn.items()}
            count = drawn["bernoulli"].numel()
            difference_error = math.sqrt(sum(variance.values()) / count)
            rows.append(
                {
                    "mc_samples": samples,
                    "nll": means,
                    "mc_variance": variance,
                    "mc_stderr_per_sequence": {name: math.sqrt(value) for name, value in variance.items()},
                    "variance_ratio": variance["bernoulli"] / variance["exact-count"],
                    "mean_difference": means["bernoulli"] - means["exact-count"],
                    "mean_difference_stderr": difference_error,
                }
            )
    return {
        "model": str(loaded.info.path),
        "step": loaded.info.step,
        "sequences": len(items),
        "tokens_per_sequence": model.config.max_seq_len,
        "repeats": args.repeats,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = measure(args)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    print(f"{result['model']} (step {result['step']}): {result['sequences']} sequences, {result['repeats']} repeats")
    print("K   NLL bernoulli  NLL exact-count  MC s.e. bernoulli  MC s.e. exact-count  variance ratio")
    for row in result["rows"]:
        nll, error = row["nll"], row["mc_stderr_per_sequence"]
        print(
            f"{row['mc_samples']:<3} {nll['bernoulli']:13.4f}  {nll['exact-count']:15.4f}  "
            f"{error['bernoulli']:17.4f}  {error['exact-count']:19.4f}  {row['variance_ratio']:14.2f}"
        )
        print(f"    mean difference {row['mean_difference']:+.4f} ± {row['mean_difference_stderr']:.4f}")


if __name__ == "__main__":
    main()
