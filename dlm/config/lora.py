"""`[training.lora]`: low-rank adapters (LoRA, through the `peft` package) on a trained model.

A LoRA run trains small matrices A (rank x in) and B (out x rank) beside the chosen Linear
layers, `W x + (alpha / rank) B A x`, and freezes every weight of the model it starts from
(`training.init_from`). Its checkpoints hold the adapters and their optimizer state only, with
the sha256 of the base weights; `dlm export` merges the adapters into plain weights. The names of
`target_modules` are checked against the model itself (`dlm.model.lora`), which knows its layers;
this module stays torch-free like the rest of the config.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Every Linear layer of a transformer block (`dlm.model.transformer`): fused q/k/v, attention output,
# fused SwiGLU gate / up, SwiGLU down.
DEFAULT_TARGETS = ("qkv", "out", "gate_up", "down")


class LoraConfig(BaseModel):
    """Low-rank adapters on a trained model (`training.init_from`): the base weights stay frozen and only
    the adapters train (the `lora` extra installs `peft`). Off unless `rank` > 0."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    rank: int = Field(
        0, ge=0, le=4096, description="Rank r of each adapter; 0 (default) trains every weight, no adapters."
    )
    alpha: float = Field(16.0, gt=0, description="Scale of the adapters' output: alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on an adapter's input while training.")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        min_length=1,
        description="Names of the Linear layers that get adapters, in every block: "
        f"{', '.join(DEFAULT_TARGETS)} (all of them by default); with --set, comma-separated.",
    )
    base_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Storage dtype of the frozen Linear weights. bfloat16 halves their memory (an 8B model fits "
        "one 24 GiB GPU) and needs training.precision = bfloat16, whose matmuls round them to bfloat16 anyway; "
        "the embedding, the norms and the adapters stay float32.",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split_names(cls, value: object) -> object:
        # `--set training.lora.target_modules=qkv,out`: a comma-separated string is the list.
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0
