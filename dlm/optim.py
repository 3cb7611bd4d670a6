"""Optimisation: AdamW parameter groups (torch or bitsandbytes 8-bit), the LR schedule, EMA.

Parameter groups are always `[decay, no_decay]` in that order: resume matches optimizer state to
parameters by group position, so the order is part of the checkpoint format.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dlm.config import TrainingConfig
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
    """AdamW (fused on CUDA) or bitsandbytes AdamW8bit, configured from `training`."""

    groups = parameter_groups(model, training.weight_decay)
    common: dict[str, Any] = {
        "lr": training.learning_rate,
        "betas": (training.adam_beta1, training.adam_beta2),
        "eps": training.adam_eps,
    }
    if training.optimizer == "adamw8bit":
        return _build_adamw8bit(model, groups, training, common)
    if device.type == "cuda":
        common["fused"] = True
    return torch.optim.AdamW(groups, **common)


def _build_adamw8bit(
    model: nn.Module,
    groups: list[dict[str, Any]],
    training: TrainingConfig,
    common: dict[str, Any],
) -> torch.optim.Optimizer:
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError(
            "training.optimizer: adamw8bit needs the bitsandbytes package, which is not installed",
            fix="pip install 'dlm[gpu]' (the `gpu` extra) or set training.optimizer = \"adamw\"",
        ) from None
    manager = bnb.optim.GlobalOptimManager.get_instance()
    # The manager is a process-wide singleton keyed by (group, position) and it keeps every
    # registered module alive. Start from a clean slate so an earlier optimizer in this process
    # (a bench sweep, a test) can neither leak its 32-bit override into this one nor pin its model.
    manager.initialize()
    if training.optimizer_embedding_32bit:
        # 8-bit state is known to hurt embeddings in NLP models; the LM head is tied to this very
        # Parameter, so one override protects both roles for a modest memory cost.
        manager.register_module_override(model.token_embedding, "weight", {"optim_bits": 32})
    optimizer = bnb.optim.AdamW8bit(groups, min_8bit_size=training.optimizer_min_8bit_size, **common)
    if training.optimizer_embedding_32bit:
        # Resolve the override now (bitsandbytes would on the first step) and let go of the module.
        optimizer.check_overrides()
        manager.module_weight_config_triple.clear()
    return optimizer


def learning_rate(step: int, training: TrainingConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to `min_learning_rate` at the end."""

    peak, floor, warmup = training.learning_rate, training.min_learning_rate, training.warmup_steps
    if step < warmup:
        return peak * (step + 1) / max(1, warmup)
    # The last step (max_steps - 1) lands exactly on the floor.
    progress = (step - warmup) / max(1, training.max_steps - warmup - 1)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return floor + cosine * (peak - floor)


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
        live = [p for _, p in self._named_parameters(model)]
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
