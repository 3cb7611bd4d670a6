"""Monte Carlo variance of the ELBO's two estimators (bernoulli and exact-count) on one model.

For each estimator and each K of --mc-samples, the first --sequences held-out blocks are scored
--repeats times with independent noise (`dlm.diffusion.objective.elbo_nll`, K antithetic samples
each, as `dlm eval --mc-samples K` does). Per sequence, the variance of the K-sample estimate across
repeats is the Monte Carlo variance; its mean over sequences, bernoulli's over exact-count's, is how
many times more samples bernoulli needs for the same standard error. Both estimate the same bound,
so their mean difference must be zero within its standard error. No timing: a variance, not a
speed, so nothing is interleaved.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from benchmarks import harness
from dlm.artifacts.loading import load_model_with_info
from dlm.data.dataset import load_packed_dataset
from dlm.diffusion.objective import ESTIMATORS, elbo_nll, noise_seed, split_batch
from dlm.diffusion.schedules import model_schedule
from dlm.model.denoiser import block_size, masked_logits


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


def _key(estimator: str) -> str:
    return estimator.replace("-", "_")


def compare(drawn: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The figures of one K from each estimator's [repeats, S] estimates."""

    variance = {_key(name): float(values.var(dim=0).mean()) for name, values in drawn.items()}
    means = {_key(name): float(values.mean()) for name, values in drawn.items()}
    count = drawn["bernoulli"].numel()
    return {
        "nll": means,
        "mc_variance": variance,
        "mc_stderr_per_sequence": {name: math.sqrt(value) for name, value in variance.items()},
        "variance_ratio": variance["bernoulli"] / variance["exact_count"],
        "mean_difference": means["bernoulli"] - means["exact_count"],
        "mean_difference_stderr": math.sqrt(sum(variance.values()) / count),
    }


def elbo_variance(
    model_path: Annotated[Path, typer.Argument(metavar="MODEL", help="A checkpoint, run directory or export.")],
    data: Annotated[Path, typer.Option(help="A `dlm pack` directory (its val split) or .bin file.")],
    sequences: Annotated[int, typer.Option(min=1, help="Held-out blocks scored.")] = 64,
    repeats: Annotated[int, typer.Option(min=2, help="Independent scorings of each.")] = 32,
    mc_samples: Annotated[str, typer.Option(help="K values, comma-separated.")] = "1,8",
    seed: Annotated[int, typer.Option(help="Seed of the noise.")] = 0,
    threads: Annotated[int, typer.Option(min=1, help="torch threads.")] = 1,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """Monte Carlo variance of the bernoulli and exact-count ELBO estimators on one model."""

    counts = [int(value) for value in mc_samples.split(",")]
    if min(counts) < 1:
        raise typer.BadParameter("every K must be at least 1", param_hint="--mc-samples")
    torch.set_num_threads(threads)
    run = harness.start(
        "elbo-variance",
        model=str(model_path),
        data=str(data),
        sequences=sequences,
        repeats=repeats,
        mc_samples=counts,
        seed=seed,
    )
    loaded = load_model_with_info(model_path, "cpu", dtype=torch.float32)
    model, eps = loaded.model, loaded.info.diffusion.mask_eps
    dataset = load_packed_dataset(data, model.config.max_seq_len, split="val")
    items = [dataset[i] for i in range(min(sequences, len(dataset)))]
    if isinstance(items[0], tuple):
        batch: Any = (torch.stack([ids for ids, _ in items]), torch.stack([mask for _, mask in items]))
    else:
        batch = torch.stack([torch.as_tensor(item) for item in items])
    by_k: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    with torch.no_grad():
        for samples in counts:
            drawn = {name: estimates(model, batch, name, samples, repeats, seed, eps) for name in ESTIMATORS}
            by_k[f"mc_samples_{samples}"] = compare(drawn)
            raw[f"mc_samples_{samples}"] = {_key(name): values.var(dim=0).tolist() for name, values in drawn.items()}
    figures = {
        "model": str(loaded.info.path),
        "step": loaded.info.step,
        "sequences": len(items),
        "tokens_per_sequence": model.config.max_seq_len,
        "repeats": repeats,
        **by_k,
    }
    path = run.save(figures, {"mc_variance_per_sequence": raw}, results=results)
    typer.echo(f"{figures['model']} (step {figures['step']}): {len(items)} sequences, {repeats} repeats")
    typer.echo("K   NLL bernoulli  NLL exact-count  MC s.e. bernoulli  MC s.e. exact-count  variance ratio")
    for samples in counts:
        row = by_k[f"mc_samples_{samples}"]
        nll, error = row["nll"], row["mc_stderr_per_sequence"]
        typer.echo(
            f"{samples:<3} {nll['bernoulli']:13.4f}  {nll['exact_count']:15.4f}  "
            f"{error['bernoulli']:17.4f}  {error['exact_count']:19.4f}  {row['variance_ratio']:14.2f}"
        )
        typer.echo(f"    mean difference {row['mean_difference']:+.4f} ± {row['mean_difference_stderr']:.4f}")
    typer.echo(f"wrote {path}")
