"""`training.optimizer = "muon"`: torch's Muon on the blocks' matrices, torch's AdamW on the rest, as one optimizer.

Muon (Jordan et al. 2024) orthogonalises each weight matrix's momentum (Newton-Schulz iterations)
before the update; it is defined for the hidden 2-D matrices only, so the token embedding, an untied
head, the norms and any biases keep AdamW, as in every Muon recipe. Both are torch's own
(`torch.optim.Muon`, torch >= 2.9; `torch.optim.AdamW`); `MuonAdamW` only makes them one
`torch.optim.Optimizer`: its parameter groups are theirs (the same dicts, so the learning-rate schedule
reaches both), their per-parameter state is one shared dict, and `state_dict` / `load_state_dict`
are the base class's, in the layout every checkpoint path (single file, DCP) already handles.
Muon's updates are scaled to AdamW's RMS (`adjust_lr_fn = "match_rms_adamw"`), so one learning
rate and one schedule serve both, and the decay of `training.weight_decay` is decoupled in both.

This module imports torch: the registry imports it only when a run builds the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

MUON_MOMENTUM = 0.95  # Muon's own default, with Nesterov momentum


def split_groups(groups: list[dict[str, Any]], vocabulary: set[int]) -> tuple[list[dict[str, Any]], ...]:
    """`[decay, no_decay]` (`dlm.train.optimizer.parameter_groups`) split into Muon's groups (the decayed
    2-D matrices whose ids are not in `vocabulary`: the blocks') and AdamW's (the rest of decay, the
    vocabulary matrices, with its weight decay; then no_decay)."""

    decay, no_decay = groups
    hidden = [p for p in decay["params"] if id(p) not in vocabulary and p.ndim == 2]
    kept = {id(p) for p in hidden}
    rest = [p for p in decay["params"] if id(p) not in kept]
    muon = [{"params": hidden, "weight_decay": decay["weight_decay"]}] if hidden else []
    return muon, [{"params": rest, "weight_decay": decay["weight_decay"]}, no_decay]


class MuonAdamW(torch.optim.Optimizer):
    """Muon over `muon_groups`, AdamW over `adamw_groups`: one optimizer, its groups Muon's then AdamW's."""

    def __init__(
        self,
        muon_groups: list[dict[str, Any]],
        adamw_groups: list[dict[str, Any]],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        fused: bool = False,
    ) -> None:
        self._muon = (
            torch.optim.Muon(muon_groups, lr=lr, momentum=MUON_MOMENTUM, nesterov=True, adjust_lr_fn="match_rms_adamw")
            if muon_groups
            else None
        )
        adamw_settings: dict[str, Any] = {"lr": lr, "betas": betas, "eps": eps, **({"fused": True} if fused else {})}
        self._adamw = torch.optim.AdamW(adamw_groups, **adamw_settings)
        # The base class keeps the very group dicts the two optimizers hold (each adds its defaults first).
        super().__init__([*self._inner_groups()], defaults={})
        self._link()

    def _inner_groups(self) -> list[dict[str, Any]]:
        return (self._muon.param_groups if self._muon is not None else []) + self._adamw.param_groups

    def _link(self) -> None:
        """Point the inner optimizers at this optimizer's groups and its one state dict."""

        muon_count = len(self._muon.param_groups) if self._muon is not None else 0
        if self._muon is not None:
            self._muon.param_groups = self.param_groups[:muon_count]
            self._muon.state = self.state
        self._adamw.param_groups = self.param_groups[muon_count:]
        self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # replaces the groups and the state: share them again
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._muon is not None:
            self._muon.step()
        self._adamw.step()
        return loss
