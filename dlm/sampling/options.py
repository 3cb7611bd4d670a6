"""The options of one reverse process and what a generation returns."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, get_args

import torch

from dlm.choices import CacheMode, RevealSplit
from dlm.diffusion.distillation import distilled_remasking, distilled_steps
from dlm.errors import UserError, UserNote
from dlm.sampling.remasking import remasking_names

CACHE_CHOICES: tuple[str, ...] = get_args(CacheMode)
REVEAL_SPLITS: tuple[str, ...] = get_args(RevealSplit)
# `on_step(step, tokens)`: step 0 is the starting sequence, then each step of the reverse process.
StepCallback = Callable[[int, torch.Tensor], None]


DEFAULT_STEPS = 64  # a model that is no distilled student: one token a step at the default length


def sampling_steps(model: object, steps: int | None) -> int:
    """`steps`, or when None the steps a distilled student was distilled for (`dlm distill`), else 64.
    Explicit steps below a student's own are kept, with a note: it was not trained for them."""

    distilled = distilled_steps(model)
    if steps is None:
        return DEFAULT_STEPS if distilled is None else distilled
    if distilled is not None and steps < distilled:
        warnings.warn(
            f"--steps {steps} is below the {distilled} steps this model was distilled for: expect lower "
            "quality than at its own steps",
            UserNote,
            stacklevel=2,
        )
    return steps


def sampling_remasking(model: object, remasking: str | None) -> str:
    """`remasking`, or when None the reveal order a distilled student was distilled for, else `random`."""

    if remasking is not None:
        return remasking
    return distilled_remasking(model) or "random"


@dataclass(frozen=True)
class SamplingOptions:
    """How to run the reverse process; invalid values raise `UserError` naming the CLI option."""

    steps: int = DEFAULT_STEPS
    temperature: float = 1.0
    top_k: int | None = None
    # Measured at 0.3 (`git show cece22c:scripts/sampler_defaults.py`): on a weakly trained model, greedy or
    # confidence-ordered reveals commit the most frequent token (a newline) nearly everywhere; random
    # (ancestral) reveals with nucleus sampling give text.
    top_p: float | None = 0.9
    remasking: str = "random"  # a name registered in dlm.sampling.remasking (built-ins: dlm.choices.Remasking)
    block_length: int | None = None
    threshold: float | None = None  # `dlm.sampling.fast`: commit every position above this confidence
    cache: CacheMode = "none"  # `dlm.sampling.fast`: approximate KV cache of a whole-sequence model
    reveal_split: RevealSplit = "schedule"  # `reveal_count`: how fixed-count steps share a block's positions

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UserError(f"--steps must be at least 1 (got {self.steps})", fix="pass --steps 64")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(
                f"--temperature must be a finite number >= 0 (got {self.temperature})",
                fix="1.0 samples the model's distribution, 0 picks the most likely token",
            )
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"--top-k must be at least 1 (got {self.top_k})", fix="omit it to keep all tokens")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1] (got {self.top_p})", fix="try --top-p 0.9")
        if self.remasking not in remasking_names():
            raise UserError(f"--remasking must be one of {', '.join(remasking_names())} (got {self.remasking!r})")
        if self.block_length is not None and self.block_length < 1:
            raise UserError(
                f"--block-length must be at least 1 (got {self.block_length})",
                fix="omit it to denoise all positions together",
            )
        if self.threshold is not None and not 0 < self.threshold < 1:
            raise UserError(f"--threshold must be in (0, 1) (got {self.threshold})", fix="try --threshold 0.9")
        if self.cache not in CACHE_CHOICES:
            raise UserError(f"--cache must be one of {', '.join(CACHE_CHOICES)} (got {self.cache!r})")
        if self.reveal_split not in REVEAL_SPLITS:
            raise UserError(f"--reveal-split must be one of {', '.join(REVEAL_SPLITS)} (got {self.reveal_split!r})")
        if self.reveal_split != "schedule" and self.remasking == "random" and self.threshold is None:
            raise UserError(
                f"--reveal-split {self.reveal_split} sets how many positions a step reveals, which "
                "ancestral steps (--remasking random) draw at random",
                fix="add --remasking confidence or margin, or a --threshold",
            )


@dataclass(frozen=True)
class SampleResult:
    """Generated samples: full texts and token ids (prompt or template included)."""

    texts: list[str]
    token_ids: list[list[int]]
    steps: int
    forward_passes: int
    seconds: float
    forward_tokens: int = 0  # token positions fed to the model over all passes (rows x length): compute
    lengths: list[int] = field(default_factory=list)  # generated tokens kept per sample
    prompt_tokens: list[int] = field(default_factory=list)  # per sample: tokens before the first generated one
    seeds: list[int] = field(default_factory=list)  # per sample: the seed of its random stream

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
