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
- **The top-p nucleus** is every token whose strictly heavier tokens (by weight, that is by
  probability) hold less than `top_p` of the mass (tokens tied at the cut are all kept, as top-k
  keeps ties). It is sampled by rejection: a token drawn from the whole distribution is kept when it
  is in the nucleus, else another is drawn. A pick holding more than 1 - `top_p` of the mass is in
  the nucleus by itself; any other is decided by one pass over its row. The nucleus holds at least
  `top_p` of the mass, so a draw is kept with probability >= top_p; after `trials(top_p)` refusals
  (a chance of at most 1 in 1,000) the row is drawn from the explicitly cut nucleus (a sort), with
  one more uniform. Either way the token follows the nucleus distribution exactly.

The weights are float32 for a 16- or 32-bit model and float64 for a float64 one, so that a float64
model's batched and one-by-one samples agree as its logits do (docs/reproducibility.md). Every pass
over the vocabulary counts (a fast sampler's step draws at many positions): the weights are made in
one buffer, in place (the caller's own with `overwrite`), and the nucleus test is a comparison, a
product and a sum. On a CPU the rows go through these passes a few at a time, so that each pass
reads what the last one wrote from the core's cache rather than from memory: the same arithmetic
row by row, with far less memory traffic at a fast sampler's 128 rows of 8,192 tokens.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_BLOCK = 64  # vocabulary entries per block of the two-level draw
_MISS = 1e-3  # the largest chance that every rejection trial of a row fails
_MAX_TRIALS = 16
_CACHED_BYTES = 1 << 19  # a CPU draw's rows at a time: their weights and one buffer of that size fit an L2 cache


def filter_logits(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf all but the top-k logits and all but the top-p nucleus.

    Tokens tied with the k-th logit are kept; the nucleus keeps every token whose strictly more
    likely tokens hold less than `top_p` of the probability, so tokens tied at its cut are kept
    too. The most likely token always survives, so every row keeps a non-empty support.
    """

    if top_k is not None and top_k < logits.size(-1):
        logits = logits.masked_fill(logits < _top_k_floor(logits, top_k), float("-inf"))
    if top_p is not None and top_p < 1:
        logits = logits.masked_fill(logits < _nucleus_floor(logits, top_p), float("-inf"))
    return logits


def _top_k_floor(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The k-th largest logit [..., 1] of each row: the least that top-k keeps (ties with it kept)."""

    return torch.topk(logits, top_k, dim=-1).values[..., -1:]


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
    overwrite: bool = False,
) -> torch.Tensor:
    """One token per row of `logits` [N, V] (the most likely at temperature 0), as described above.

    `uniform` [N, draws_per_row(top_p)] (float64) gives the uniform draws instead of `generator`.
    With `overwrite` the draw may make its weights in `logits` itself (a buffer of the caller's that
    it no longer needs): a pass over [N, V] and a buffer of that size saved.
    """

    return _draw(logits, temperature, top_k, top_p, generator, uniform, overwrite)[0]


def sample_with_probabilities(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
    overwrite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens`, and the model's own distribution [N, V] (untempered and unfiltered), which
    confidence remasking and thresholds rank by. At temperature 1 without top-k these are the draw's
    weights over their total, normalised in place: no second pass of exponentials (with `overwrite`,
    possibly in `logits` itself)."""

    plain = temperature == 1 and (top_k is None or top_k >= logits.size(-1))
    own = None if plain else _widened(logits).softmax(dim=-1)  # before `overwrite` lets the draw reuse them
    tokens, weights, total = _draw(logits, temperature, top_k, top_p, generator, uniform, overwrite)
    if own is not None:
        return tokens, own
    assert weights is not None and total is not None  # temperature 0 is not plain
    return tokens, weights.div_(total[:, None].to(weights.dtype))


def _widened(logits: torch.Tensor) -> torch.Tensor:
    # float32 for a 16- or 32-bit model, float64 for a float64 one
    return logits.detach().to(torch.promote_types(logits.dtype, torch.float32))


def _draw(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    uniform: torch.Tensor | None,
    overwrite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The tokens, and the weights [N, V] (exp of the tempered, top-k filtered scores less their
    maximum: a fresh buffer, or with `overwrite` possibly `logits` itself) with their total [N]
    (None at temperature 0, which draws nothing)."""

    if temperature == 0:
        return logits.detach().argmax(dim=-1), None, None
    rows, width = logits.shape[0], draws_per_row(top_p)
    if uniform is None:
        uniform = torch.rand((rows, width), dtype=torch.float64, device=logits.device, generator=generator)
    elif tuple(uniform.shape) != (rows, width):
        raise ValueError(f"uniform draws of shape {tuple(uniform.shape)} for {rows} rows of {width}")
    weights, mass = _weighed(logits, temperature, top_k, overwrite)
    total = mass.ends[:, -1]
    picks = mass.draw(uniform[:, 0])
    if width == 1:
        return picks, weights, total
    assert top_p is not None
    enough = top_p * total
    pending = _outside(weights, picks, total, top_p)
    for trial in range(1, width - 1):
        if pending.numel() == 0:
            break
        again = mass.select(pending)
        picks[pending] = again.draw(uniform[pending, trial])
        pending = pending[~(_mass_ahead(again.weights, picks[pending]) < enough[pending])]
    if pending.numel():  # every trial refused (at most 1 in 1,000): the sorted nucleus, its last uniform
        picks[pending] = _BlockMass.of(_nucleus(weights[pending], top_p)).draw(uniform[pending, -1])
    return picks, weights, total


def _weighed(
    logits: torch.Tensor, temperature: float, top_k: int | None, overwrite: bool
) -> tuple[torch.Tensor, _BlockMass]:
    """The weights [N, V] (`_weights`) in one buffer of the draw's dtype (a fresh one, or with
    `overwrite` the logits themselves where they are contiguous and of that dtype), and their block
    masses, made a few rows at a time (`_row_parts`)."""

    dtype = torch.promote_types(logits.dtype, torch.float32)
    source = logits.detach()
    reuse = overwrite and source.dtype == dtype and source.is_contiguous()
    parts = _row_parts(source.shape, source.element_size() if reuse else dtype.itemsize, source.device)
    if len(parts) == 1:  # the fewest calls: a small draw's time is mostly their overhead
        weights = _weights(source if reuse else source.to(dtype, copy=True), temperature, top_k)
        return weights, _BlockMass.of(weights)
    weights = source if reuse else torch.empty(source.shape, dtype=dtype, device=source.device)
    sums = torch.empty(source.shape[0], -(-source.shape[1] // _BLOCK), dtype=dtype, device=source.device)
    for part in parts:
        made = weights[part]
        if not reuse:
            made.copy_(source[part])
        torch.sum(_blocks(_weights(made, temperature, top_k)), dim=-1, out=sums[part])
    return weights, _BlockMass.of(weights, sums)


def _row_parts(shape: torch.Size, element_size: int, device: torch.device) -> list[slice]:
    """Slices of nearly equal numbers of rows of an [N, V] buffer of `element_size`-byte entries,
    each within `_CACHED_BYTES` on a CPU; one slice of all rows where they are few enough that a
    split would cost more calls than it saves, and on other devices (a GPU's kernels want the whole
    batch)."""

    rows, size = shape[0], shape[1] * element_size
    split = device.type == "cpu" and rows * size > 2 * _CACHED_BYTES
    parts = min(rows, -(-rows * size // _CACHED_BYTES)) if split else 1
    bounds = [rows * index // parts for index in range(parts + 1)]
    return [slice(start, end) for start, end in itertools.pairwise(bounds)]


def _weights(scores: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """exp(x - each row's maximum) [N, V] of the scores x (the logits over `temperature`, cut to the
    top k), made in place in `scores`.

    x - max is exact near the maximum and exp rounds once. Torch's CPU exp kernel is also cheaper
    than its exp2 (2^((x - max) log2 e), a multiplication more, what dlm drew with up to 0.17).
    """

    if temperature != 1:  # x / 1 is x: a pass over [N, V] saved
        scores.div_(temperature)
    if top_k is not None and top_k < scores.size(-1):
        scores.masked_fill_(scores < _top_k_floor(scores, top_k), float("-inf"))  # `filter_logits`, in place
    return scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()


def _blocks(weights: torch.Tensor) -> torch.Tensor:
    """`weights` [N, V] as blocks of 64 [N, ceil(V / 64), 64], zero-padded (a copy) where V is not a multiple."""

    rows, vocab = weights.shape
    padded = F.pad(weights, (0, -vocab % _BLOCK)) if vocab % _BLOCK else weights
    return padded.view(rows, -1, _BLOCK)


def _outside(weights: torch.Tensor, picks: torch.Tensor, total: torch.Tensor, top_p: float) -> torch.Tensor:
    """The rows [P] whose pick is outside the nucleus: the tokens strictly heavier than it hold
    top_p x `total` or more.

    A pick holding more than (1 - top_p) x total is in the nucleus with no pass over its row: the
    tokens heavier than it hold at most the total less its weight. The others are tested all at
    once, or as a copy of their rows where they are under two thirds of them (a copy is one pass,
    the test two). Counting them is a read from the device, beside the one for the refused rows.
    """

    enough = top_p * total
    chosen = weights.gather(-1, picks[:, None]).squeeze(-1)
    light = chosen <= (1 - top_p) * total
    doubtful = light.nonzero().squeeze(-1)
    if doubtful.numel() * 3 >= weights.shape[0] * 2:  # a heavy pick stays in, whatever its rounded sum says
        return (light & ~(_mass_ahead(weights, picks) < enough)).nonzero().squeeze(-1)
    return doubtful[~(_mass_ahead(weights[doubtful], picks[doubtful]) < enough[doubtful])]


def _mass_ahead(weights: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """The weight [N] of the tokens strictly heavier than each row's pick: the indicator of
    w > w_pick, written in the weights' dtype, times the weights in place, summed (a few rows at a
    time, in one buffer, on a CPU)."""

    chosen = weights.gather(-1, picks[:, None])
    parts = _row_parts(weights.shape, weights.element_size(), weights.device)
    if len(parts) == 1:
        return torch.gt(weights, chosen, out=torch.empty_like(weights)).mul_(weights).sum(dim=-1)
    ahead = torch.empty(weights.shape[0], dtype=weights.dtype, device=weights.device)
    rows = max(part.stop - part.start for part in parts)
    room = torch.empty((rows, weights.shape[1]), dtype=weights.dtype, device=weights.device)
    for part in parts:
        heavier = torch.gt(weights[part], chosen[part], out=room[: part.stop - part.start])
        torch.sum(heavier.mul_(weights[part]), dim=-1, out=ahead[part])
    return ahead


def _nucleus(weights: torch.Tensor, top_p: float) -> torch.Tensor:
    """`weights` [N, V] with 0 outside each row's top-p nucleus: every token whose strictly heavier
    tokens hold less than `top_p` of the row's mass (ties at the cut all kept). Sorted from the
    heaviest, with a float64 running sum."""

    values = weights.sort(dim=-1, descending=True).values
    running = values.double().cumsum(dim=-1)
    ahead = running - values.double()
    kept = (ahead < top_p * running[:, -1:]).sum(dim=-1, keepdim=True).clamp_min(1)
    return weights.masked_fill(weights < values.gather(-1, kept - 1), 0)


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token [N] of each row of non-negative `weights` [N, V] at the uniform draw `uniform` [N]:
    the first whose cumulative weight passes u x total. Only entries of positive weight are returned."""

    return _BlockMass.of(weights).draw(uniform)


@dataclass(frozen=True)
class _BlockMass:
    """Weights [N, V] with the masses of their blocks of 64 [N, ceil(V / 64)] (the last block
    zero-padded) and the float64 cumulative masses of the blocks."""

    weights: torch.Tensor
    mass: torch.Tensor
    ends: torch.Tensor

    @classmethod
    def of(cls, weights: torch.Tensor, sums: torch.Tensor | None = None) -> _BlockMass:
        """The block masses of `weights`: their `sums` in the weights' dtype, summed here if not given."""

        mass = (_blocks(weights).sum(dim=-1) if sums is None else sums).double()
        return cls(weights, mass, mass.cumsum(dim=-1))

    def select(self, rows: torch.Tensor) -> _BlockMass:
        return _BlockMass(self.weights[rows], self.mass[rows], self.ends[rows])

    def draw(self, uniform: torch.Tensor) -> torch.Tensor:
        """Two levels: the block whose cumulative mass passes u x total, then the entry inside it
        whose float64 cumulative weight passes the rest.

        Each target is kept below its total (u x total may round up to it): the first cumulative
        sum past it is then always an entry, or a block, of positive weight. A row with no
        distribution (NaN weights, from NaN or all -inf logits) draws some token of the vocabulary.
        """

        ends, mass, vocab = self.ends, self.mass, self.weights.shape[1]
        target = _below(uniform.to(ends)[:, None] * ends[:, -1:], ends[:, -1:])
        block = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[-1] - 1)
        start = torch.where(block > 0, ends.gather(-1, (block - 1).clamp_min(0)), 0)
        within = (target - start) / mass.gather(-1, block)  # uniform in [0, 1) inside the block
        if vocab % _BLOCK:  # the last block's padding weighs nothing
            index = block * _BLOCK + torch.arange(_BLOCK, device=block.device)  # the block's entries [N, 64]
            entries = self.weights.gather(1, index.clamp(max=vocab - 1)).double().masked_fill_(index >= vocab, 0)
        else:
            entries = _blocks(self.weights).gather(1, block[:, :, None].expand(-1, -1, _BLOCK)).squeeze(1).double()
        cumulative = entries.cumsum(dim=-1)
        inside = _below(within.clamp(0, 1) * cumulative[:, -1:], cumulative[:, -1:])
        entry = torch.searchsorted(cumulative, inside, right=True).clamp_(max=_BLOCK - 1)
        return (block * _BLOCK + entry).squeeze(-1).clamp_(max=vocab - 1)


def _below(values: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """`values` capped at the largest float below `totals`."""

    return torch.minimum(values, torch.nextafter(totals, torch.zeros_like(totals)))
