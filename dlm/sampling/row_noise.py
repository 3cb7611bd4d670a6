"""The random streams of a sampling batch: one generator per group of rows.

A batch of one prompt (its `num_samples` rows) draws from one generator, as it always has. A batch
of several prompts gives each prompt its own generator and draws every random number of a row
from its prompt's generator, in the order a batch of that prompt alone would draw them. So a
prompt's random numbers do not depend on which other prompts share the batch: prompt i of a list
sampled with seed S draws exactly those of the prompt sampled alone with seed S + i (its tokens
agree up to float rounding, docs/reproducibility.md).

Draws are sequential on a generator (a draw of a + b numbers equals a draw of a then one of b),
which is what lets a group's share of a batched draw be cut out and drawn on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RowNoise:
    """Generators, each serving `sizes[i]` consecutive rows of the batch."""

    generators: tuple[torch.Generator, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.generators) != len(self.sizes) or not self.generators:
            raise ValueError("one group size per generator, at least one generator")

    @classmethod
    def of(cls, generator: torch.Generator | RowNoise, rows: int) -> RowNoise:
        """`generator` as the one stream of all `rows` rows (a `RowNoise` is returned as it is)."""

        return generator if isinstance(generator, RowNoise) else cls((generator,), (rows,))

    @property
    def device(self) -> torch.device:
        return self.generators[0].device

    def _draw(self, counts: list[int], shape: tuple[int, ...]) -> Tensor:
        if len(self.generators) == 1:  # the draw a single-prompt batch has always made
            return torch.rand(
                (counts[0], *shape), dtype=torch.float64, device=self.device, generator=self.generators[0]
            )
        parts = [
            torch.rand((count, *shape), dtype=torch.float64, device=self.device, generator=generator)
            for generator, count in zip(self.generators, counts, strict=True)
        ]
        return torch.cat(parts)

    def per_row(self, shape: tuple[int, ...]) -> Tensor:
        """Uniform float64 draws of `shape` [rows, ...] (every row of the batch), row r from its group."""

        if shape[0] != sum(self.sizes):
            raise ValueError(f"a draw for {shape[0]} rows from a batch of {sum(self.sizes)}")
        return self._draw(list(self.sizes), tuple(shape[1:]))

    def stacked(self, counts: Tensor | list[int], width: int) -> Tensor:
        """Uniform float64 draws [sum(counts), width]: `counts[r]` rows of `width` for batch row r, in row order."""

        per_row = counts.tolist() if isinstance(counts, Tensor) else counts
        bounds = [0]
        for size in self.sizes:
            bounds.append(bounds[-1] + size)
        groups = [sum(per_row[bounds[i] : bounds[i + 1]]) for i in range(len(self.sizes))]
        return self._draw(groups, (width,))


def noise_device(device: torch.device) -> torch.device:
    """The device of the sampling noise and its generators for a model on `device`."""

    # MPS has no float64, so the sampling noise (and the generator) live on the CPU there.
    return torch.device("cpu") if device.type == "mps" else device
