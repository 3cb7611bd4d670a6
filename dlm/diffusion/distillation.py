"""Distillation through time (SDTT): the target a few-step student learns, from a teacher's two steps.

The reverse process samples from time t to s = t - h: every position masked at t is revealed with
probability (m(t) - m(s)) / m(t), its token drawn from the model's prediction p(x | z_t). A student
that takes one step of 2h should write what its teacher writes in two steps of h, t -> u = t - h ->
s = t - 2h. For a position i masked at z_t, conditioned on being revealed by s, the teacher reveals
it in its first step with probability w1 = (m(t) - m(u)) / (m(t) - m(s)) (1/2 on the linear
schedule), drawing from p(x_i | z_t), and otherwise in its second step, drawing from p(x_i | z_u)
for the intermediate sequence z_u its first step wrote. The student's one-step prediction at i
should therefore be

    T_i = w1 p(x_i | z_t) + (1 - w1) E[p(x_i | z_u) | i still masked at u].

Reveals are independent across positions, so a z_u drawn by the teacher's first step in which i
stayed masked is a draw of z_u given that i is masked, and w1 p1_i + (1 - w1) p2_i(z_u) is an
unbiased draw of T_i. Positions the first step revealed carry no such draw and get no loss. The
loss is linear in the target for the forward KL (a cross-entropy), so its expectation is the loss
against T itself; `tests/test_distill.py` checks T against an enumeration of the whole two-step
process on a tiny vocabulary.

This module is the arithmetic; `dlm.distill` runs the teacher and the student.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dlm.diffusion.schedules import Schedule

_MODEL_ATTRIBUTE = "distilled_steps"  # where a loaded student keeps the sampling steps it was distilled for


def attach_distilled_steps(model: object, steps: int) -> None:
    """Record on a loaded student the steps it was distilled for; sampling defaults to them."""

    setattr(model, _MODEL_ATTRIBUTE, steps)


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

    def first_step_weight(self, schedule: Schedule) -> Tensor:
        """w1 = (m(t) - m(u)) / (m(t) - m(s)): of the positions revealed by s, the share revealed at u."""

        masked_t = schedule.mask_probability(self.t)
        return (masked_t - schedule.mask_probability(self.u)) / (masked_t - schedule.mask_probability(self.s))


def grid_times(units: Tensor, student_steps: int) -> TwoStepTimes:
    """The student's sampling grid: `units` in [0, 1] pick t = k / n, k in 1..n, for n = `student_steps`
    (the times its sampler runs at), with s = t - 1/n and the teacher's midpoint u = t - 1/(2n)."""

    steps = torch.ceil(units.double() * student_steps).clamp(1, student_steps)
    t = steps / student_steps
    return TwoStepTimes(t=t, u=(2 * steps - 1) / (2 * student_steps), s=(steps - 1) / student_steps)


def per_position(values: Tensor, length: int, block_size: int) -> Tensor:
    """Per-row [B] or per-block [B, blocks] `values` as [B, length], one value per position."""

    if values.dim() == 1 or block_size <= 0 or block_size >= length:
        return values.reshape(values.shape[0], -1)[:, :1].expand(-1, length)
    return values.repeat_interleave(block_size, dim=1)[:, :length]


def allowed_log_probs(logits: Tensor, forbidden: Tensor) -> Tensor:
    """log softmax in float32 over the tokens a reverse process may write (`forbidden` ids: -inf)."""

    logits = logits.float().clone()
    logits[..., forbidden] = float("-inf")
    return logits.log_softmax(dim=-1)


def first_step(
    log_probs: Tensor, reveal_probability: Tensor, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """The teacher's first step at N masked positions: which are revealed [N] bool, and the token
    drawn for each [N] (used where revealed). Draws come from `generator`: the micro-batch's own."""

    draws = torch.rand(reveal_probability.shape, generator=generator, device=reveal_probability.device,
                       dtype=torch.float64)  # fmt: skip
    revealed = draws < reveal_probability
    tokens = torch.multinomial(log_probs.exp(), 1, generator=generator).squeeze(-1)
    return revealed, tokens


def two_step_log_target(first: Tensor, second: Tensor, first_weight: Tensor) -> Tensor:
    """log(w1 p1 + (1 - w1) p2) [K, V] from the log-probabilities of the teacher's two steps at K positions."""

    weight = first_weight.to(first.dtype)[:, None]
    return torch.logaddexp(first + weight.log(), second + torch.log1p(-weight))
