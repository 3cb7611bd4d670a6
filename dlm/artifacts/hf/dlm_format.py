"""dlm's own models in the Hugging Face format (`dlm export --format hf`), read back as dlm weights and a
`SourceInfo` (needs no transformers). Models of other families are `dlm.artifacts.hf.foreign`'s.

`dlm.load`, `dlm sample` and `dlm export` accept such a directory too, also after `save_pretrained` of
a model fine-tuned with transformers: the config fields are read, not trusted from the metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor

from dlm.artifacts.export_layout import (
    CONFIG_NAME,
    TOKENIZER_NAME,
    WEIGHTS_NAME,
    SourceInfo,
    check_config_fields,
    read_config_json,
    read_distillation,
)
from dlm.artifacts.hf.names import from_hf_names
from dlm.config.schema import DiffusionConfig, ModelConfig, format_validation_error
from dlm.data.tokenizer import tokenizer_sha256
from dlm.errors import UserError

MODEL_TYPE = "dlm_diffusion"


def is_hf_export(directory: str | Path) -> bool:
    """Whether `directory` holds a dlm model in the Hugging Face format."""

    return (read_config_json(Path(directory)) or {}).get("model_type") == MODEL_TYPE


def _model_config(config: dict[str, Any]) -> ModelConfig:
    """dlm's `[model]` from the transformers fields (which a fine-tune may have saved anew)."""

    fields = {
        "vocab_size": config["vocab_size"],
        "d_model": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "ffn_hidden_size": config["intermediate_size"],
        "max_seq_len": config["max_position_embeddings"],
        "rope_theta": config["rope_theta"],
        "norm_eps": config["rms_norm_eps"],
        "mask_token_id": config["mask_token_id"],
        "block_size": config.get("block_size", 0),  # absent from exports of whole-sequence models before it
        "mask_logit": config.get("mask_logit", "plain"),  # absent from exports made before SUBS, all plain
        "document_separator_id": config.get("document_separator_id"),  # absent before document attention
    }
    recorded = dict((config.get("dlm") or {}).get("model") or {})
    padded = config.get("padded_vocab_size", config["vocab_size"])
    if not recorded:  # no record of the padding multiple: the padded size itself reproduces it
        recorded["pad_vocab_multiple"] = padded
    model = ModelConfig.model_validate({**recorded, **fields})
    default_width = model.model_copy(update={"ffn_hidden_size": None})
    if recorded.get("ffn_hidden_size") is None and default_width.ffn_size == model.ffn_size:
        model = default_width  # keep "the default width" as recorded rather than its value
    if model.padded_vocab_size != padded:
        raise UserError(f"padded_vocab_size {padded} does not match the recorded vocabulary padding")
    return model


# The transformers fields `_model_config` needs, and the JSON types of those read outside pydantic.
_HF_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "mask_token_id",
)
_HF_FIELDS = {"dlm": (dict, type(None)), "schedule": (str,), "padded_vocab_size": (int,)}
_HF_DLM_FIELDS = {
    "model": (dict, type(None)),
    "diffusion": (dict,),
    "training": (dict, type(None)),
    "step": (int, type(None)),
    "tokens_seen": (int, type(None)),
    "weights": (str,),
    "distillation": (dict, type(None)),
}


def read_hf_export(directory: Path) -> tuple[SourceInfo, dict[str, Tensor]]:
    """Metadata and dlm-named CPU weights of a Hugging Face export."""

    config = read_config_json(directory) or {}
    path = directory / CONFIG_NAME
    check_config_fields(config, _HF_FIELDS, path, required=_HF_REQUIRED)
    meta = config.get("dlm") or {}
    check_config_fields(meta, _HF_DLM_FIELDS, path, within="dlm.")
    try:
        model = _model_config(config)
        schedule = config.get("schedule", "linear")  # the transformers field wins, as for the shapes
        diffusion = DiffusionConfig.model_validate({**meta.get("diffusion", {}), "schedule": schedule})
        weights = from_hf_names(load_file(str(directory / WEIGHTS_NAME), device="cpu"))
    except ValidationError as exc:
        raise UserError(format_validation_error(exc), path=directory / CONFIG_NAME) from None
    except (KeyError, TypeError, OSError, SafetensorError) as exc:
        raise UserError(f"damaged Hugging Face export: {exc}", path=directory) from None
    tokenizer = directory / TOKENIZER_NAME
    info = SourceInfo.from_record(
        directory,
        "hf",
        model,
        diffusion,
        meta,
        tokenizer,
        # The directory's own tokenizer is the model's: a transformers re-save may reformat its bytes.
        tokenizer_sha256=tokenizer_sha256(tokenizer) if tokenizer.is_file() else "",
        distillation=read_distillation(meta, path),
    )
    return info, weights


def hf_summary(directory: Path) -> dict[str, Any]:
    """The figures `dlm export` reports, read from a Hugging Face export's config and weights."""

    config = read_config_json(directory) or {}
    meta = config.get("dlm") or {}
    with safe_open(str(directory / WEIGHTS_NAME), framework="pt") as weights:
        parameters = sum(_numel(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118
    tokenizer = directory / TOKENIZER_NAME
    return {
        "parameters": parameters,
        "dtype": config.get("torch_dtype"),
        "weights": meta.get("weights"),
        "step": meta.get("step"),
        "tokens_seen": meta.get("tokens_seen"),
        "tokenizer_sha256": tokenizer_sha256(tokenizer) if tokenizer.is_file() else None,
    }


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
