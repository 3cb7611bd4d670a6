"""The optimizer registry: one table from a `training.optimizer` name to how that optimizer is built.

Adding an optimizer is one `register_optimizer(OptimizerSpec(...))` call. Everything else reads
this table: the config (which names it accepts), `dlm.train.optimizer.build_optimizer`, resume (which
param-group hyperparameters the current config overrides, which settings must not change) and the
FSDP check. Resume restores the state dict generically, so a builder never writes resume code.

This module imports no torch at import time: `dlm.config` validates names against it, and the
config must stay importable without torch for a fast `dlm --help`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dlm.errors import UserError
from dlm.extras import optional_module
from dlm.registry import Registry

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch
    from torch import nn

    from dlm.config.schema import TrainingConfig

    # (model, parameter groups, training config, device) -> optimizer over exactly those groups.
    # The groups are `[decay, no_decay]` (`dlm.train.optimizer.parameter_groups`); keep them as given,
    # because a checkpoint's state is matched to the parameters by group position.
    Builder = Callable[[nn.Module, list[dict[str, Any]], TrainingConfig, torch.device], torch.optim.Optimizer]
    # (every parameter as (name, element count), training config) -> bytes of optimizer state.
    StateBytes = Callable[[Sequence[tuple[str, int]], TrainingConfig], int]


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build one optimizer and what a resume of its state must know about it."""

    name: str
    build: Builder
    description: str  # one line for the config reference, e.g. "torch AdamW, fused on CUDA"
    # Param-group entries that come from the config: on resume they keep the current config's
    # values instead of the checkpoint's, so a changed beta or decay takes effect. Entries not
    # named here (and any state an optimizer keeps in its groups) come from the checkpoint; the
    # learning rate is set by the schedule before every step either way.
    resumable_hyperparameters: tuple[str, ...] = ()
    # `TrainingConfig` fields that shape the saved state (its dtype or layout): a resume that
    # changes one of them is refused, since the state could not be loaded faithfully.
    state_settings: tuple[str, ...] = ()
    # Why the optimizer cannot run on FSDP-sharded (DTensor) parameters; None when it can.
    fsdp_refusal: str | None = None
    # Bytes of state it keeps for the model's parameters before any sharding: what the memory
    # estimate (`dlm.train.memory`) counts. None when unknown; the estimate then counts no state, which
    # errs towards running rather than refusing a run that fits.
    state_bytes: StateBytes | None = None
    # A module that must be importable to build it, and the `dlm` extra that installs it.
    requires: str | None = None
    needs_extra: str | None = None
    # Why this installation cannot build it (None when it can), checked before building.
    unavailable: Callable[[], str | None] | None = None

    @property
    def supports_fsdp(self) -> bool:
        return self.fsdp_refusal is None

    def check_installed(self) -> None:
        """Refuse, with the install command, when the optimizer's package is missing."""

        reason = self.unavailable() if self.unavailable is not None else None
        if reason is not None:
            raise UserError(
                f"training.optimizer: {self.name} {reason}",
                fix='install what it names, or set training.optimizer = "adamw"',
            )
        if self.requires is None:
            return
        if optional_module(self.requires) is None:
            install = f"pip install 'dlm[{self.needs_extra}]' (the `{self.needs_extra}` extra)"
            raise UserError(
                f"training.optimizer: {self.name} needs the {self.requires} package, which is not installed",
                fix=f"{install if self.needs_extra else f'pip install {self.requires}'} "
                'or set training.optimizer = "adamw"',
            )


_REGISTRY: Registry[OptimizerSpec] = Registry("optimizer")


def register_optimizer(spec: OptimizerSpec, *, replace: bool = False) -> OptimizerSpec:
    """Make `spec.name` a valid `training.optimizer`; returns the spec."""

    return _REGISTRY.add(spec.name, spec, replace=replace)


def unregister_optimizer(name: str) -> None:
    """Remove a registered optimizer (a plugin unloading, a test cleaning up)."""

    _REGISTRY.remove(name)


def registered_optimizers() -> tuple[str, ...]:
    """The names `training.optimizer` accepts, in registration order."""

    return _REGISTRY.names()


def optimizer_spec(name: str) -> OptimizerSpec:
    spec = _REGISTRY.get(name)
    if spec is None:
        raise UserError(
            f"training.optimizer: {name!r} is not a registered optimizer",
            fix=f"use one of: {', '.join(registered_optimizers())}",
        )
    return spec


def describe_optimizers() -> str:
    """`name = description` of each registered optimizer, for the config reference."""

    return "; ".join(f"{spec.name} = {spec.description}" for _, spec in _REGISTRY.items())


def check_fsdp_support(name: str) -> None:
    """Refuse an optimizer that cannot hold FSDP-sharded parameters."""

    spec = optimizer_spec(name)
    if spec.fsdp_refusal is not None:
        raise UserError(
            f"training.optimizer = {name!r} does not work with training.parallelism = 'fsdp': {spec.fsdp_refusal}",
            fix=f"use optimizer = 'adamw' with fsdp, or {name} with parallelism = 'ddp'",
        )


# ---------------------------------------------------------------------------------------------
# The built-in optimizers
# ---------------------------------------------------------------------------------------------


def _adam_settings(training: TrainingConfig) -> dict[str, Any]:
    return {
        "lr": training.learning_rate,
        "betas": (training.adam_beta1, training.adam_beta2),
        "eps": training.adam_eps,
    }


