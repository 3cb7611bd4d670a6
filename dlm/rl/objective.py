"""GRPO's arithmetic: group-normalised advantages, the clipped per-token objective and the KL penalty.

The units are the scored entries of a likelihood estimate (`dlm.diffusion.policy_likelihood`): entry
e of row r has the current policy's log-probability `new[e]`, the rollout policy's `old[e]` under the
same draw, and the estimator's weight `w[e]`. With ratio `rho = exp(new - old)` and the row's
advantage A, the objective of a row is the weighted mean over its entries of
`min(rho A, clip(rho, 1 - eps, 1 + eps) A)`, minus `beta` times the weighted mean of the k3 KL
estimate `exp(ref - new) - (ref - new) - 1` against the reference; the loss is minus the mean over
rows. At the rollout's weights (rho = 1) its gradient is A times the gradient of the row's estimate
divided by its total weight: the plain policy gradient of that estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ADVANTAGE_EPS = 1e-4  # keeps a near-constant group's advantages finite


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True) -> Tensor:
    """Each reward [R] minus its group's mean (groups of `group_size` consecutive rows), divided by the
    group's standard deviation when `scale` (GRPO). A group whose rewards are all equal gets zeros."""

    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
    return centred.flatten()


@dataclass(frozen=True)
class PolicyLoss:
    loss: Tensor  # scalar: the value to minimise
    clipped: Tensor  # scalar: the share of the weight whose ratio the clip held
    kl: Tensor  # scalar: the mean KL estimate to the reference (0 without one)


def _row_means(values: Tensor, weights: Tensor, rows: Tensor, batch: int) -> Tensor:
    """Each row's weighted mean of `values` [E] over its entries [batch] (0 for a row without any)."""

    total = torch.zeros(batch, dtype=torch.float32, device=values.device).index_add(0, rows, values * weights)
    norm = torch.zeros(batch, dtype=torch.float32, device=values.device).index_add(0, rows, weights)
    return total / norm.clamp(min=1e-12)


def clipped_policy_loss(
    new: Tensor,
    old: Tensor,
    weights: Tensor,
    rows: Tensor,
    advantages: Tensor,
    clip_epsilon: float,
    reference: Tensor | None = None,
    kl_weight: float = 0.0,
    rows_total: int | None = None,
) -> PolicyLoss:
    """GRPO's loss over entries [E] of `advantages.shape[0]` rows, averaged over `rows_total` rows (the
    whole step's, when this call sees one micro-batch of it; default: these rows)."""

    batch = advantages.shape[0]
    divisor = batch if rows_total is None else rows_total
    advantage = advantages[rows]
    ratio = torch.exp(new - old)
    bounded = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon)
    objective = torch.minimum(ratio * advantage, bounded * advantage)
    per_row = _row_means(objective, weights, rows, batch)
    kl = torch.zeros((), device=new.device)
    if reference is not None and kl_weight > 0:
        log_ratio = reference - new
        per_row_kl = _row_means(torch.exp(log_ratio) - log_ratio - 1, weights, rows, batch)
        per_row = per_row - kl_weight * per_row_kl
        kl = per_row_kl.detach().sum() / divisor
    held = ((ratio * advantage) != objective).float().detach()
    clipped = (held * weights).sum() / weights.sum().clamp(min=1e-12)
    return PolicyLoss(-per_row.sum() / divisor, clipped, kl)
