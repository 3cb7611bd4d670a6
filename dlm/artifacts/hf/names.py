"""The weight names of the Hugging Face format: dlm's state-dict names <-> the names modeling_dlm.py uses."""

from __future__ import annotations

import re

from torch import Tensor

from dlm.artifacts.hf.families import TRANSFORMERS_BLOCK, TRANSFORMERS_TOP
from dlm.errors import UserError

# The transformers families' names (`dlm.artifacts.hf.families`), with dlm's fused q/k/v and gate/up
# matmuls under their own names: the head is the tied embedding.
TOP_NAMES = {name: TRANSFORMERS_TOP[name] for name in ("token_embedding.weight", "norm.weight")}
BLOCK_NAMES = {
    "attention_norm.weight": TRANSFORMERS_BLOCK["attention_norm"],
    "attention.qkv.weight": "self_attn.qkv_proj.weight",
    "attention.out.weight": TRANSFORMERS_BLOCK["out"],
    "mlp_norm.weight": TRANSFORMERS_BLOCK["mlp_norm"],
    "mlp.gate_up.weight": "mlp.gate_up_proj.weight",
    "mlp.down.weight": TRANSFORMERS_BLOCK["down"],
}


def rename_weight(name: str, top: dict[str, str], block: dict[str, str], block_from: str, block_to: str) -> str:
    """`name` under the other naming: `top` maps whole names, `block` the names inside each numbered block."""

    if name in top:
        return top[name]
    match = re.fullmatch(rf"{re.escape(block_from)}(\d+)\.(.+)", name)
    if match is None or match[2] not in block:
        raise UserError(f"unexpected weight {name!r}: not a dlm diffusion transformer")
    return f"{block_to}{match[1]}.{block[match[2]]}"


def to_hf_names(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """dlm's state-dict names -> the names modeling_dlm.py uses."""

    return {rename_weight(name, TOP_NAMES, BLOCK_NAMES, "blocks.", "model.layers."): t for name, t in weights.items()}


def from_hf_names(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The names modeling_dlm.py uses -> dlm's state-dict names."""

    top = {hf: name for name, hf in TOP_NAMES.items()}
    block = {hf: name for name, hf in BLOCK_NAMES.items()}
    return {rename_weight(name, top, block, "model.layers.", "blocks."): t for name, t in weights.items()}
