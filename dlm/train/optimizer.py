"""Optimisation: parameter groups, building the configured optimizer, its resume, the LR schedule, EMA.

Which optimizers exist and how each is built lives in the registry, `dlm.config.optimizer_registry`. Parameter
groups are always `[decay, no_decay]` in that order: resume matches optimizer state to parameters
by group position, so the order is part of the checkpoint format.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlm.config.optimizer_registry import optimizer_spec
from dlm.config.schema import TrainingConfig
from dlm.errors import UserError

# Prefixes that wrappers add to parameter names (torch.compile, DDP); EMA names drop them so a
# checkpoint taken from a compiled or wrapped model loads into a plain one and back.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """`[decay, no_decay]`: weight decay only on matrices (ndim >= 2), never on norms and biases."""

    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for parameter in model.parameters():  # deduplicates tied parameters
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, training: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer `training.optimizer` names in the registry (`dlm.config.optimizer_registry`), over
    `parameter_groups`."""

    spec = optimizer_spec(training.optimizer)
    spec.check_installed()
    return spec.build(model, parameter_groups(model, training.weight_decay), training, device)


def check_state_layout(optimizer: torch.optim.Optimizer, state: dict[str, Any], path: str | Path) -> None:
    """Refuse a saved optimizer state whose parameter groups do not line up with `optimizer`'s.

    State is matched to parameters by group position and by order within a group, whatever the
    optimizer, so the number of groups and of parameters in each must agree.
    """

    saved = [len(group["params"]) for group in state.get("param_groups", [])]
    current = [len(group["params"]) for group in optimizer.param_groups]
    if saved != current:
        raise UserError(
            f"the checkpoint's optimizer state has parameter groups of sizes {saved}, "
            f"the optimizer built now has {current}",
            path=path,
            fix="resume with the model and optimizer config the run was started with",
        )


@contextlib.contextmanager
def configured_hyperparameters_kept(optimizer: torch.optim.Optimizer, names: tuple[str, ...]) -> Iterator[None]:
    """Keep the param-group entries `names` as the optimizer was built (from the current config)
    across a state load, which would otherwise bring back the checkpoint's values."""

    kept = [{name: group[name] for name in names if name in group} for group in optimizer.param_groups]
    yield
    for group, values in zip(optimizer.param_groups, kept, strict=True):
        group.update(values)


def learning_rate(step: int, training: TrainingConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to `min_learning_rate` at the end."""

    peak, floor, warmup = training.learning_rate, training.min_learning_rate, training.warmup_steps
    if step < warmup:
        return peak * (step + 1) / max(1, warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * decay_progress(step, training)))
    return floor + cosine * (peak - floor)


def decay_progress(step: int, training: TrainingConfig) -> float:
    """The share of the cosine decay done at `step` (past warmup): 0 at its start, 1 at the last step
    (max_steps - 1), which lands exactly on the floor. A re-planned run (`decay_anchor_step`) goes on
    from the share done at the re-plan, so the new max_steps bends the rest of the curve and never
    raises the learning rate."""

    anchor, done = training.decay_anchor_step, training.decay_anchor_progress
    if anchor > training.warmup_steps and step >= anchor:
        span = training.max_steps - anchor - 1  # 0: the anchor's is the last step, on the floor
        progress = 1.0 if span <= 0 else done + (1.0 - done) * (step - anchor) / span
    else:
        progress = (step - training.warmup_steps) / max(1, training.max_steps - training.warmup_steps - 1)
    return min(max(progress, 0.0), 1.0)


def _canonical_name(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name


def updates_past_warmup(decay: float) -> int:
    """The fewest updates after which the EMA warmup no longer lowers `decay`."""

    count = max(0, math.ceil((10 * decay - 1) / (1 - decay)))
    # Float rounding can put the closed form one off either way.
    while (1 + count) / (10 + count) < decay:
        count += 1
    while count > 0 and count / (9 + count) >= decay:
        count -= 1
    return count


class ModelEMA:
    """An fp32 exponential moving average of a model's trainable parameters.

    `shadow = d * shadow + (1 - d) * live` after each optimizer step, done with fused
    `torch._foreach` kernels on the parameters' device, so updating never synchronises the host.
    `d = min(decay, (1 + n) / (10 + n))` after `n` earlier updates: the usual warmup. Without it
    the average would hold on to the random initial weights for ~1 / (1 - decay) steps (thousands
    at 0.999), and eval and export, which use these weights, would score a barely trained model.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise UserError(f"training.ema_decay: {decay} is not in (0, 1)", fix="use e.g. 0.999")
        self.decay = float(decay)
        self.num_updates = 0
        named = self._named_parameters(model)
        self.names = [name for name, _ in named]
        self.shadow = [p.detach().to(dtype=torch.float32, copy=True) for _, p in named]

    @staticmethod
    def _named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(_canonical_name(name), p) for name, p in model.named_parameters() if p.requires_grad]

    def _live(self, model: nn.Module) -> list[torch.Tensor]:
        live: list[torch.Tensor] = [p for _, p in self._named_parameters(model)]
        if len(live) != len(self.shadow):
            raise ValueError(f"model has {len(live)} trainable parameters, the EMA tracks {len(self.shadow)}")
        return live

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average towards the model's current weights."""

        live = [p.detach() for p in self._live(model)]
        if any(p.dtype != torch.float32 for p in live):
            live = [p.float() for p in live]
        # lerp(shadow, live, 1 - d) == d * shadow + (1 - d) * live
        torch._foreach_lerp_(self.shadow, live, 1.0 - self.current_decay())
        self.num_updates += 1

    def current_decay(self) -> float:
        """The decay the next update applies: `decay`, lowered while few updates have been made."""

        return min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Overwrite the model's parameters with the averaged weights (cast to their dtype)."""

        for target, source in zip(self._live(model), self.shadow, strict=True):
            target.copy_(source)

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[nn.Module]:
        """Evaluate with the EMA weights; the live weights come back on exit, even on error."""

        live = self._live(model)
        with torch.no_grad():
            backup = [p.detach().clone() for p in live]
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                torch._foreach_copy_(live, backup)

    def state_dict(self) -> dict[str, Any]:
        """Tensors, floats and ints only, so it loads with `torch.load(weights_only=True)`."""

        return {
            "decay": self.decay,
            "num_updates": self.num_updates,
            "shadow": dict(zip(self.names, self.shadow, strict=True)),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        shadow = state["shadow"]
        if sorted(shadow) != sorted(self.names):
            missing = sorted(set(self.names) - set(shadow))
            extra = sorted(set(shadow) - set(self.names))
            raise UserError(
                f"the checkpoint's EMA weights do not match the model (missing {missing[:3]}, unexpected {extra[:3]})",
                fix="resume with the model config the run was started with",
            )
        for name, target in zip(self.names, self.shadow, strict=True):
            source = shadow[name]
            if source.shape != target.shape:
                raise UserError(
                    f"EMA weight {name} has shape {tuple(source.shape)}, the model {tuple(target.shape)}",
                    fix="resume with the model config the run was started with",
                )
            target.copy_(source)
        # The decay stays the constructor's: the run's config, not the file, is the truth for it.
        # The count sets the warmup, so resume restores it; a state without one (saved before the
        # warmup existed) has been averaging at full decay all along and stays past the warmup.
        count = state.get("num_updates")
        self.num_updates = int(count) if count is not None else updates_past_warmup(self.decay)
