"""Distillation through time (SDTT): the target a few-step student learns, from a teacher's two steps.

The reverse process samples from time t to s = t - h: every position masked at t is revealed with
probability (m(t) - m(s)) / m(t), its token drawn from the model's prediction p(x | z_t). A student
that takes one step of 2h should predict what its teacher knows after two steps of h, t -> u = t - h
-> s = t - 2h (Deschenaux & Gulcehre, 2024). The teacher's first step predicts p1 = p(x | z_t) and
reveals some positions, writing z_u; its second step predicts p2 = p(x | z_u). At a position i
masked at t the target is the teacher's prediction from the step that revealed i: p1_i if the first
step revealed it, else p2_i (the second step's prediction, whether or not that step reveals i).

Its expectation, T_i = a p1_i + (1 - a) E[p2_i | i still masked at u] with a the first step's reveal
probability, is the teacher's belief about x_i after two steps; `tests/test_distill.py` checks it
against an enumeration of the whole two-step process on a tiny vocabulary. The target itself is a
draw, and only the forward KL is linear in it (its student learns T itself); the reverse KL, SDTT's
choice, pulls the student toward a geometric mean of the draws instead (docs/distill.md has what
each did on the demo's model).

`certainty_forcing_loss` is the second method's objective: no teacher pass, the data's tokens as
targets and an entropy term that makes a threshold sampler commit more per pass (dParallel).

This module is the arithmetic; `dlm.distill` runs the teacher and the student.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

from dlm.diffusion.reveal_order import dilated_order
from dlm.diffusion.schedules import Schedule

_MODEL_ATTRIBUTE = "distilled_steps"  # where a loaded student keeps the sampling steps it was distilled for
_ORDER_ATTRIBUTE = "distilled_remasking"  # and the reveal order


def attach_distilled_steps(model: object, steps: int, remasking: str = "random") -> None:
    """Record on a loaded student the steps and reveal order it was distilled for; sampling defaults to them."""

    setattr(model, _MODEL_ATTRIBUTE, steps)
    setattr(model, _ORDER_ATTRIBUTE, remasking)


def distilled_remasking(model: object) -> str | None:
    """The reveal order `attach_distilled_steps` recorded on `model`; None for a model that is no student."""

    found = getattr(model, _ORDER_ATTRIBUTE, None)
    return found if isinstance(found, str) else None


def distilled_steps(model: object) -> int | None:
    """The steps `attach_distilled_steps` recorded on `model`; None for a model that is no student."""

    found = getattr(model, _MODEL_ATTRIBUTE, None)
    return found if isinstance(found, int) and found > 0 else None


@dataclass(frozen=True)
class TwoStepTimes:
    """The times of one student step (t -> s) and of the teacher's two steps (t -> u -> s), per row
    (or per block of a block model): [B] or [B, blocks], float64."""

    t: Tensor
    u: Tensor
    s: Tensor

    def first_reveal_probability(self, schedule: Schedule) -> Tensor:
        """(m(t) - m(u)) / m(t): a position masked at t is revealed by the teacher's first step."""

        masked_t = schedule.mask_probability(self.t)
        return (masked_t - schedule.mask_probability(self.u)) / masked_t


def grid_times(units: Tensor, student_steps: int) -> TwoStepTimes:
    """The student's sampling grid: `units` in [0, 1] pick t = k / n, k in 1..n, for n = `student_steps`
    (the times its sampler runs at), with s = t - 1/n and the teacher's midpoint u = t - 1/(2n)."""

    steps = torch.ceil(units.double() * student_steps).clamp(1, student_steps)
    t = steps / student_steps
    return TwoStepTimes(t=t, u=(2 * steps - 1) / (2 * student_steps), s=(steps - 1) / student_steps)


@dataclass(frozen=True)
class PlannedMasks:
    """The masks of one student step in the dilated order (`--remasking dilated`): [B, L] bool each."""

    masked: Tensor  # masked at t: what the student predicts from
    first: Tensor  # of those, the positions the teacher's first step (t -> u) reveals


