"""`training.init_from` (`dlm train --init-from MODEL`): start a new run from a trained model's weights.

Only the weights are taken (the EMA's when the source has one, as evaluation and export use them):
the optimizer, the learning-rate schedule, the counters and the data order start afresh. The
source must have been trained with the very tokenizer file of the new run (sha256) and have the
same model shape, else its token ids or tensors would mean something else; a refusal names both
sides. The block size is no part of the shape (no tensor depends on it): a block diffusion model may
start a whole-sequence run, or the reverse (a legitimate adaptation), and a warning says so. The
path stays in the run's config, yet a resume restores the run's own checkpoint and never reads the
source again, so a fine-tuning run resumes exactly like any other. A LoRA run (`[training.lora]`) is the
exception: its checkpoints hold the adapters alone, so its resume reads the source, its frozen base,
again, and refuses one whose weights' sha256 changed.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from dlm.artifacts.checksum import weights_sha256
from dlm.config.schema import ModelConfig
from dlm.errors import UserError, UserNote
from dlm.model.denoiser import block_size

# What fixes the meaning of the weights: their tensors' shapes and the ids of the vocabulary.
SHAPE_FIELDS = ("vocab_size", "padded_vocab_size", "mask_token_id", "d_model", "n_layers", "n_heads", "ffn_size")


def model_shape(config: ModelConfig) -> dict[str, int]:
    return {name: int(getattr(config, name)) for name in SHAPE_FIELDS}


def _describe(shape: dict[str, int], other: dict[str, int]) -> str:
    return ", ".join(f"{name}={value}" for name, value in shape.items() if other[name] != value)


def initial_weights(path: Path, config: ModelConfig, tokenizer_sha256: str) -> dict[str, Tensor]:
    """The CPU weights of `path` after checking its tokenizer and shape against the new run's."""

    from dlm.artifacts.loading import read_model_source  # imports the export readers: only when asked for

    info, weights = read_model_source(path, use_ema=True)
    if info.tokenizer_sha256 != tokenizer_sha256:
        raise UserError(
            f"--init-from: the model was trained with tokenizer sha256 {info.tokenizer_sha256[:12]}, "
            f"this run uses {tokenizer_sha256[:12]}",
            path=path,
            fix="pack and train with the tokenizer the model was trained with",
        )
    source, target = model_shape(info.model), model_shape(config)
    if source != target:
        raise UserError(
            f"--init-from: the model has {_describe(source, target)} but this run's model has "
            f"{_describe(target, source)}",
            path=path,
            fix="copy the source model's [model] shape into the config",
        )
    if block_size(info.model) != block_size(config):
        # Legitimate (adapting a block model to whole-sequence diffusion, or back), but never silent.
        warnings.warn(
            f"--init-from: {path} was trained {_describe_attention(info.model)}; this run trains it "
            f"{_describe_attention(config)} (the weights fit: only what each position attends to changes)",
            UserNote,
            stacklevel=2,
        )
    return weights


def _describe_attention(config: ModelConfig) -> str:
    block = block_size(config)
    if block == 0:
        return f"as a whole-sequence model (block_size {config.block_size})"
    kind = "an autoregressive model" if block == 1 else "a block diffusion model"
    return f"as {kind} (block_size {block})"


@torch.no_grad()
def load_initial_weights(model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy `weights` into `model`'s parameters, each in the parameter's own dtype and device."""

    from dlm.train.distributed import is_sharded

    state = model.state_dict()
    converted = {name: weights[name].to(state[name].dtype) for name in state if name in weights}
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, cast(dict[str, Any], converted), options=StateDictOptions(full_state_dict=True))
        return
    model.load_state_dict(converted, strict=True)


def lora_base_record(source: Path, weights: dict[str, Tensor]) -> dict[str, str]:
    """What a LoRA run's checkpoints record of the base its adapters need: its path and its weights' sha256."""

    return {"path": str(source), "sha256": weights_sha256(weights)}


def checked_lora_base(recorded: object, weights: dict[str, Tensor] | None, checkpoint: Path) -> dict[str, str]:
    """A LoRA checkpoint's record of its base, refused unless `weights` (read again from
    `training.init_from`) are the weights it names."""

    record = recorded if isinstance(recorded, dict) else {}
    found = None if weights is None else weights_sha256(weights)
    if found is None or record.get("sha256") != found:
        raise UserError(
            f"training.init_from is not the base model this LoRA run was trained on (its weights' sha256 is "
            f"{'unknown' if found is None else found[:12]}, the checkpoint recorded {str(record.get('sha256'))[:12]})",
            path=checkpoint,
            fix=f"point training.init_from at the run's base model ({record.get('path')}), unchanged",
        )
    return {"path": str(record.get("path")), "sha256": found}
