"""Remasking strategies: how a denoising step ranks the masked positions it could reveal.

`random` is ancestral sampling (each masked position revealed with the schedule's probability, no
ranking); `dilated` reveals the schedule's count of positions a step in a fixed order that spreads
each step's positions as far apart as it can (`dlm.diffusion.reveal_order`); every other strategy is a
confidence function registered here: given the model's
distribution at the N masked positions of the current block and the tokens sampled there, it
scores each position, and the step keeps the highest-scoring samples (the rest stay masked).
Registering a function is the one place to add a strategy: `dlm.sample(remasking=NAME)` accepts it
at once; the CLI offers the built-in names of `dlm.choices.Remasking`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dlm.registry import Registry

# (probs [N, V], sampled tokens [N]) -> confidence [N]; higher is revealed first.
Confidence = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ANCESTRAL = "random"
DILATED = "dilated"  # the planned order of `dlm.diffusion.reveal_order`
_CONFIDENCES: Registry[Confidence] = Registry("remasking strategy")


def register_remasking(name: str, confidence: Confidence, replace: bool = False) -> None:
    """Make `name` a remasking strategy ranked by `confidence`."""

    if name in (ANCESTRAL, DILATED):
        raise ValueError(f"remasking strategy {name!r} is already built in (it ranks by no confidence)")
    _CONFIDENCES.add(name, confidence, replace=replace)


def unregister_remasking(name: str) -> None:
    _CONFIDENCES.remove(name)


def remasking_names() -> tuple[str, ...]:
    """Every strategy the sampler accepts: ancestral sampling and the dilated order first, then the registered ones."""

    return (ANCESTRAL, DILATED, *_CONFIDENCES.names())


def token_confidence(probs: torch.Tensor, tokens: torch.Tensor, remasking: str) -> torch.Tensor:
    """Confidence [N] of sampled `tokens` [N] under `probs` [N, V] by the strategy `remasking`."""

    confidence = _CONFIDENCES.get(remasking)
    assert confidence is not None, remasking  # SamplingOptions accepts registered names only
    return confidence(probs, tokens)


def _sampled_probability(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # LLaDA's low-confidence remasking: the probability of the token actually sampled.
    return probs.gather(-1, tokens[:, None]).squeeze(-1)


def _margin(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # Top-1 minus top-2 probability: how clearly the model prefers one token, whatever was sampled.
    top2 = probs.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


register_remasking("confidence", _sampled_probability)
register_remasking("margin", _margin)