def planned_masks(
    times: TwoStepTimes, length: int, block_size: int, student_steps: int, schedule: Schedule
) -> PlannedMasks:
    """Where the dilated order (`dlm.diffusion.reveal_order.dilated_order`) has masks at `times.t`, and which of
    them its first half-step reveals: the masks a sampler of 2 x `student_steps` steps leaves over a row
    (a block model: over each block, the last one cut short where the row ends) of `length`. The student's
    step t -> s reveals the ranks of the teacher's two steps t -> u -> s, as a dilated sampler does."""

    size = block_size if 0 < block_size < length else length
    half_steps = 2 * student_steps
    widths, rank, width_index = _block_ranks(length, size)
    # table[w][k]: positions of a block of widths[w] revealed once k of the 2n half-steps are done.
    table = [
        [w - schedule.masked_count(w, Fraction(half_steps - k, half_steps)) for k in range(half_steps + 1)]
        for w in widths
    ]
    device = times.t.device
    ranks, revealed = torch.tensor(rank, device=device), torch.tensor(table, device=device)
    done = (half_steps * (1 - per_position(times.t, length, block_size))).round().long()  # [B, L]
    block_width = torch.tensor(width_index, device=device)[None, :].expand_as(done)
    before = revealed[block_width, done]
    after = revealed[block_width, (done + 1).clamp(max=half_steps)]
    masked = ranks[None, :] >= before
    return PlannedMasks(masked=masked, first=masked & (ranks[None, :] < after))


@functools.cache
def _block_ranks(length: int, size: int) -> tuple[list[int], list[int], list[int]]:
    """The block widths of a row of `length` in blocks of `size` (the last may be cut short) and, per
    column, its rank in its block's dilated order and the index of its block's width: host-side ints,
    built once per shape (no device sync in a distillation step)."""

    widths = sorted({size, length % size or size})
    rank: list[int] = []
    width_index: list[int] = []
    for start in range(0, length, size):
        width = min(size, length - start)
        rank += torch.argsort(dilated_order(width)).tolist()
        width_index += [widths.index(width)] * width
    return widths, rank, width_index


def per_position(values: Tensor, length: int, block_size: int) -> Tensor:
    """Per-row [B] or per-block [B, blocks] `values` as [B, length], one value per position."""

    if values.dim() == 1 or block_size <= 0 or block_size >= length:
        return values.reshape(values.shape[0], -1)[:, :1].expand(-1, length)
    return values.repeat_interleave(block_size, dim=1)[:, :length]


# A forbidden token's logit: finite, so that log-probabilities stay finite (no 0 x -inf in a divergence),
# yet far enough below any trained logit that its probability is exactly 0 in float32.
FORBIDDEN_LOGIT = -1e4


def allowed_log_probs(logits: Tensor, forbidden: Tensor) -> Tensor:
    """log softmax in float32 over the tokens a reverse process may write (`forbidden` ids: probability 0)."""

    logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
    logits[..., forbidden] = FORBIDDEN_LOGIT
    return logits.log_softmax(dim=-1)


def first_reveals(reveal_probability: Tensor, generator: torch.Generator | None) -> Tensor:
    """Which of N masked positions the teacher's first step reveals [N] bool, each with its probability.
    Drawn before the teacher runs (they do not depend on its prediction), from the micro-batch's `generator`."""

    draws = torch.rand(
        reveal_probability.shape, generator=generator, device=reveal_probability.device, dtype=torch.float64
    )
    return draws < reveal_probability


def draw_tokens(logits: Tensor, forbidden: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of `logits` [R, V] from its softmax (never a `forbidden` id): the first step's writes."""

    return torch.multinomial(allowed_log_probs(logits, forbidden).exp_(), 1, generator=generator).squeeze(-1)


def two_step_log_target(first: Tensor, second: Tensor, revealed: Tensor) -> Tensor:
    """The target [N, V] at N positions masked at t: the teacher's first-step log-probabilities `first`
    [N, V] where its first step `revealed` the position [N], its second-step ones `second` [K, V] at the
    K others. Written over `first`."""

    first[~revealed] = second
    return first


def certainty_forcing_loss(log_student: Tensor, targets: Tensor, weight: float) -> Tensor:
    """Certainty forcing (dParallel, 2025) at N masked positions [N]: the cross-entropy of the student's
    log-probabilities `log_student` [N, V] to the data's tokens `targets` [N], plus `weight` x the
    student's entropy where its most likely token already is the target.

    The entropy term makes the student sure where it is right, so that a threshold sampler commits
    those positions early; where it is wrong only the cross-entropy acts (sharpening a wrong guess
    would make it confidently wrong). Trained on the teacher's own samples, the targets are the
    teacher's trajectory.
    """

    cross_entropy = -log_student.gather(-1, targets[:, None]).squeeze(-1)
    right = log_student.argmax(dim=-1) == targets
    entropy = -(log_student.exp() * log_student).sum(dim=-1)
    return cross_entropy + weight * torch.where(right, entropy, 0.0)
