"""Token sampling from logits: top-k / top-p filtering and an exact draw from what is left.

A diffusion sampler draws one token at every position it reveals, over the whole vocabulary, so
the draw is as much work per position as the model's output layer. It is done in a few linear
passes, with no sort and no noise per vocabulary entry:

- **The draw** is the inverse of the distribution function with one float64 uniform per row. The
  vocabulary is split into blocks of 64: a block is chosen by its mass, then a token inside it by
  a float64 cumulative sum of its 64 weights. Every token's chance is its weight to float64
  precision within its block; a block's own mass is a float32 sum (relative error ~1e-7), so no
  token with a positive weight is ever out of reach, however small (the failure of Gumbel noise in
  16 or 32 bits, whose truncated tails lose the rare tokens).
- **The top-p nucleus** is every token whose strictly more likely tokens hold less than `top_p` of
  the mass (tokens tied at the cut are all kept, as top-k keeps ties). It is sampled by rejection:
  a token drawn from the whole distribution is kept when it is in the nucleus, which one pass over
  the row decides, else another is drawn. The nucleus holds at least `top_p` of the mass, so a
  draw is kept with probability >= top_p; after `trials(top_p)` refusals (a chance of at most 1 in
  1,000) the row is drawn from the explicitly filtered nucleus (`filter_logits`, a sort), with one
  more uniform. Either way the token follows the nucleus distribution exactly.

The weights are float32 for a 16- or 32-bit model and float64 for a float64 one, so that a float64
model's batched and one-by-one samples agree as its logits do (docs/reproducibility.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_BLOCK = 64  # vocabulary entries per block of the two-level draw
_MISS = 1e-3  # the largest chance that every rejection trial of a row fails
_MAX_TRIALS = 16
_LOG2_E = 1 / math.log(2)


def filter_logits(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf all but the top-k logits and all but the top-p nucleus.

    Tokens tied with the k-th logit are kept; the nucleus keeps every token whose strictly more
    likely tokens hold less than `top_p` of the probability, so tokens tied at its cut are kept
    too. The most likely token always survives, so every row keeps a non-empty support.
    """

    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        logits = logits.masked_fill(logits < _nucleus_floor(logits, top_p), float("-inf"))
    return logits


