"""Absorbing-state masked diffusion: time sampling, corruption and the ELBO loss.

Forward process (MDLM / SMDM / LLaDA): at time t in [eps, 1] every token is independently replaced
by the mask token with probability m(t) = 1 - α(t), where α is the noise schedule
(`dlm.diffusion.schedules`; linear, α(t) = 1 - t, by default). The reverse model predicts the clean token at
masked positions, and the negative ELBO per token of a sequence x of length L is

    NLL(x) <= E_{t ~ U[0, 1]} [ w(t) * sum over masked positions i of -log p(x_i | x_t) ] / L

with the schedule's weight w(t) = m'(t) / m(t) (1 / t for linear). The training loss is the
one-sample estimate of that expectation: cross-entropy at the masked positions, each weighted by its
sequence's w(t), summed and divided by B x L. Times are drawn from [eps, 1], not [0, 1], so the
weights are scaled by (1 - eps) / (1 - m(eps)): the loss then averages a masked token's expected
cross-entropy over the masking levels m in [m(eps), 1], as the ELBO averages it over [0, 1], and a
uniform model scores exactly log V in expectation whatever the schedule. For linear the factor is 1.

Two Monte Carlo estimators of that bound (`ESTIMATORS`, `elbo_nll`): `bernoulli` draws t and masks
each token independently with probability m(t), as training does; `exact-count` (LLaDA's evaluator)
draws a count l uniformly from {1, ..., L}, masks exactly l positions chosen uniformly at random
and weights their cross-entropy sum by L / l. Given l masked tokens the set is uniform either way,
and integrating the chance of l masked tokens times the weight 1 / m over the masking level gives
exactly 1 / l, so both estimate the same continuous-time bound (for any schedule; bernoulli's times
start at eps, which moves its expectation by O(eps)); exact-count spends no variance on the
binomial spread of the count or on the 1 / t weight of nearly clean sequences.

Noise must be reproducible whatever the number of processes: each micro-batch draws its times and
masks from a generator seeded by (seed, global micro-batch index), and the stratification offset
of an optimizer step from (seed, step); global RNG state is never touched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import get_args

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dlm.choices import ElboEstimator
from dlm.diffusion.schedules import LinearSchedule, Schedule

_SEED_DOMAIN = 0x646C6D  # "dlm": keeps our seeds apart from other SeedSequence users
_OFFSET_TAG = 0x6F6666  # "off": separates step offsets from micro-batch generators
_LINEAR = LinearSchedule()  # the default schedule, as in `[diffusion]`
ESTIMATORS: tuple[str, ...] = get_args(ElboEstimator)
Generators = torch.Generator | Sequence[torch.Generator] | None  # one for the batch, or one per row


@dataclass(frozen=True)
class Corruption:
    """One draw of the forward process for a batch."""

    noisy_tokens: Tensor  # [B, L] long: clean tokens with masked positions set to the mask id
    mask: Tensor  # [B, L] bool: True where the token was masked
    # The next three are [B] (one time per sequence) or, for a block model, [B, blocks] (per block).
    time: Tensor  # float32: each sequence's (block's) diffusion time t, clamped to [eps, 1]
    mask_probability: Tensor  # float32: m(t), the chance that each of its tokens was masked
    # float32: m'(t) x (1 - eps) / (1 - m(eps)); the loss weight is mask_rate / mask_probability,
    # kept as a quotient so that the linear schedule's weight stays an exact division by t.
    mask_rate: Tensor
    # [B, L] bool: the positions that may be masked and scored (instruction data: not the prompt);
    # None for plain text, where every position is.
    loss_mask: Tensor | None = None
    # Tokens per block of a block corruption (the model's block_size), 0 for the whole sequence. The
    # per-block tensors cannot say it: a row that is not a whole number of blocks ends in a short one.
    block_size: int = 0


@dataclass(frozen=True)
class DiffusionLoss:
    """The ELBO loss of one batch and its diagnostics; all tensors, so reading them needs no sync."""

    loss: Tensor  # 0-dim: negative ELBO estimate per token (nats), the training objective
    masked_accuracy: Tensor  # 0-dim: fraction of masked tokens whose argmax is the clean token
    masked_tokens: Tensor  # 0-dim long: number of masked positions N
    per_sequence_nll: Tensor  # [B]: each sequence's one-sample ELBO estimate per token
    per_block_nll: Tensor | None = None  # [B, blocks] per token of each block, for block corruptions


def corrupt_tokens(
    clean: Tensor,
    mask_token_id: int,
    times: Tensor,
    eps: float,
    generator: torch.Generator | None = None,
    *,
    schedule: Schedule = _LINEAR,
    block_size: int = 0,
    loss_mask: Tensor | None = None,
) -> Corruption:
    """Mask each token of sequence b independently with probability m(times[b]) of `schedule`.

    With a `block_size` shorter than the sequence, `times` is [B, blocks] (or [B], shared by a
    sequence's blocks) and each block is masked at its own time (block diffusion). A `loss_mask`
    ([B, L], instruction data) keeps its False positions (the prompt) clean; the draws are the same
    as without it, so the response positions see exactly the noise plain text would.
    """

    if loss_mask is not None:
        corruption = corrupt_tokens(
            clean, mask_token_id, times, eps, generator, schedule=schedule, block_size=block_size
        )
        allowed = loss_mask.to(device=clean.device, dtype=torch.bool)
        mask = corruption.mask & allowed
        return replace(corruption, noisy_tokens=clean.masked_fill(mask, mask_token_id), mask=mask, loss_mask=allowed)
    if 0 < block_size < clean.shape[1]:
        return _corrupt_blocks(clean, mask_token_id, times, eps, generator, schedule, block_size)
    batch = clean.shape[0]
    time = times.to(device=clean.device, dtype=torch.float32).expand(batch)
    # t -> 0 would make the loss weight explode for a nearly clean sequence.
    time = time.clamp(eps, 1.0)
    probability = schedule.mask_probability(time)
    draws = torch.rand(clean.shape, generator=generator, device=clean.device)
    mask = draws < probability[:, None]
    rate = schedule.mask_rate(time) * truncation_factor(schedule, eps)
    return Corruption(clean.masked_fill(mask, mask_token_id), mask, time, probability, rate)


def _corrupt_blocks(
    clean: Tensor,
    mask_token_id: int,
    times: Tensor,
    eps: float,
    generator: torch.Generator | None,
    schedule: Schedule,
    block_size: int,
) -> Corruption:
    batch, length = clean.shape
    blocks = -(-length // block_size)
    time = times.to(device=clean.device, dtype=torch.float32).reshape(batch, -1).expand(batch, blocks)
    if block_size == 1:
        # A block of one token is either masked or contributes nothing, and E_t[m'(t)] = 1: the
        # exact ELBO of a one-token block is its cross-entropy when masked, weight 1, no noise.
        ones = torch.ones_like(time)
        everything = torch.ones_like(clean, dtype=torch.bool)
        return Corruption(torch.full_like(clean, mask_token_id), everything, *(ones,) * 3, block_size=1)
    time = time.clamp(eps, 1.0)
    probability = schedule.mask_probability(time)
    draws = torch.rand(clean.shape, generator=generator, device=clean.device)
    mask = draws < probability.repeat_interleave(block_size, dim=1)[:, :length]
    rate = schedule.mask_rate(time) * truncation_factor(schedule, eps)
    return Corruption(clean.masked_fill(mask, mask_token_id), mask, time, probability, rate, block_size=block_size)


Batch = Tensor | tuple[Tensor, Tensor]  # token ids [B, L], or with instruction data (ids, loss mask)


def split_batch(batch: Tensor | Sequence[Tensor]) -> tuple[Tensor, Tensor | None]:
    """(tokens, loss mask or None) of a batch: instruction data comes as a (tokens, mask) pair."""

    if isinstance(batch, Tensor):
        return batch, None
    tokens, loss_mask = batch
    return tokens, loss_mask


def truncation_factor(schedule: Schedule, eps: float) -> float:
    """(1 - eps) / (1 - m(eps)): what makes times drawn from [eps, 1] weigh the levels [m(eps), 1]
    evenly, as the ELBO weighs [0, 1]. Exactly 1.0 for the linear schedule (m(eps) = eps)."""

    return (1.0 - eps) / (1.0 - schedule.mask_probability(eps))


def stratified_times(
    offset: float | Tensor, slot_indices: Tensor, total_slots: int, eps: float, high: float = 1.0
) -> Tensor:
    """Times eps + (high - eps) * ((offset + slot / total_slots) mod 1) for the given slots.

    The total_slots times of one offset form an evenly spaced grid over [eps, high] shifted by the
    random offset: each has the uniform marginal the ELBO needs, yet together they cover every
    noise level, which lowers the variance of the step's gradient (antithetic sampling). `high`
    below 1 (with eps raised) is the clipped range of `training.clip_mask_min / clip_mask_max`.
    """

    unit = (offset + slot_indices.to(torch.float32) / total_slots) % 1.0
    return eps + (high - eps) * unit


def accumulation_mask_probabilities(
    batch_size: int,
    micro_batch_index: int,
    gradient_accumulation_steps: int,
    offset: float | Tensor,
    eps: float,
    device: torch.device | str,
    rank: int = 0,
    world_size: int = 1,
    blocks: int = 1,
    high: float = 1.0,
) -> Tensor:
    """The [batch_size] times of one micro-batch, stratified over a whole optimizer step.

    An optimizer step has batch_size x gradient_accumulation_steps x world_size slots; rank r's
    micro-batch m takes the batch_size consecutive slots starting at (m x world_size + r) x
    batch_size. So 2 ranks with accumulation A see exactly the times of 1 rank with 2A.

    With `blocks` > 1 (block diffusion) the times are [batch_size, blocks]: every block has a slot,
    block j of sequence slot s taking slot j x S + s of S x blocks, so each sequence's blocks
    spread over the whole noise range.
    """

    if not 0 <= micro_batch_index < gradient_accumulation_steps:
        raise ValueError(f"micro_batch_index {micro_batch_index} outside [0, {gradient_accumulation_steps})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    total_slots = batch_size * gradient_accumulation_steps * world_size
    start = (micro_batch_index * world_size + rank) * batch_size
    slots = torch.arange(start, start + batch_size, device=device)
    if blocks > 1:
        slots = slots[:, None] + total_slots * torch.arange(blocks, device=device)
        total_slots *= blocks
    return stratified_times(offset, slots, total_slots, eps, high)


def noise_seed(seed: int, *indices: int) -> int:
    """A 63-bit seed mixed from (seed, *indices), identical on every run, machine and version.

    Each value is split into two 32-bit words and the count goes first, because SeedSequence
    alone treats (s, 0) like (s,) and a 64-bit seed like two small indices.
    """

    values = (seed, *indices)
    if any(not 0 <= value < 2**64 for value in values):
        raise ValueError(f"seed and indices must lie in [0, 2**64), got {values}")
    words = [_SEED_DOMAIN, len(values)]
    for value in values:
        words += [value & 0xFFFFFFFF, value >> 32]
    low, high = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    return (int(high) << 32 | int(low)) & (2**63 - 1)


def noise_generator(seed: int, index: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` whose stream depends only on (seed, global micro-batch index)."""

    generator = torch.Generator(device=device)
    generator.manual_seed(noise_seed(seed, index))
    return generator


def step_time_offset(seed: int, step: int) -> float:
    """The stratification offset in [0, 1) of optimizer step `step`."""

    # 53 bits fill a double's mantissa exactly, so the result can never round up to 1.0.
    return (noise_seed(seed, step, _OFFSET_TAG) >> 10) / 2.0**53


TokenLosses = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def masked_token_losses(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Cross-entropy [N] (float32) of each row of logits [N, V], and whether its argmax is the target.

    Cross-entropy runs in float32 even under autocast: bf16 log-probabilities of an 8K+ vocabulary
    are too coarse for a loss that is then summed. Compiled, this is one pass over bf16 logits that
    never writes a float32 copy of them (the largest tensor of a small model's step).
    """

    ce = F.cross_entropy(logits.float(), targets, reduction="none")
    return ce, logits.argmax(dim=-1) == targets


def diffusion_cross_entropy(
    logits: Tensor, clean: Tensor, corruption: Corruption, token_losses: TokenLosses = masked_token_losses
) -> DiffusionLoss:
    """The MDLM / SMDM ELBO loss from logits [N, V] at the N masked positions (row-major order).

    loss = sum_i CE_i x w_b(i) / (B x L) with the weight w = mask_rate / mask_probability of the
    corruption (1 / t for linear); `token_losses` gives CE_i (a compiled copy in training). With a
    loss mask (instruction data) each sequence's sum is divided by its own number of loss tokens
    and the loss is the mean over sequences, as in LLaDA's fine-tuning (`dlm eval` weights each
    sequence by its loss tokens instead: total NLL over total tokens); without a loss mask both
    rules give the same number, and the B x L division is kept.
    """

    batch, length = clean.shape
    mask, count = corruption.mask, logits.shape[0]
    # clean[mask] would wait for the GPU to finish the forward pass (its size lives on the device);
    # N is already known from the logits, so targets and rows are gathered without a host sync.
    flat_mask = mask.flatten()
    slot = torch.where(flat_mask, flat_mask.cumsum(0) - 1, count)  # unmasked tokens -> spare slot N
    targets = clean.new_empty(count + 1).scatter_(0, slot, clean.flatten())[:count]
    masked_per_sequence = mask.sum(dim=1)
    rows = torch.repeat_interleave(torch.arange(batch, device=clean.device), masked_per_sequence, output_size=count)
    ce, hits = token_losses(logits, targets)  # [N] each
    rate, probability = corruption.mask_rate, corruption.mask_probability
    blocks, block_size = (rate.shape[1] if rate.dim() == 2 else 0), corruption.block_size
    if blocks:  # each token takes its block's weight, gathered as the targets were
        _check_blocks(blocks, block_size, length)
        rate, probability = (_per_masked_token(value, block_size, length, slot, count) for value in (rate, probability))
    else:
        rate, probability = rate[rows], probability[rows]
    weighted = ce * rate / probability
    per_token = torch.zeros_like(clean, dtype=torch.float32).masked_scatter(mask, weighted)
    if corruption.loss_mask is None:
        loss = weighted.sum() / (batch * length)
        per_sequence = per_token.sum(dim=1) / length
    else:
        per_sequence = per_token.sum(dim=1) / corruption.loss_mask.sum(dim=1).clamp(min=1)
        loss = per_sequence.mean()
    per_block = None
    if blocks:
        padded = F.pad(per_token, (0, blocks * block_size - length))
        sizes = torch.full((blocks,), block_size, device=clean.device)
        sizes[-1] = length - (blocks - 1) * block_size  # a row that is not whole blocks ends in a short one
        per_block = padded.view(batch, blocks, block_size).sum(dim=2) / sizes
    masked_tokens = masked_per_sequence.sum()
    accuracy = hits.sum().float() / masked_tokens.clamp(min=1).float()
    return DiffusionLoss(loss, accuracy, masked_tokens, per_sequence, per_block)


def _check_blocks(blocks: int, block_size: int, length: int) -> None:
    """Refuse per-block weights whose block size is unknown or does not tile the row into `blocks`."""

    if block_size < 1 or -(-length // block_size) != blocks:
        raise ValueError(
            f"{blocks} per-block weights for {length} tokens need the corruption's block_size (got {block_size})"
        )


def _per_masked_token(per_block: Tensor, block_size: int, length: int, slot: Tensor, count: int) -> Tensor:
    """The value of each masked token's block, [N] in row-major order of the masked positions."""

    per_position = per_block.repeat_interleave(block_size, dim=1)[:, :length].flatten()
    return per_position.new_empty(count + 1).scatter_(0, slot, per_position)[:count]


def corrupt_exact_count(
    clean: Tensor,
    mask_token_id: int,
    units: Tensor,
    keys: Tensor,
    *,
    block_size: int = 0,
    loss_mask: Tensor | None = None,
) -> Corruption:
    """Mask exactly l of the n maskable positions of each sequence (each block), weight n / l.

    `units` ([B], or [B, blocks] with a `block_size` shorter than the sequence) in [0, 1) give
    l = floor(units x n) + 1, uniform on {1, ..., n} for uniform units; `keys` [B, L] (uniform in
    [0, 1)) choose which l: the positions of the l smallest keys, a uniformly random l-subset. n
    counts the positions that `loss_mask` allows (all without one); a block without any masks
    nothing. `mask_probability` is l / n and `mask_rate` 1, so `diffusion_cross_entropy` weights
    each masked token by n / l.
    """

    batch, length = clean.shape
    size = block_size if 0 < block_size < length else length
    blocks = -(-length // size)
    allowed = torch.ones_like(clean, dtype=torch.bool) if loss_mask is None else loss_mask.to(clean.device, torch.bool)
    pad = blocks * size - length
    allowed_blocks = F.pad(allowed, (0, pad)).view(batch, blocks, size)
    maskable = allowed_blocks.sum(dim=2)  # [B, blocks]
    units = units.to(device=clean.device, dtype=torch.float32).reshape(batch, -1).expand(batch, blocks)
    # The clamp keeps a unit that rounds up to 1.0 in float32 at l = n.
    count = (units * maskable).floor().long().minimum((maskable - 1).clamp(min=0)) + 1
    # Positions that may not be masked rank last; ties between keys break by position.
    ranked = F.pad(keys.to(clean.device).masked_fill(~allowed, 2.0), (0, pad), value=2.0).view(batch, blocks, size)
    ranks = ranked.argsort(dim=2).argsort(dim=2)
    mask = ((ranks < count[..., None]) & allowed_blocks).view(batch, -1)[:, :length]
    probability = count.float() / maskable.clamp(min=1).float()
    if blocks == 1 and not 0 < block_size < length:
        probability = probability[:, 0]
    return Corruption(
        clean.masked_fill(mask, mask_token_id),
        mask,
        time=probability,
        mask_probability=probability,
        mask_rate=torch.ones_like(probability),
        loss_mask=None if loss_mask is None else allowed,
        block_size=size if blocks > 1 else 0,
    )


def draw_exact_count(
    clean: Tensor,
    mask_token_id: int,
    units: Tensor,
    generators: Generators,
    *,
    block_size: int = 0,
    loss_mask: Tensor | None = None,
) -> Corruption:
    """`corrupt_exact_count` with its keys drawn from `generators` (one, or one per row): the one
    exact-count draw of training (`training.masking`) and of the ELBO estimate (`elbo_nll`)."""

    keys = _uniform(generators, clean.shape[0], (clean.shape[1],), clean.device)
    return corrupt_exact_count(clean, mask_token_id, units, keys, block_size=block_size, loss_mask=loss_mask)


def _uniform(generators: Generators, batch: int, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Uniform draws [batch, *shape]: row r from generators[r] when there is one per row."""

    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand((batch, *shape), generator=generators, device=device)
    if len(generators) != batch:
        raise ValueError(f"{len(generators)} generators for {batch} sequences")
    return torch.stack([torch.rand(shape, generator=generator, device=device) for generator in generators])


def _corrupt_rows(
    clean: Tensor,
    mask_token_id: int,
    times: Tensor,
    eps: float,
    generators: Sequence[torch.Generator],
    schedule: Schedule,
    block_size: int,
    loss_mask: Tensor | None,
) -> Corruption:
    """`corrupt_tokens` with row r's draws from generators[r]."""

    if len(generators) != clean.shape[0]:
        raise ValueError(f"{len(generators)} generators for {clean.shape[0]} sequences")
    rows = [
        corrupt_tokens(
            clean[r : r + 1],
            mask_token_id,
            times[r : r + 1],
            eps,
            generator,
            schedule=schedule,
            block_size=block_size,
            loss_mask=None if loss_mask is None else loss_mask[r : r + 1],
        )
        for r, generator in enumerate(generators)
    ]

    def joined(name: str) -> Tensor:
        return torch.cat([getattr(row, name) for row in rows])

    noisy, mask, time, probability, rate = map(
        joined, ("noisy_tokens", "mask", "time", "mask_probability", "mask_rate")
    )
    return Corruption(
        noisy, mask, time, probability, rate, None if loss_mask is None else joined("loss_mask"), rows[0].block_size
    )


@torch.no_grad()
def elbo_nll(
    logits_fn: Callable[[Tensor, Tensor], Tensor],
    clean: Tensor,
    mask_token_id: int,
    num_samples: int,
    eps: float,
    generator: Generators = None,
    *,
    schedule: Schedule = _LINEAR,
    block_size: int = 0,
    loss_mask: Tensor | None = None,
    estimator: str = "bernoulli",
) -> tuple[Tensor, Tensor]:
    """Monte Carlo negative ELBO per token of each sequence, and its standard error, both [B].

    `logits_fn(noisy_tokens, mask)` returns logits at the masked positions ([N, V]). Each sequence
    (each block, with a `block_size` shorter than the sequence) gets one random offset u0 and the K
    antithetic units (u0 + k / K) mod 1. `bernoulli` maps them to the times eps + (1 - eps) x unit,
    which `schedule` turns into mask probabilities and weights; `exact-count` maps them to the
    counts l of `corrupt_exact_count` (it needs neither eps nor the schedule). With a `loss_mask` it
    is the conditional ELBO of the loss positions (a response given its prompt) per loss token.

    `generator` may be one per row: each sequence's estimate then depends on its own generator
    alone, not on the batch it was scored in.
    """

    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    batch, length = clean.shape
    shape = (-(-length // block_size),) if 0 < block_size < length else ()
    shared: torch.Generator | None = None
    per_row: Sequence[torch.Generator] | None = None
    if generator is None or isinstance(generator, torch.Generator):
        shared = generator
    else:
        per_row = generator
    offsets = _uniform(generator, batch, shape, clean.device)
    # Blocks of one token (an autoregressive model) are always masked with weight 1 (`_corrupt_blocks`):
    # every sample is the exact likelihood, so one pass gives all of them, with no Monte Carlo error.
    exact = block_size == 1 and length > 1
    samples = []
    for k in range(1 if exact else num_samples):
        if estimator == "exact-count":
            units = stratified_times(offsets, torch.full_like(offsets, k), num_samples, 0.0)
            corruption = draw_exact_count(
                clean, mask_token_id, units, generator, block_size=block_size, loss_mask=loss_mask
            )
        else:
            times = stratified_times(offsets, torch.full_like(offsets, k), num_samples, eps)
            if per_row is not None:
                corruption = _corrupt_rows(clean, mask_token_id, times, eps, per_row, schedule, block_size, loss_mask)
            else:
                corruption = corrupt_tokens(
                    clean,
                    mask_token_id,
                    times,
                    eps,
                    shared,
                    schedule=schedule,
                    block_size=block_size,
                    loss_mask=loss_mask,
                )
        logits = logits_fn(corruption.noisy_tokens, corruption.mask)
        samples.append(diffusion_cross_entropy(logits, clean, corruption).per_sequence_nll)
    if num_samples == 1:
        return samples[0], torch.full_like(samples[0], float("nan"))
    if exact:
        return samples[0], torch.zeros_like(samples[0])
    stacked = torch.stack(samples)  # [K, B]
    # Standard error as if the K samples were independent. Antithetic (evenly spread) units are
    # negatively correlated, so the true error of the mean is smaller: this bound is conservative.
    return stacked.mean(dim=0), stacked.std(dim=0) / num_samples**0.5
