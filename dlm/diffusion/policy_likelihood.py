"""Estimates of a completion's log-likelihood under a masked diffusion model: the policy of `dlm rl`.

A diffusion model has no exact, cheap sequence likelihood, so policy-gradient methods estimate it
from forward passes over partly masked copies of (prompt, completion). Every estimator here answers
in one form: a list of `ScoringDraw`s (what to feed, which completion tokens to score, and each
score's weight), so that the same draws give the rollout policy's scores and the current policy's,
whose per-token ratio GRPO clips. A completion's estimate is the weighted sum of its scores
(`EntryScores.per_sequence`). `samples` independent draws are averaged (weights divided by it).
Each row draws from its own generator, so a row's masks do not depend on the batch it is scored in
(its micro-batch, its process), only on the generator's seed.

- `one-step` (diffu-GRPO): the whole completion masked, each prompt token masked with
  `prompt_mask_probability`; one pass per sample. A mean-field estimate: every token is scored
  as if it were the first one written. Low variance, biased.
- `coupled` (coupled-GRPO): a time t per row; the completion tokens masked at t form one pass and
  the rest the other, so each token is scored exactly once per pair, with the other half as context.
- `elbo`: the exact-count ELBO: l of the n completion tokens masked (l uniform on 1..n, the l
  uniformly chosen), each masked token weighted n / l. Its mean is the diffusion ELBO, a lower
  bound of the log-likelihood (SPG's lower bound).
- `exact`: for a model whose blocks are one token (`block_size = 1`: each token conditioned on the
  tokens before it), the whole completion masked in one pass is the exact log-likelihood.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from dlm.diffusion.distillation import allowed_log_probs
from dlm.diffusion.objective import corrupt_exact_count
from dlm.registry import Registry


@dataclass(frozen=True)
class ScoringDraw:
    """One forward pass of an estimate over a batch of rows [B, L]."""

    noisy: Tensor  # [B, L] long: the rows with their hidden positions set to the mask token
    scored: Tensor  # [B, L] bool: the completion tokens whose log-probability counts in this pass
    weight: Tensor  # [B, L] float32: the weight of each scored token's log-probability (0 elsewhere)
    sample: int = 0  # which of the estimate's independent samples the pass belongs to


@dataclass(frozen=True)
class EntryScores:
    """Every scored token of every draw of a batch, in draw order: the units GRPO's ratio is taken over."""

    log_probs: Tensor  # [E] float32
    weights: Tensor  # [E] float32
    rows: Tensor  # [E] long: the row each entry belongs to
    samples: Tensor | None = None  # [E] long: the independent sample each entry belongs to

    def per_sequence(self, batch: int) -> Tensor:
        """The estimate of each row's completion log-likelihood [batch]: the weighted sum of its scores."""

        total = torch.zeros(batch, dtype=torch.float32, device=self.log_probs.device)
        return total.index_add(0, self.rows, self.log_probs * self.weights)

    def sample_variance(self, batch: int) -> Tensor | None:
        """The variance across the independent samples of each row's estimate, averaged over the rows:
        the estimator's own noise (None with one sample)."""

        if self.samples is None or self.samples.numel() == 0 or int(self.samples.max()) == 0:
            return None
        count = int(self.samples.max()) + 1
        index = self.rows * count + self.samples
        # Each sample's estimate of the row: its entries' weighted sum, times the count (weights carry 1 / count).
        each = torch.zeros(batch * count, dtype=torch.float32, device=self.log_probs.device)
        each = each.index_add(0, index, self.log_probs * self.weights * count).view(batch, count)
        return each.var(dim=1).mean()


class PolicyLikelihood(Protocol):
    """An estimator: the draws of `samples` estimates for `tokens` [B, L] whose `completion` [B, L] bool
    positions are scored and whose `prompt` [B, L] bool positions are the context (padding is neither),
    row b's random numbers drawn from `generators[b]`."""

    def __call__(
        self,
        tokens: Tensor,
        prompt: Tensor,
        completion: Tensor,
        mask_token_id: int,
        generators: Sequence[torch.Generator],
        *,
        samples: int,
        prompt_mask_probability: float,
    ) -> list[ScoringDraw]: ...


@dataclass(frozen=True)
class EstimatorSpec:
    draw: PolicyLikelihood
    passes_per_sample: int  # forward passes one sample costs
    needs_token_blocks: bool = False  # valid only where each token is its own block (block_size = 1)


_ESTIMATORS: Registry[EstimatorSpec] = Registry("likelihood estimator")


def register_estimator(name: str, spec: EstimatorSpec, replace: bool = False) -> None:
    _ESTIMATORS.add(name, spec, replace=replace)


def estimator_names() -> tuple[str, ...]:
    return _ESTIMATORS.names()