def _nucleus_floor(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The least logit [..., 1] of the top-p nucleus of each row.

    Sorted from the most likely, the k-th value is in the nucleus when the values before it hold
    less than `top_p`; every token tied with the last such value is kept with it. A sort of the
    values alone suffices (no indices: ties need no order).
    """

    values = logits.detach().sort(dim=-1, descending=True).values
    probs = values.softmax(dim=-1)
    ahead = probs.cumsum(dim=-1).sub_(probs)
    kept = (ahead < top_p).sum(dim=-1, keepdim=True).clamp_min(1)  # a row of NaN keeps its first
    return values.gather(-1, kept - 1)


def trials(top_p: float | None) -> int:
    """Rejection trials per row for `top_p`: enough that all of them fail with chance <= 1/1000."""

    if top_p is None or top_p >= 1:
        return 1
    return max(1, min(_MAX_TRIALS, math.ceil(math.log(_MISS) / math.log1p(-top_p))))


def draws_per_row(top_p: float | None) -> int:
    """Uniform draws `sample_tokens` takes per row: one per trial, and one for the fallback."""

    return 1 if top_p is None or top_p >= 1 else trials(top_p) + 1


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of `logits` [N, V] (the most likely at temperature 0), as described above.

    `uniform` [N, draws_per_row(top_p)] (float64) gives the uniform draws instead of `generator`.
    """

    return _draw(_widened(logits), temperature, top_k, top_p, generator, uniform)[0]


def sample_with_probabilities(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens`, and the model's own distribution [N, V] (untempered and unfiltered), which
    confidence remasking and thresholds rank by. At temperature 1 without top-k these are the draw's
    weights over their total, normalised in place: no second pass of exponentials."""

    scores = _widened(logits)
    tokens, weights, total = _draw(scores, temperature, top_k, top_p, generator, uniform)
    plain = temperature == 1 and (top_k is None or top_k >= scores.size(-1))
    if weights is None or total is None or not plain:
        return tokens, scores.softmax(dim=-1)
    return tokens, weights.div_(total[:, None].to(weights.dtype))


def _widened(logits: torch.Tensor) -> torch.Tensor:
    # float32 for a 16- or 32-bit model, float64 for a float64 one
    return logits.detach().to(torch.promote_types(logits.dtype, torch.float32))


def _draw(
    scores: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    uniform: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The tokens, and the weights [N, V] (exp of the filtered scores less their maximum, a fresh
    buffer) with their total [N] (None at temperature 0, which draws nothing)."""

    if temperature == 0:
        return scores.argmax(dim=-1), None, None
    if temperature != 1:  # x / 1 is x: a pass over [N, V] saved
        scores = scores / temperature
    if top_k is not None and top_k < scores.size(-1):
        scores = filter_logits(scores, top_k=top_k)
    rows, width = scores.shape[0], draws_per_row(top_p)
    if uniform is None:
        uniform = torch.rand((rows, width), dtype=torch.float64, device=scores.device, generator=generator)
    elif tuple(uniform.shape) != (rows, width):
        raise ValueError(f"uniform draws of shape {tuple(uniform.shape)} for {rows} rows of {width}")
    weights = _weights(scores)
    mass = _BlockMass.of(weights)
    total = mass.ends[:, -1]
    picks = mass.draw(uniform[:, 0])
    if width == 1:
        return picks, weights, total
    assert top_p is not None
    enough = top_p * total
    pending = (~(_mass_ahead(scores, weights, picks, None) < enough)).nonzero().squeeze(-1)  # not in the nucleus
    for trial in range(1, width - 1):
        if pending.numel() == 0:
            break
        picks[pending] = mass.select(pending).draw(uniform[pending, trial])
        pending = pending[~(_mass_ahead(scores, weights, picks, pending) < enough[pending])]
    if pending.numel():  # every trial refused (at most 1 in 1,000): the sorted nucleus, its last uniform
        nucleus = filter_logits(scores[pending], top_p=top_p)
        picks[pending] = _BlockMass.of(_weights(nucleus)).draw(uniform[pending, -1])
    return picks, weights, total


def _weights(scores: torch.Tensor) -> torch.Tensor:
    """exp(scores - each row's maximum) [N, V], a fresh buffer, computed as 2^((x - max) log2 e).

    On a CPU torch's exp2 kernel is much cheaper than its exp, and this is one pass over every
    revealed position's vocabulary. x - max is exact near the maximum, and rounding its product by
    log2 e moves a weight by a relative 6e-8 x |x - max| at most: 1.2e-6 for a token e^20 times less
    likely than the most likely.
    """

    return torch.sub(scores, scores.amax(dim=-1, keepdim=True)).mul_(_LOG2_E).exp2_()


def _mass_ahead(
    scores: torch.Tensor, weights: torch.Tensor, picks: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """The weight of the tokens strictly more likely than each row's pick (of `rows`; None: all).

    sign(x - x_pick) clamped at 0 is the indicator x > x_pick, in place in one buffer: a third of
    the time of a comparison, a where and a sum.
    """

    if rows is not None:
        scores, weights, picks = scores[rows], weights[rows], picks[rows]
    chosen = scores.gather(-1, picks[:, None])
    return torch.sub(scores, chosen).sign_().clamp_(min=0).mul_(weights).sum(dim=-1)


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token [N] of each row of non-negative `weights` [N, V] at the uniform draw `uniform` [N]:
    the first whose cumulative weight passes u x total. Only entries of positive weight are returned."""

    return _BlockMass.of(weights).draw(uniform)


@dataclass(frozen=True)
class _BlockMass:
    """Weights [N, V] as blocks of 64 [N, V / 64, 64] (zero-padded), with each block's mass and the
    float64 cumulative masses of the blocks."""

    blocks: torch.Tensor
    mass: torch.Tensor
    ends: torch.Tensor

    @classmethod
    def of(cls, weights: torch.Tensor) -> _BlockMass:
        rows, vocab = weights.shape
        padded = F.pad(weights, (0, -vocab % _BLOCK)) if vocab % _BLOCK else weights
        blocks = padded.view(rows, -1, _BLOCK)
        mass = blocks.sum(dim=-1).double()
        return cls(blocks, mass, mass.cumsum(dim=-1))

    def select(self, rows: torch.Tensor) -> _BlockMass:
        return _BlockMass(self.blocks[rows], self.mass[rows], self.ends[rows])

    def draw(self, uniform: torch.Tensor) -> torch.Tensor:
        """Two levels: the block whose cumulative mass passes u x total, then the entry inside it
        whose float64 cumulative weight passes the rest."""

        ends, mass = self.ends, self.mass
        target = uniform.to(ends) * ends[:, -1]
        block = torch.searchsorted(ends, target[:, None], right=True)
        block = torch.minimum(block, _last_positive(mass))  # u x total rounded up to the total
        start = torch.where(block > 0, ends.gather(-1, (block - 1).clamp_min(0)), 0)
        within = (target[:, None] - start) / mass.gather(-1, block)  # uniform in [0, 1) inside the block
        entries = self.blocks.gather(1, block[:, :, None].expand(-1, -1, _BLOCK)).squeeze(1).double()
        cumulative = entries.cumsum(dim=-1)
        entry = torch.searchsorted(cumulative, within.clamp(0, 1) * cumulative[:, -1:], right=True)
        entry = torch.minimum(entry, _last_positive(entries))
        return (block * _BLOCK + entry).squeeze(-1)


def _last_positive(weights: torch.Tensor) -> torch.Tensor:
    """The index [N, 1] of the last positive entry of each row of `weights` [N, W]."""

    width = weights.shape[-1]
    return (width - 1 - (weights > 0).flip(-1).int().argmax(dim=-1, keepdim=True)).to(torch.long)
