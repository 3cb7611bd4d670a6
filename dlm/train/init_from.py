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
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from dlm.artifacts.checksum import weights_sha256
from dlm.artifacts.hf.foreign import source_shape
from dlm.artifacts.loading import read_model_source
from dlm.config.rope import RopeScaling
from dlm.config.schema import ExperimentConfig, ModelConfig
from dlm.errors import UserError, UserNote
from dlm.model.denoiser import block_size
from dlm.train.distributed import is_sharded

# What fixes the meaning of the weights: their tensors' shapes and the ids of the vocabulary.
SHAPE_FIELDS = (
    "vocab_size",
    "padded_vocab_size",
    "mask_token_id",
    "d_model",
    "n_layers",
    "n_heads",
    "ffn_size",
    "kv_heads",
    "head_dim",
    "qkv_bias",
    "qk_norm",
    "tie_embeddings",
)
# The [model] fields a Hugging Face source brings (`adopt_source_model`): its shape and what its weights
# were trained with. The rest (attention, block_size, shift_logits, max_seq_len, ...) is the run's choice.
ADOPTED_FIELDS = (
    "vocab_size",
    "mask_token_id",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "attention_head_dim",
    "ffn_hidden_size",
    "qkv_bias",
    "qk_norm",
    "tie_embeddings",
    "rope_theta",
    "rope_scaling",
    "norm_eps",
    "pad_vocab_multiple",
)


def model_shape(config: ModelConfig) -> dict[str, int]:
    return {name: int(getattr(config, name)) for name in SHAPE_FIELDS}


def _describe(shape: dict[str, int], other: dict[str, int]) -> str:
    return ", ".join(f"{name}={value}" for name, value in shape.items() if other[name] != value)


def initial_weights(
    path: Path, config: ModelConfig, tokenizer_sha256: str, option: str = "--init-from"
) -> dict[str, Tensor]:
    """The CPU weights of `path` after checking its tokenizer and shape against the new run's;
    `option` names the setting that chose `path` in the errors."""

    info, weights = read_model_source(path, use_ema=True)
    if info.tokenizer_sha256 != tokenizer_sha256:
        raise UserError(
            f"{option}: the model was trained with tokenizer sha256 {info.tokenizer_sha256[:12]}, "
            f"this run uses {tokenizer_sha256[:12]}",
            path=path,
            fix="pack and train with the tokenizer the model was trained with",
        )
    source, target = model_shape(info.model), model_shape(config)
    if source != target:
        raise UserError(
            f"{option}: the model has {_describe(source, target)} but this run's model has {_describe(target, source)}",
            path=path,
            fix="copy the source model's [model] shape into the config",
        )
    if (block_size(info.model), info.model.is_autoregressive) != (block_size(config), config.is_autoregressive):
        # Legitimate (adapting a block model to whole-sequence diffusion, or back), but never silent.
        warnings.warn(
            f"{option}: {path} was trained {_describe_attention(info.model)}; this run trains it "
            f"{_describe_attention(config)} (the weights fit: only what each position attends to changes)",
            UserNote,
            stacklevel=2,
        )
    return weights


def adopt_source_model(experiment: ExperimentConfig, overrides: Iterable[str] = ()) -> ExperimentConfig:
    """The experiment with the `[model]` shape and the tokenizer of its `training.init_from` when that is
    a Hugging Face model (a directory of a family dlm imports, or a `dlm import` of one), so that
    nobody transcribes an 8B model's shape into TOML; a note lists what was replaced. A `--set` among
    `overrides` that contradicts the source is refused. Other sources are left to `initial_weights`."""

    source = experiment.training.init_from
    found = None if source is None else source_shape(Path(source))
    if source is None or found is None:
        return experiment
    model, tokenizer = found
    explicit = {item.partition("=")[0].strip() for item in overrides}
    replaced = {
        name: getattr(model, name) for name in ADOPTED_FIELDS if getattr(model, name) != getattr(experiment.model, name)
    }
    contradicted = [name for name in replaced if f"model.{name}" in explicit]
    if "training.tokenizer" in explicit and Path(experiment.training.tokenizer).resolve() != tokenizer.resolve():
        contradicted.append("tokenizer")
    if contradicted:
        name = contradicted[0]
        value = tokenizer if name == "tokenizer" else replaced[name]
        raise UserError(
            f"--set {'training' if name == 'tokenizer' else 'model'}.{name} contradicts --init-from, "
            f"whose model has {name} = {value}",
            path=source,
            fix="drop that --set: --init-from takes the shape and tokenizer from the source",
        )
    changes = [f"{name} = {_shown(value)}" for name, value in replaced.items()]
    if Path(experiment.training.tokenizer).resolve() != tokenizer.resolve():
        changes.append(f"tokenizer = {tokenizer}")
    if changes:
        warnings.warn(
            f"--init-from {source}: [model] and tokenizer taken from it: {', '.join(changes)}", UserNote, stacklevel=2
        )
    if (model.attention, model.shift_logits, 0) != (
        experiment.model.attention,
        experiment.model.shift_logits,
        experiment.model.block_size,
    ):
        warnings.warn(
            f"--init-from {source}: the model was trained with {_describe_variant(model)}; this run trains "
            f"it with {_describe_variant(experiment.model)}",
            UserNote,
            stacklevel=2,
        )
    model_fields = {**experiment.model.model_dump(), **{name: getattr(model, name) for name in ADOPTED_FIELDS}}
    return experiment.model_copy(
        update={
            "model": ModelConfig.model_validate(model_fields),
            "training": experiment.training.model_copy(update={"tokenizer": tokenizer}),
        }
    )


def _describe_variant(config: ModelConfig) -> str:
    attention = (
        f"block-causal attention (block_size {config.block_size})"
        if config.block_size
        else (f"{config.attention} attention")
    )
    return attention + (", shifted logits" if config.shift_logits else "")


def _shown(value: object) -> str:
    return value.type if isinstance(value, RopeScaling) else str(value)


def _describe_attention(config: ModelConfig) -> str:
    block = block_size(config)
    if block == 0:
        return f"as a whole-sequence model (block_size {config.block_size})"
    if config.is_autoregressive:
        return "as an autoregressive model (block_size 1, causal attention: one pass)"
    kind = "a block diffusion model of one-token blocks" if block == 1 else "a block diffusion model"
    return f"as {kind} (block_size {block})"


@torch.no_grad()
def load_initial_weights(model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy `weights` into `model`'s parameters, each in the parameter's own dtype and device."""

    state = model.state_dict()
    converted = {name: weights[name].to(state[name].dtype) for name in state if name in weights}
    if is_sharded(model):
        # lazy: torch.distributed.checkpoint takes ~0.4 s to import; only a sharded model needs it
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
