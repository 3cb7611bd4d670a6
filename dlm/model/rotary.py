"""Rotary position embeddings: the tables of cos and sin, and the rotation of query and key heads.

Every position's angle is position x frequency per pair of a head's dimensions; `[model] rope_scaling`
(`dlm.config.rope`) rescales the frequencies for a longer context. The transformer (`dlm.model.transformer`)
keeps the tables of its context as buffers and rotates each head's queries and keys with them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dlm.config.rope import RopeScaling
from dlm.config.schema import ModelConfig


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotation angles, [seq_len, head_dim / 2], float32 on the CPU.

    Angles are formed in float64: position x frequency reaches ~1e5 radians for long contexts,
    where float32 would already be off by a hundredth of a radian.
    """

    return rotary_at(torch.arange(seq_len), head_dim, theta, scaling)


def cpu_rotary_tables(config: ModelConfig) -> tuple[Tensor, Tensor]:
    """A model's rotary tables on the CPU, also where a default device (a meta build under FSDP) says
    otherwise: a model given weights keeps tables with values."""

    with torch.device("cpu"):
        return rotary_tables(config.max_seq_len, config.head_dim, config.rope_theta, config.rope_scaling)


def rotary_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> Tensor:
    """The rotation frequency of each pair of a head [head_dim / 2], float64, after `scaling`
    (`dlm.config.rope`: linear divides all of them, llama3 the low ones and blends a middle band)."""

    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    wavelength = 2 * math.pi / inv_freq
    low_band = scaling.original_max_seq_len / scaling.low_freq_factor  # longer wavelengths: divided
    high_band = scaling.original_max_seq_len / scaling.high_freq_factor  # shorter wavelengths: kept
    smooth = (scaling.original_max_seq_len / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelength > low_band, inv_freq / scaling.factor, blended)
    return torch.where(wavelength < high_band, inv_freq, scaled)


def rotary_at(
    positions: Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[Tensor, Tensor]:
    """cos and sin [..., head_dim / 2] at integer `positions` (any shape), float32 on their device."""

    inv_freq = rotary_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def head_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The rotary tables [..., D/2] over a whole head [..., 1, D] for `apply_rotary`: cos twice, and
    sin negated then as it is, broadcast over the heads."""

    return torch.cat((cos, cos), dim=-1).unsqueeze(-2), torch.cat((-sin, sin), dim=-1).unsqueeze(-2)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x_i, x_{i + D/2}) of x [B, L, H, D] by position-dependent angles, with the
    tables of `head_tables` ([L, 1, D] or per row [B, L, 1, D]).

    Computed in float32 (the tables' dtype) and cast back, so bf16 activations do not lose the
    phase information that distinguishes distant positions. x * cos + swap(x) * sin over the whole
    head is x1 cos - x2 sin, x2 cos + x1 sin bit for bit (adding -b is subtracting b), in two
    contiguous products instead of four strided ones over the halves (in eager mode; a compiler may
    fuse either form into multiply-adds).
    """

    wide = x.float()
    x1, x2 = wide.split(x.shape[-1] // 2, dim=-1)
    return (wide * cos).add_(torch.cat((x2, x1), dim=-1).mul_(sin)).type_as(x)
