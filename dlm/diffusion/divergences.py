"""Divergences between two distributions over the vocabulary, the objectives of `dlm distill`.

Each takes log-probabilities [N, V] of the target (the teacher's) and of the student and returns
the divergence at each of the N positions. The log-probabilities are finite: a token neither may
produce (the mask token) has a log-probability so low that its probability is exactly 0
(`dlm.diffusion.distillation.allowed_log_probs`), so 0 x log 0 never arises and no masking pass is
needed over the [N, V] tensors, whose passes are most of a small model's distillation step. Log
space throughout: a mixture of two softmaxes underflows in float32 where its log does not. This
module imports no torch at load time (the config validates the names with it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dlm.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

Divergence = Callable[["Tensor", "Tensor"], "Tensor"]
_DIVERGENCES: Registry[Divergence] = Registry("divergence")


def register_divergence(name: str, divergence: Divergence, replace: bool = False) -> None:
    _DIVERGENCES.add(name, divergence, replace=replace)


def divergence_names() -> tuple[str, ...]:
    return _DIVERGENCES.names()


def get_divergence(name: str) -> Divergence:
    divergence = _DIVERGENCES.get(name)
    if divergence is None:
        raise KeyError(f"no divergence {name!r}; registered: {', '.join(divergence_names())}")
    return divergence


def forward_kl(log_target: Tensor, log_student: Tensor) -> Tensor:
    """KL(target || student): mass-covering; its gradient is the cross-entropy's with a soft target. The
    default: on the demo's model its students kept the teacher's quality at their steps best."""

    return (log_target.exp() * (log_target - log_student)).sum(dim=-1)


def reverse_kl(log_target: Tensor, log_student: Tensor) -> Tensor:
    """KL(student || target): mode-seeking, the divergence SDTT found best for few-step students (on the
    demo's model its students were the worst of the three)."""

    return (log_student.exp() * (log_student - log_target)).sum(dim=-1)


def total_variation(log_target: Tensor, log_student: Tensor) -> Tensor:
    """Half the L1 distance between the two distributions, in [0, 1]."""

    return (log_target.exp() - log_student.exp()).abs().sum(dim=-1) / 2


register_divergence("kl", forward_kl)
register_divergence("reverse-kl", reverse_kl)
register_divergence("tvd", total_variation)