def get_estimator(name: str) -> EstimatorSpec:
    spec = _ESTIMATORS.get(name)
    if spec is None:
        raise KeyError(f"no likelihood estimator {name!r}; registered: {', '.join(estimator_names())}")
    return spec


def _uniform(generators: Sequence[torch.Generator], width: int, device: torch.device) -> Tensor:
    """[B, width] float64 uniforms, row b from `generators[b]`."""

    return torch.stack(
        [torch.rand(width, generator=generator, device=device, dtype=torch.float64) for generator in generators]
    )


def _draw(
    tokens: Tensor, hidden: Tensor, scored: Tensor, weight: Tensor | float, mask_token_id: int, sample: int = 0
) -> ScoringDraw:
    weights = scored.float() * weight
    return ScoringDraw(tokens.masked_fill(hidden, mask_token_id), scored, weights, sample)


def one_step(
    tokens: Tensor,
    prompt: Tensor,
    completion: Tensor,
    mask_token_id: int,
    generators: Sequence[torch.Generator],
    *,
    samples: int,
    prompt_mask_probability: float,
) -> list[ScoringDraw]:
    draws = []
    for sample in range(samples):
        masked_prompt = prompt & (_uniform(generators, tokens.shape[1], tokens.device) < prompt_mask_probability)
        draws.append(_draw(tokens, completion | masked_prompt, completion, 1.0 / samples, mask_token_id, sample))
    return draws


def coupled(
    tokens: Tensor,
    prompt: Tensor,
    completion: Tensor,
    mask_token_id: int,
    generators: Sequence[torch.Generator],
    *,
    samples: int,
    prompt_mask_probability: float,
) -> list[ScoringDraw]:
    draws = []
    for sample in range(samples):
        t = _uniform(generators, 1, tokens.device)
        first = completion & (_uniform(generators, tokens.shape[1], tokens.device) < t)
        second = completion & ~first
        draws += [_draw(tokens, part, part, 1.0 / samples, mask_token_id, sample) for part in (first, second)]
    return draws


def elbo(
    tokens: Tensor,
    prompt: Tensor,
    completion: Tensor,
    mask_token_id: int,
    generators: Sequence[torch.Generator],
    *,
    samples: int,
    prompt_mask_probability: float,
) -> list[ScoringDraw]:
    draws = []
    length = completion.sum(dim=1, keepdim=True).float()
    for sample in range(samples):
        units = _uniform(generators, 1, tokens.device)[:, 0].float()
        keys = _uniform(generators, tokens.shape[1], tokens.device).float()
        corruption = corrupt_exact_count(tokens, mask_token_id, units, keys, loss_mask=completion)
        masked = corruption.mask
        count = masked.sum(dim=1, keepdim=True).float().clamp(min=1)
        weight = masked.float() * length / count / samples
        draws.append(ScoringDraw(corruption.noisy_tokens, masked, weight, sample))
    return draws


def exact(
    tokens: Tensor,
    prompt: Tensor,
    completion: Tensor,
    mask_token_id: int,
    generators: Sequence[torch.Generator],
    *,
    samples: int,
    prompt_mask_probability: float,
) -> list[ScoringDraw]:
    return [_draw(tokens, completion, completion, 1.0, mask_token_id)]


register_estimator("one-step", EstimatorSpec(one_step, 1))
register_estimator("coupled", EstimatorSpec(coupled, 2))
register_estimator("elbo", EstimatorSpec(elbo, 1))
register_estimator("exact", EstimatorSpec(exact, 1, needs_token_blocks=True))

Logits = Callable[[Tensor, Tensor], Tensor]  # (noisy [B, L], scored [B, L]) -> logits [N, V] at the scored


def score_draws(
    logits_of: Logits, tokens: Tensor, draws: list[ScoringDraw], forbidden: Tensor, temperature: float = 1.0
) -> EntryScores:
    """The log-probability of every scored token of `draws` under the model `logits_of` runs, over the
    tokens a sampler may write (`forbidden` ids at probability 0) at the sampling `temperature`."""

    log_probs, weights, rows, samples = [], [], [], []
    for draw in draws:
        if not draw.scored.any():
            continue
        logits = logits_of(draw.noisy, draw.scored)
        if temperature != 1.0:
            logits = logits.float() / temperature
        chosen = allowed_log_probs(logits, forbidden).gather(1, tokens[draw.scored][:, None])[:, 0]
        log_probs.append(chosen)
        weights.append(draw.weight[draw.scored])
        rows.append(draw.scored.nonzero()[:, 0])
        samples.append(torch.full_like(rows[-1], draw.sample))
    if not log_probs:
        empty = torch.zeros(0, device=tokens.device)
        return EntryScores(empty, empty, empty.long(), empty.long())
    return EntryScores(torch.cat(log_probs), torch.cat(weights), torch.cat(rows), torch.cat(samples))
