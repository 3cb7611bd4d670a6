"""Noise schedules of the masking process: one object serves training, evaluation and sampling.

A schedule is α(t), the probability that a token is still clean at diffusion time t in [0, 1], falling
from α(0) = 1 to α(1) = 0. Everything the rest of dlm needs follows from it:

- mask probability m(t) = 1 - α(t): at time t each token is masked independently with it;
- ELBO weight w(t) = -α'(t) / (1 - α(t)) = m'(t) / m(t): the weight of a masked token's
  cross-entropy in the continuous-time ELBO (1 / t for the linear schedule);
- reveal probability between times s < t, (α(s) - α(t)) / (1 - α(t)): the chance that a position
  masked at t is clean at s (the ancestral sampler's step);
- positions still masked at time t out of n, floor(n m(t)) (the confidence samplers' plan).

Training and evaluation draw times t in [mask_eps, 1] exactly as before and only the schedule turns
them into mask probabilities and weights; the sampler walks its grid of times t = k / steps.

A subclass implements `mask_probability` and `mask_rate` (m and m' = -α') for a tensor of times
and for a Python float, and registers under the name `[diffusion] schedule` takes:

    @register_schedule("quadratic")
    class QuadraticSchedule(Schedule):
        def mask_probability(self, t): return t * t  # α(t) = 1 - t²
        def mask_rate(self, t): return 2 * t

This module imports no torch (the config validates schedule names with it, and `dlm --help` stays
fast): tensor maths goes through the tensors' own methods.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from dlm.errors import UserError
from dlm.registry import Registry

if TYPE_CHECKING:
    from torch import Tensor

T = TypeVar("T", "Tensor", float)  # a tensor of times, or one time
S = TypeVar("S", bound="type[Schedule]")
Time = float | Fraction  # the sampler's times: exact fractions k / steps of its grid

DEFAULT_MASK_EPS = 1e-3  # the smallest diffusion time t drawn, unless `[diffusion] mask_eps` says otherwise
NOISE_BUCKETS = 10  # losses are also reported per tenth of the diffusion time t (training and eval)
DEFAULT_SCHEDULE = "linear"
_MODEL_ATTRIBUTE = "diffusion_schedule"  # where a loaded model keeps the schedule it was trained with
_SCHEDULES: Registry[type[Schedule]] = Registry("noise schedule")


class Schedule(ABC):
    """The noise schedule α(t); subclasses implement `mask_probability` and `mask_rate`."""

    name: ClassVar[str] = ""  # set by `register_schedule`

    @abstractmethod
    def mask_probability(self, t: T) -> T:
        """m(t) = 1 - α(t), increasing from m(0) = 0 to m(1) = 1."""

    @abstractmethod
    def mask_rate(self, t: T) -> T:
        """m'(t) = -α'(t) >= 0, the rate at which tokens get masked."""

    def alpha(self, t: T) -> T:
        """α(t): the probability that a token is still clean at time t."""

        return 1 - self.mask_probability(t)

    def loss_weight(self, t: T) -> T:
        """The ELBO weight -α'(t) / (1 - α(t)) of a masked token's cross-entropy at time t."""

        return self.mask_rate(t) / self.mask_probability(t)

    def reveal_probability(self, s: Time, t: Time) -> Time:
        """(α(s) - α(t)) / (1 - α(t)) for s < t: a position masked at t is clean at s."""

        if s <= 0:
            return 1.0  # time 0 is the clean text: whatever is still masked is revealed
        masked_then = self.mask_probability(float(t))
        return (masked_then - self.mask_probability(float(s))) / masked_then

    def masked_count(self, n: int, t: Time) -> int:
        """floor(n m(t)): how many of n positions are still masked at time t (n at t = 1, 0 at t = 0)."""

        if t >= 1:
            return n
        if t <= 0:
            return 0
        # A rounding error in m(t) must not drop a position where n m(t) is a whole number.
        return min(n, math.floor(n * self.mask_probability(float(t)) + 1e-9))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"<{self.name or type(self).__name__} schedule>"


def register_schedule(name: str, replace: bool = False) -> Callable[[S], S]:
    """Class decorator: make a `Schedule` subclass available as `[diffusion] schedule = name`."""

    def register(cls: S) -> S:
        if not issubclass(cls, Schedule):
            raise TypeError(f"{cls!r} is not a dlm.diffusion.schedules.Schedule subclass")
        _SCHEDULES.add(name, cls, replace=replace)
        cls.name = name
        return cls

    return register


def unregister_schedule(name: str) -> None:
    _SCHEDULES.remove(name)


def schedule_names() -> tuple[str, ...]:
    """The registered schedule names, in registration order (the built-in ones first)."""

    return _SCHEDULES.names()


def describe_schedules() -> str:
    """One line per registered schedule for the config reference: its name and what it is."""

    lines = {name: (cls.__doc__ or "").strip().splitlines()[0].rstrip(".") for name, cls in _SCHEDULES.items()}
    return "; ".join(f"{name}, {line}" for name, line in lines.items())


def get_schedule(schedule: str | Schedule) -> Schedule:
    """The schedule registered under `schedule` (a `Schedule` passes through)."""

    if isinstance(schedule, Schedule):
        return schedule
    cls = _SCHEDULES.get(schedule)
    if cls is None:
        raise UserError(
            f"unknown noise schedule {schedule!r}",
            fix=f"use one of: {', '.join(schedule_names())} "
            "(or register it with dlm.diffusion.schedules.register_schedule)",
        )
    return cls()


def attach_schedule(model: Any, schedule: str | Schedule) -> None:
    """Record on a loaded model the schedule it was trained with; sampling reads it back."""

    setattr(model, _MODEL_ATTRIBUTE, get_schedule(schedule))


def model_schedule(model: Any) -> Schedule:
    """The schedule `attach_schedule` recorded on `model`; linear (the default) when none was."""

    found = getattr(model, _MODEL_ATTRIBUTE, None)
    return found if isinstance(found, Schedule) else get_schedule(DEFAULT_SCHEDULE)


def _ones_like(t: T) -> T:
    return 1.0 if isinstance(t, (int, float)) else t.new_ones(t.shape)


def _sin(x: T) -> T:
    return math.sin(x) if isinstance(x, (int, float)) else x.sin()


@register_schedule("linear")
class LinearSchedule(Schedule):
    """α(t) = 1 - t: mask probability t, ELBO weight 1 / t (MDLM, SMDM, LLaDA)."""

    def mask_probability(self, t: T) -> T:
        return t  # the time itself, not 1 - (1 - t): masks and weights use exactly the drawn t

    def mask_rate(self, t: T) -> T:
        return _ones_like(t)

    # On the sampler's rational grid m(t) = t is exact, so counts and odds stay exact integers.
    def reveal_probability(self, s: Time, t: Time) -> Time:
        return (Fraction(t) - Fraction(s)) / Fraction(t)

    def masked_count(self, n: int, t: Time) -> int:
        return math.floor(n * Fraction(t))


@register_schedule("cosine")
class CosineSchedule(Schedule):
    """α(t) = cos(πt / 2): fewer masks than linear at every t, ELBO weight (π / 2) cot(πt / 4)."""

    def mask_probability(self, t: T) -> T:
        # 1 - cos(x) = 2 sin²(x / 2) keeps its precision for small t, where 1 - cos(x) cancels.
        return 2 * _sin(t * (math.pi / 4)) ** 2

    def mask_rate(self, t: T) -> T:
        return (math.pi / 2) * _sin(t * (math.pi / 2))