def _build_adamw(
    model: nn.Module, groups: list[dict[str, Any]], training: TrainingConfig, device: torch.device
) -> torch.optim.Optimizer:
    import torch

    # The fused kernel is the fastest AdamW on CUDA; elsewhere torch picks its own default.
    fused: dict[str, Any] = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, **_adam_settings(training), **fused)


def _build_adamw8bit(
    model: nn.Module, groups: list[dict[str, Any]], training: TrainingConfig, device: torch.device
) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    manager = bnb.optim.GlobalOptimManager.get_instance()
    # The manager is a process-wide singleton keyed by (group, position) and it keeps every
    # registered module alive. Start from a clean slate so an earlier optimizer in this process
    # (a bench sweep, a test) can neither leak its 32-bit override into this one nor pin its model.
    manager.initialize()
    if training.optimizer_embedding_32bit:
        # 8-bit state is known to hurt embeddings in NLP models, and the output head is the same kind
        # of vocabulary matrix: a tied head is this very Parameter, an untied one (`model.head`) gets
        # its own override. Frozen ones (a LoRA run's) are in no group and stay without state.
        for module in _vocabulary_modules(model):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
    optimizer = bnb.optim.AdamW8bit(groups, min_8bit_size=training.optimizer_min_8bit_size, **_adam_settings(training))
    if training.optimizer_embedding_32bit:
        # Resolve the override now (bitsandbytes would on the first step) and let go of the module.
        optimizer.check_overrides()
        manager.module_weight_config_triple.clear()
    return optimizer


def _build_muon(
    model: nn.Module, groups: list[dict[str, Any]], training: TrainingConfig, device: torch.device
) -> torch.optim.Optimizer:
    from dlm.config.muon import MuonAdamW, split_groups

    vocabulary = {id(module.weight) for module in _vocabulary_modules(model)}
    muon_groups, adamw_groups = split_groups(groups, vocabulary)
    return MuonAdamW(muon_groups, adamw_groups, **_adam_settings(training), fused=device.type == "cuda")


def _muon_state_bytes(parameters: Sequence[tuple[str, int]], training: TrainingConfig) -> int:
    """One float32 momentum per entry of Muon's matrices, told by name (every `.weight` but the
    vocabulary's and the norms'); Adam's two moments for the rest."""

    muon = sum(
        size
        for name, size in parameters
        if name not in _VOCABULARY_WEIGHTS and name.endswith(".weight") and "norm" not in name
    )
    total = sum(size for _, size in parameters)
    return 4 * muon + _FLOAT32_MOMENTS * (total - muon)


def _vocabulary_modules(model: nn.Module) -> list[nn.Module]:
    """The token embedding, and the output head when it is a module of its own (untied)."""

    import torch

    head = getattr(model, "head", None)  # None when tied
    return [model.get_submodule("token_embedding")] + ([head] if isinstance(head, torch.nn.Module) else [])


# The parameters `_vocabulary_modules` names, as `parameter_entries` lists them.
_VOCABULARY_WEIGHTS = frozenset({"token_embedding.weight", "head.weight"})

_FLOAT32_MOMENTS = 8  # bytes per parameter: Adam's two float32 moments
_UINT8_MOMENTS = 2  # two uint8 moments; the per-block scales add ~1%, left out of a lower bound


def _adamw_state_bytes(parameters: Sequence[tuple[str, int]], training: TrainingConfig) -> int:
    return _FLOAT32_MOMENTS * sum(size for _, size in parameters)


def _adamw8bit_state_bytes(parameters: Sequence[tuple[str, int]], training: TrainingConfig) -> int:
    """8-bit moments, but 32-bit ones for tensors the builder keeps there (small ones, the embedding and
    an untied head)."""

    total = 0
    for name, size in parameters:
        keeps_32bit = size < training.optimizer_min_8bit_size or (
            training.optimizer_embedding_32bit and name in _VOCABULARY_WEIGHTS
        )
        total += size * (_FLOAT32_MOMENTS if keeps_32bit else _UINT8_MOMENTS)
    return total


_ADAM_HYPERPARAMETERS = ("weight_decay", "betas", "eps")

register_optimizer(
    OptimizerSpec(
        name="adamw",
        build=_build_adamw,
        description="torch AdamW, fused on CUDA",
        resumable_hyperparameters=_ADAM_HYPERPARAMETERS,
        state_bytes=_adamw_state_bytes,
    )
)
register_optimizer(
    OptimizerSpec(
        name="adamw8bit",
        build=_build_adamw8bit,
        description="bitsandbytes AdamW8bit (the `gpu` extra)",
        resumable_hyperparameters=_ADAM_HYPERPARAMETERS,
        state_settings=("optimizer_min_8bit_size", "optimizer_embedding_32bit"),
        state_bytes=_adamw8bit_state_bytes,
        fsdp_refusal="bitsandbytes' 8-bit state is not defined for sharded (DTensor) parameters",
        requires="bitsandbytes",
        needs_extra="gpu",
    )
)


def _torch_without_muon() -> str | None:
    import torch

    if hasattr(torch.optim, "Muon"):
        return None
    return f"needs torch.optim.Muon, in torch 2.9 or later (this is torch {torch.__version__})"


register_optimizer(
    OptimizerSpec(
        name="muon",
        build=_build_muon,
        description="torch Muon on the blocks' matrices (updates scaled to AdamW's RMS: the same learning rate), "
        "torch AdamW on the embedding, head, norms and biases; torch 2.9 or later",
        resumable_hyperparameters=_ADAM_HYPERPARAMETERS,
        state_bytes=_muon_state_bytes,
        fsdp_refusal="Muon orthogonalises whole matrices, which FSDP shards",
        unavailable=_torch_without_muon,
    )
)
