"""Generation by reversing the masking process of a masked diffusion language model.

A sequence starts as the prompt followed by `length` mask tokens. Time runs from t = 1 (all
generated positions masked) to t = 0 over `steps` equal steps; each step predicts the masked
positions and reveals ("commits") some of them. A revealed token never changes. How many depends on
the noise schedule the model was trained with (`dlm.diffusion.schedules`; m(t) = t for the default linear one).

Which masked positions are revealed at a step from t to s = t - 1/steps:

- `random`: ancestral sampling of the true reverse process; every masked position is revealed
  independently with the schedule's reveal probability (m(t) - m(s)) / m(t), which is 1 at the
  last step ((t - s) / t for linear).
- `confidence`: LLaDA's low-confidence remasking; the model's distribution is sampled at every
  masked position and the k most probable samples are kept, the rest stay masked. k follows the
  schedule: floor(n * m(s)) of a block's n positions stay masked at time s, none after the last step
  (`reveal_split="schedule"`, the default). `reveal_split="even"` is LLaDA's own split
  (`get_num_transfer_tokens`): n // steps each, the first n % steps steps one more, whatever the
  schedule. For 6 positions in 4 steps the schedule reveals 2, 1, 2, 1 and the even split 2, 2, 1, 1.
- `margin`: as `confidence`, but a position's confidence is top-1 minus top-2 probability.

`block_length` B makes the sampler semi-autoregressive: the positions to generate are split, left
to right, into blocks of B; each block runs its share of the steps and later blocks stay masked
until the earlier ones are complete.

Infilling templates (`text=`): `[MASK]` is one token to generate and `[MASK*N]` is N of them;
everything else is fixed text, kept token for token. Example: "ROMEO: [MASK*20] fair Verona".

A step that reveals nothing does not call the model: the revealed tokens would be the same for any
prediction, so its forward pass is skipped (MDLM's cached sampler gets the same saving by reusing
predictions while the noisy sequence is unchanged). `SampleResult.forward_passes` counts the calls.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dlm.choices import RevealSplit
from dlm.diffusion.reveal_order import dilated_order
from dlm.diffusion.schedules import LinearSchedule, Schedule
from dlm.errors import UserError
from dlm.sampling.options import SamplingOptions, StepCallback
from dlm.sampling.remasking import ANCESTRAL, DILATED, token_confidence
from dlm.sampling.row_noise import RowNoise
from dlm.sampling.tokens import draws_per_row, sample_tokens, sample_with_probabilities

if TYPE_CHECKING:
    from dlm.model.attention import KVCache
    from dlm.model.denoiser import Denoiser

_LINEAR = LinearSchedule()  # the default schedule, as in `[diffusion]`


@dataclass(frozen=True)
class Reverse:
    """What every step of one reverse process shares."""

    model: Denoiser
    options: SamplingOptions
    noise: RowNoise
    mask_id: int
    forbidden: torch.Tensor  # token ids never predicted (mask first), on the noise device
    pad: torch.Tensor | None = field(default=None, kw_only=True)  # leading padding per row of a batch of prompts
    # Whether the rows were seen all distinct: a revealed token stays, so they never repeat again and
    # `forward` stops looking (a read from the device) from there.
    apart: list[bool] = field(default_factory=lambda: [False], init=False, repr=False, compare=False)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """The model on `tokens` of the batch rows `rows` (None: all), with their padding if any. Rows that
        repeat each other (the samples of one prompt before a step writes their tokens: a few-step
        sampler's first step is a whole pass of them) go through the model once."""

        if cache is None and tokens.shape[0] > 1 and not self.apart[0]:
            shared = self._shared(tokens, positions, rows)
            if shared is not None:
                return shared
        return self._forward(tokens, positions, rows, cache)

    def _shared(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The logits of a step whose rows repeat each other (the same tokens and padding): each distinct row
        once through the model, scored at every position any of its copies asks for, and each row's own
        positions gathered from it; None where every row is distinct, and from then on (`apart`)."""

        device, count = tokens.device, tokens.shape[0]
        batch_rows = torch.arange(count, device=device) if rows is None else rows.nonzero()[:, 0]
        key = tokens if self.pad is None else torch.cat((tokens, self.pad[batch_rows][:, None]), dim=1)
        distinct, copy_of = torch.unique(key, dim=0, return_inverse=True)
        if len(distinct) == count:
            self.apart[0] = True
            return None
        first = torch.full((len(distinct),), count, device=device).scatter_reduce_(
            0, copy_of, torch.arange(count, device=device), "amin"
        )  # each distinct row's first copy
        asked = torch.zeros(len(distinct), tokens.shape[1], dtype=torch.long, device=device)
        asked = asked.index_add_(0, copy_of, positions.long()) > 0
        logits = self._forward(tokens[first], asked, batch_rows[first], None)  # row-major over `asked`
        counts = asked.sum(dim=1)
        order = asked.cumsum(dim=1) - 1 + (counts.cumsum(dim=0) - counts)[:, None]  # each position's logits row
        return logits[order[copy_of][positions]]

    def _forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None, cache: KVCache | None
    ) -> torch.Tensor:
        if self.pad is None:
            if cache is None:
                return self.model(tokens, output_positions=positions)
            return self.model(tokens, output_positions=positions, cache=cache)
        pad = self.pad if rows is None else self.pad[rows]
        return self.model(tokens, output_positions=positions, cache=cache, pad=pad)

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The model's logits at `positions` of `tokens`, the batch rows `rows` (None: all) of the sequence."""

        return self.forward(tokens, positions, rows)

    def uniform(self, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | None:
        """Draws for `sample_tokens` at `positions` [R, L] of the rows `rows`, each row from its stream."""

        if self.options.temperature == 0:
            return None
        counts = positions.sum(dim=1)
        if rows is not None:
            counts = torch.zeros(rows.shape, dtype=counts.dtype, device=counts.device).masked_scatter(rows, counts)
        return self.noise.stacked(counts, draws_per_row(self.options.top_p))

    def scores(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The logits at `positions` as the draw takes them (`scored`)."""

        return scored(self.logits(tokens, positions, rows), self.noise.device, self.forbidden)

    def predict(
        self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sampled tokens [N] (and their confidences, when remasking needs them) at `positions`."""

        logits = self.scores(tokens, positions, rows)
        uniform = self.uniform(positions, rows)
        if self.options.remasking in (ANCESTRAL, DILATED):  # no ranking: the model's distribution is not needed
            new, _ = self.draw(logits, uniform, probabilities=False)
            return new.to(tokens.device), None
        # The model's own (untempered, unfiltered) probabilities rank the samples, as in LLaDA.
        new, probabilities = self.draw(logits, uniform, probabilities=True)
        assert probabilities is not None
        return new.to(tokens.device), token_confidence(probabilities, new, self.options.remasking)

    def draw(
        self, logits: torch.Tensor, uniform: torch.Tensor | None, *, probabilities: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row of `logits` with this process's options (`sample_tokens`), and with
        `probabilities` the model's own distribution (`sample_with_probabilities`), made in `logits`,
        which this uses up (`scores` made them for this step alone). A served request's
        model stand-in draws them in one batch with the other requests' draws (`draw_tokens`): the same
        tokens."""

        options = self.options
        keywords: dict[str, Any] = {
            "temperature": options.temperature,
            "top_k": options.top_k,
            "top_p": options.top_p,
            "uniform": uniform,
        }
        shared = getattr(self.model, "draw_tokens", None)
        if shared is not None:
            drawn: tuple[torch.Tensor, torch.Tensor | None] = shared(logits, probabilities=probabilities, **keywords)
            return drawn
        # `logits` are this step's own buffer (`scores`): the draw may make its weights in it.
        if probabilities:
            return sample_with_probabilities(logits, overwrite=True, **keywords)
        return sample_tokens(logits, overwrite=True, **keywords), None

    def reveal_random(self, tokens: torch.Tensor, block: torch.Tensor, odds: float) -> int:
        """Ancestral step: reveal each masked position of `block` with probability 1 / `odds` (`step_odds`)."""

        masked = tokens[:, block] == self.mask_id
        draws = self.noise.per_row(tuple(masked.shape))
        reveal = masked & (draws * odds < 1).to(tokens.device)
        return self.reveal(tokens, block, reveal)

    def reveal_planned(self, tokens: torch.Tensor, block: torch.Tensor, chosen: torch.Tensor) -> int:
        """Planned step: reveal the masked positions among `block[chosen]` (`dilated` remasking)."""

        reveal = torch.zeros(tokens.shape[0], block.numel(), dtype=torch.bool, device=tokens.device)
        reveal[:, chosen.to(tokens.device)] = True
        return self.reveal(tokens, block, reveal & (tokens[:, block] == self.mask_id))

    def reveal(self, tokens: torch.Tensor, block: torch.Tensor, reveal: torch.Tensor) -> int:
        """Write a sampled token at each position of `block` that `reveal` [B, len(block)] marks."""

        rows = reveal.any(dim=1)
        revealing = int(rows.sum())  # one read from the device for both cases below
        if revealing == 0:
            return 0
        positions = torch.zeros_like(tokens, dtype=torch.bool)
        positions[:, block] = reveal
        if revealing == rows.numel():  # every row (a served request's one row, often): no sub-batch to cut out
            new, _ = self.predict(tokens, positions)
            tokens[positions] = new
            return 1
        # Only rows that reveal something need a prediction, and only at the revealed positions.
        sub_tokens, sub_positions = tokens[rows], positions[rows]
        new, _ = self.predict(sub_tokens, sub_positions, rows)
        sub_tokens[sub_positions] = new
        tokens[rows] = sub_tokens
        return 1

    def reveal_confident(self, tokens: torch.Tensor, block: torch.Tensor, count: int) -> int:
        """Remasking step: sample all masked positions of `block`, keep the `count` most confident."""

        if count == 0:
            return 0
        candidates = torch.zeros_like(tokens, dtype=torch.bool)
        candidates[:, block] = tokens[:, block] == self.mask_id
        new, confidence = self.predict(tokens, candidates)
        assert confidence is not None
        chosen = most_confident(confidence, candidates, count).to(tokens.device)
        tokens[chosen] = new[chosen[candidates]]
        return 1


def steps_per_block(steps: int, num_blocks: int) -> list[int]:
    """Split `steps` across blocks as evenly as possible, earlier blocks taking the remainder."""

    return [steps // num_blocks + (index < steps % num_blocks) for index in range(num_blocks)]


def step_times(steps: int, step: int) -> tuple[Fraction, Fraction]:
    """The times (t, s) that step `step` (0-based) of `steps` runs between, exactly: t = 1 - step / steps."""

    return Fraction(steps - step, steps), Fraction(steps - step - 1, steps)


def reveal_count(
    num_positions: int, steps: int, step: int, schedule: Schedule = _LINEAR, split: RevealSplit = "schedule"
) -> int:
    """Positions to reveal at `step` (0-based): so that floor(n * m(s)) stay masked at time s, or by
    the `even` split n // steps, one more in each of the first n % steps steps (LLaDA)."""

    if split == "even":
        return num_positions // steps + (step < num_positions % steps)
    t, s = step_times(steps, step)
    return schedule.masked_count(num_positions, t) - schedule.masked_count(num_positions, s)


def masked_after(
    num_positions: int, steps: int, step: int, schedule: Schedule = _LINEAR, split: RevealSplit = "schedule"
) -> int:
    """Positions of `num_positions` still masked after `step` (0-based) when every step reveals its `reveal_count`."""

    if split == "even":
        done = step + 1
        return num_positions - done * (num_positions // steps) - min(done, num_positions % steps)
    return schedule.masked_count(num_positions, step_times(steps, step)[1])


def reveal_threshold(reverse: Reverse, tokens: Tensor, block: Tensor, keep_masked: int) -> int:
    """Commit the masked positions of `block` above the threshold: at least one, and at least
    enough that no more than `keep_masked` stay masked. Forward passes made (0 or 1)."""

    masked = tokens[:, block] == reverse.mask_id
    if not bool(masked.any()):
        return 0
    candidates = torch.zeros_like(tokens, dtype=torch.bool)
    candidates[:, block] = masked
    logits = reverse.scores(tokens, candidates, None)
    options = reverse.options
    new, probabilities = reverse.draw(logits, reverse.uniform(candidates, None), probabilities=True)
    assert probabilities is not None and options.threshold is not None
    confidence = token_confidence(probabilities, new, threshold_ranking(options.remasking))
    commit = threshold_commits(confidence, masked, keep_masked, options.threshold).to(tokens.device)
    proposal = tokens[:, block].clone()
    proposal[masked] = new.to(tokens.device)
    tokens[:, block] = torch.where(commit, proposal, tokens[:, block])
    return 1


def threshold_ranking(remasking: str) -> str:
    """What a threshold step ranks its candidates by: the probability of the token each position would
    commit (Fast-dLLM's rule, and what `confidence` remasking ranks by), not the top-1 probability (at
    temperature > 0 the sample is often another token); a ranked order (`margin`) keeps its own score."""

    return "confidence" if remasking in (ANCESTRAL, DILATED) else remasking


def _scores(confidence: Tensor, candidates: Tensor) -> Tensor:
    """`confidence` [N] at the `candidates` [R, L] (row-major), -inf elsewhere."""

    scores = torch.full(candidates.shape, float("-inf"), dtype=confidence.dtype, device=confidence.device)
    scores[candidates.to(scores.device)] = confidence
    return scores


def most_confident(confidence: Tensor, candidates: Tensor, count: int) -> Tensor:
    """The `count` candidates of each row [R, L] with the highest `confidence` (a remasking step's reveals);
    every row holds at least `count` candidates, so top-k picks only candidates."""

    scores = _scores(confidence, candidates)
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    return chosen.scatter_(1, scores.topk(count, dim=1).indices, True)


def threshold_commits(confidence: Tensor, masked: Tensor, keep_masked: int, threshold: float) -> Tensor:
    """The candidates `masked` [R, L] a threshold step commits: those above `threshold`, and enough of the
    most confident that at most `keep_masked` stay masked, at least one a row."""

    scores = _scores(confidence, masked)
    need = (masked.sum(dim=1) - keep_masked).clamp_min(1).to(scores.device)
    rank = scores.argsort(dim=1, descending=True).argsort(dim=1)
    return ((scores > threshold) | (rank < need[:, None])) & masked.to(scores.device)


def reverse_step(reverse: Reverse, tokens: Tensor, block: Tensor, steps: int, index: int, schedule: Schedule) -> int:
    """Step `index` (0-based) of `steps` on the positions `block`, in place: the threshold's commits when
    the options set one, else random (ancestral) or confidence-ordered reveals of the split's count.
    Every strategy runs its steps through here. Forward passes made (0 or 1)."""

    options, size, split = reverse.options, block.numel(), reverse.options.reveal_split
    if options.threshold is not None:
        return reveal_threshold(reverse, tokens, block, masked_after(size, steps, index, schedule, split))
    if options.remasking == ANCESTRAL:
        return reverse.reveal_random(tokens, block, step_odds(schedule, steps, index))
    if options.remasking == DILATED:
        return reverse.reveal_planned(tokens, block, planned_positions(size, steps, index, schedule, split))
    return reverse.reveal_confident(tokens, block, reveal_count(size, steps, index, schedule, split))


@functools.lru_cache(maxsize=4096)
def step_odds(schedule: Schedule, steps: int, index: int) -> float:
    """1 / p for the reveal probability p of ancestral step `index` (0-based) of `steps`: a masked position is
    revealed where its uniform draw x (1 / p) < 1. The linear schedule's exact 1 / p is the number of steps
    left, so its draws compare exactly as they always have. Computed once per step: the exact fractions
    cost more than a step's own bookkeeping (schedules are stateless: they hash by their type)."""

    t, s = step_times(steps, index)
    probability = schedule.reveal_probability(s, t)
    return float(1 / probability) if probability > 0 else math.inf


def planned_positions(size: int, steps: int, index: int, schedule: Schedule, split: RevealSplit) -> Tensor:
    """The positions of a block of `size` that step `index` (0-based) of `steps` reveals in the dilated
    order: the next `reveal_count` of its planned ranks."""

    before = size if index == 0 else masked_after(size, steps, index - 1, schedule, split)
    after = masked_after(size, steps, index, schedule, split)
    return dilated_order(size)[size - before : size - after]


def never_predicted(mask_id: int, forbidden_token_ids: Sequence[int], device: torch.device) -> Tensor:
    """The token ids a reverse process never writes (`Reverse.forbidden`): the mask first, then the rest."""

    return torch.tensor([mask_id, *(t for t in forbidden_token_ids if t != mask_id)], device=device)


def scored(logits: Tensor, device: torch.device, forbidden: Tensor) -> Tensor:
    """`logits` as a sampler draws from them: on the noise `device`, the `forbidden` tokens
    (`never_predicted`) -inf. A 16-bit model's stay 16-bit: the draw widens them to float32 a few
    rows at a time (`dlm.sampling.tokens`), which is cheaper than a float32 copy of them all."""

    logits = logits.to(device)
    logits[:, forbidden] = float("-inf")
    return logits


def cut_after_stop(token_ids: list[list[int]], fill: Sequence[bool], stop_token_id: int) -> list[list[int]]:
    """Each row up to and including the first `stop_token_id` at a generated position."""

    cut = []
    for row in token_ids:
        end = next((i + 1 for i, (t, f) in enumerate(zip(row, fill, strict=True)) if f and t == stop_token_id), None)
        cut.append(row if end is None else row[:end])
    return cut


# ---------------------------------------------------------------------------------------------
# Strategies: the ways to run a whole reverse process, one of which `dlm.sampling.dispatch.denoise` picks


@dataclass(frozen=True)
class ReverseContext:
    """What `dlm.sampling.dispatch.denoise` hands a strategy besides the model, tokens and options."""

    noise: RowNoise  # the random streams, one per group of rows
    schedule: Schedule
    forbidden_token_ids: Sequence[int] = ()  # never predicted (nor is the mask token)
    on_step: StepCallback | None = None
    stop_token_id: int | None = None  # end generation once every row has it (strategies that can)
    pad: Tensor | None = None  # leading padding positions per row (a batch of prompts)

    def keywords(self) -> dict[str, Any]:
        """The keyword arguments `denoise_fast` and `denoise_blocks` take besides their generator."""

        return {
            "schedule": self.schedule,
            "forbidden_token_ids": self.forbidden_token_ids,
            "on_step": self.on_step,
            "stop_token_id": self.stop_token_id,
            "pad": self.pad,
        }


# Run the reverse process on `tokens` [B, L] where `fill_mask` [L] is true: the completed tokens and
# the number of model forward passes (the contract of `dlm.sampling.dispatch.denoise`).
RunReverse = Callable[["Denoiser", Tensor, Tensor, SamplingOptions, ReverseContext], tuple[Tensor, int]]


@dataclass(frozen=True)
class Strategy:
    """One sampler: `run` is used for a model, its options and its stop token when `applies` says so."""

    name: str
    applies: Callable[[Denoiser, SamplingOptions, int | None], bool]
    run: RunReverse


def sequence_blocks(
    tokens: Tensor, fill_mask: Tensor, options: SamplingOptions, mask_id: int
) -> tuple[Tensor, list[Tensor]]:
    """A whole-sequence sampler's start: a copy of `tokens` masked where `fill_mask` is, and the
    positions of each `block_length` block (one block without it); refused with fewer steps than blocks."""

    tokens = tokens.clone()
    tokens[:, fill_mask] = mask_id
    positions = fill_mask.nonzero().squeeze(-1)
    blocks = list(positions.split(options.block_length)) if options.block_length else [positions]
    if len(blocks) > options.steps:
        raise UserError(
            f"--steps ({options.steps}) is fewer than the {len(blocks)} blocks of --block-length "
            f"{options.block_length}",
            fix=f"use at least {len(blocks)} steps or a larger --block-length",
        )
    return tokens, blocks
