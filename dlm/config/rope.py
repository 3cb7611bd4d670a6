"""`[model.rope_scaling]`: how the rotary frequencies are stretched for contexts longer than trained.

Two kinds, those of the checkpoints dlm imports: `linear` divides every frequency by `factor`
(position interpolation); `llama3` divides only the low frequencies (wavelengths above
`original_max_seq_len / low_freq_factor`) by `factor`, keeps the high ones (below
`original_max_seq_len / high_freq_factor`) and blends in between (Llama 3.1). Other kinds (yarn,
dynamic, longrope) change more than the frequencies and are refused where a checkpoint is read.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RopeScalingKind = Literal["linear", "llama3"]


class RopeScaling(BaseModel):
    """Rotary frequency scaling; `dlm.model.rotary.rotary_frequencies` applies it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: RopeScalingKind = Field(description="linear or llama3.")
    factor: float = Field(gt=0, description="How many times longer the context is than trained.")
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: wavelengths above original / this are divided.")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: wavelengths below original / this are kept.")
    original_max_seq_len: int = Field(8192, ge=1, description="llama3: the context length trained before scaling.")

    @model_validator(mode="after")
    def _check_band(self) -> RopeScaling:
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling: high_freq_factor must be above low_freq_factor")
        return self
