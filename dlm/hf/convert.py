"""Hugging Face transformers format: write it (`dlm export --format hf`) and read it back.

An HF export is a directory that `AutoModelForMaskedLM.from_pretrained(dir, trust_remote_code=True)`
and `AutoTokenizer.from_pretrained(dir)` load without dlm:

    config.json              model_type "dlm_diffusion", auto_map, the shapes; dlm's own settings under "dlm"
    configuration_dlm.py     the config class       } copied from this package: they import only
    modeling_dlm.py          the model and sampler  } torch and transformers
    model.safetensors        the weights under transformers-style names, the tied embedding once
    tokenizer.json           the tokenizer the model was trained with (byte for byte)
    tokenizer_config.json    PreTrainedTokenizerFast with the eos / mask / pad special tokens
    special_tokens_map.json
    README.md                how to load and sample it

Writing needs no transformers. Reading (`read_hf_export`) turns the directory back into dlm weights
and a `SourceInfo`, so `dlm.load`, `dlm sample` and `dlm export` accept it too (also after
`save_pretrained` of a model fine-tuned with transformers: the config fields are read, not trusted
from the metadata). A block diffusion model (`[model] block_size`) exports with its block size: the
bundled file attends block-causally and samples block by block, as dlm's inference does. Refused:
noise schedules other than linear and cosine, which the bundled sampler does not implement.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dlm import __version__
from dlm.config.schema import DiffusionConfig, ModelConfig
from dlm.data.tokenizer import SPECIAL_TOKENS, tokenizer_sha256
from dlm.errors import UserError, reported_os_errors
from dlm.export import EXPORT_FILES, check_export_output
from dlm.fileio import swap_directory_into_place, temporary_path
from dlm.loading import (
    CONFIG_NAME,
    EXPORT_FORMAT,
    TOKENIZER_NAME,
    WEIGHTS_NAME,
    SourceInfo,
    check_config_fields,
    checked_tokenizer,
    read_model_source,
)

HF_FORMAT = "dlm-hf-v1"
MODEL_TYPE = "dlm_diffusion"
CODE_FILES = ("configuration_dlm.py", "modeling_dlm.py")
# The schedules modeling_dlm.py's sampler implements (its SCHEDULES; a test keeps them equal).
HF_SCHEDULES = ("linear", "cosine")
AUTO_MAP = {
    "AutoConfig": "configuration_dlm.DlmDiffusionConfig",
    "AutoModel": "modeling_dlm.DlmDiffusionModel",
    "AutoModelForMaskedLM": "modeling_dlm.DlmDiffusionForMaskedLM",
}
_TOP_NAMES = {"token_embedding.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_BLOCK_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.qkv.weight": "self_attn.qkv_proj.weight",
    "attention.out.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_up.weight": "mlp.gate_up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ------------------------------------------------------------------------------------ names


def _rename(name: str, top: dict[str, str], block: dict[str, str], block_from: str, block_to: str) -> str:
    if name in top:
        return top[name]
    match = re.fullmatch(rf"{re.escape(block_from)}(\d+)\.(.+)", name)
    if match is None or match[2] not in block:
        raise UserError(f"unexpected weight {name!r}: not a dlm diffusion transformer")
    return f"{block_to}{match[1]}.{block[match[2]]}"


def to_hf_names(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """dlm's state-dict names -> the names modeling_dlm.py uses."""

    return {_rename(name, _TOP_NAMES, _BLOCK_NAMES, "blocks.", "model.layers."): t for name, t in weights.items()}


def from_hf_names(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The names modeling_dlm.py uses -> dlm's state-dict names."""

    top = {hf: name for name, hf in _TOP_NAMES.items()}
    block = {hf: name for name, hf in _BLOCK_NAMES.items()}
    return {_rename(name, top, block, "model.layers.", "blocks."): t for name, t in weights.items()}


# ------------------------------------------------------------------------------------ writing


def check_hf_exportable(model: ModelConfig, diffusion: DiffusionConfig) -> None:
    """Refuse what the bundled modeling file cannot reproduce."""

    if diffusion.schedule not in HF_SCHEDULES:
        raise UserError(
            f"the {diffusion.schedule!r} noise schedule has no sampler in the Hugging Face modeling file "
            f"(it has {', '.join(HF_SCHEDULES)})",
            fix="export it in dlm's own format (omit --format hf)",
        )


def hf_config(info: SourceInfo, dtype: str, special_ids: dict[str, int]) -> dict[str, Any]:
    """config.json: the transformers fields, and dlm's own settings under "dlm" for the way back."""

    model = info.model
    return {
        "architectures": ["DlmDiffusionForMaskedLM"],
        "model_type": MODEL_TYPE,
        "auto_map": AUTO_MAP,
        "vocab_size": model.vocab_size,
        "padded_vocab_size": model.padded_vocab_size,
        "hidden_size": model.d_model,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "intermediate_size": model.ffn_size,
        "max_position_embeddings": model.max_seq_len,
        "rope_theta": model.rope_theta,
        "rms_norm_eps": model.norm_eps,
        "initializer_range": model.init_std,
        "mask_token_id": model.mask_token_id,
        "eos_token_id": special_ids["eos"],
        "pad_token_id": special_ids["pad"],
        "schedule": info.diffusion.schedule,
        "block_size": model.block_size,
        "mask_logit": model.mask_logit,  # modeling_dlm.py applies SUBS to its logits when it is "subs"
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "dlm": {
            "format": HF_FORMAT,
            "dlm_version": __version__,
            "model": model.model_dump(mode="json"),
            "diffusion": info.diffusion.model_dump(mode="json"),
            "weights": info.weights,
            "step": info.step,
            "tokens_seen": info.tokens_seen,
            "training": info.training,
        },
    }


def tokenizer_files(max_seq_len: int) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json and special_tokens_map.json declaring dlm's special tokens."""

    special = {"eos_token": SPECIAL_TOKENS["eos"], "mask_token": SPECIAL_TOKENS["mask"],
               "pad_token": SPECIAL_TOKENS["pad"]}  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
    }
    return {"tokenizer_config.json": config, "special_tokens_map.json": special}


def hf_card(name: str) -> str:
    return "\n".join([
        f"# {name}",
        "",
        "A masked discrete diffusion language model trained with dlm, in the Hugging Face transformers format.",
        "",
        "```python",
        "from transformers import AutoModelForMaskedLM, AutoTokenizer",
        "",
        f'model = AutoModelForMaskedLM.from_pretrained("{name}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
        'prompt = tokenizer("ROMEO:", return_tensors="pt").input_ids',
        "ids = model.generate(prompt, max_new_tokens=32, steps=32, seed=0)",
        "print(tokenizer.decode(ids[0]))",
        "```",
        "",
    ])  # fmt: skip


def _write(directory: Path, name: str, stored: dict[str, Tensor], config: dict[str, Any], tokenizer: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir()
    save_file(stored, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "dlm_format": HF_FORMAT})
    os.chmod(directory / WEIGHTS_NAME, 0o644)  # safetensors creates 0600; an export is for sharing
    shutil.copyfile(tokenizer, directory / TOKENIZER_NAME)
    for name in CODE_FILES:
        shutil.copyfile(Path(__file__).with_name(name), directory / name)
    for name, content in tokenizer_files(config["max_position_embeddings"]).items():
        (directory / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    (directory / "README.md").write_text(hf_card(name), encoding="utf-8")
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def export_hf(source: str | Path, output: str | Path, dtype: str = "bfloat16", use_ema: bool = True,
              overwrite: bool = False) -> Path:  # fmt: skip
    """Write a Hugging Face directory from a checkpoint, a run dir, a dlm export or an HF export."""

    output = Path(output)
    if dtype not in _DTYPES:
        raise UserError(f"unknown export dtype {dtype!r}", fix=f"use one of {', '.join(_DTYPES)}")
    ours = {*EXPORT_FILES, *CODE_FILES, *tokenizer_files(1)}  # a dlm export or an HF one may be replaced
    check_export_output(output, overwrite, lambda path: is_hf_export(path) or _is_dlm_export(path), "an export", ours)
    info, weights = read_model_source(source, use_ema)
    check_hf_exportable(info.model, info.diffusion)
    tokenizer = checked_tokenizer(info)
    from dlm.data.tokenizer import load_tokenizer, special_token_id

    loaded = load_tokenizer(tokenizer)
    special_ids = {name: special_token_id(loaded, name) for name in SPECIAL_TOKENS}
    stored = {name: t.detach().to("cpu", _DTYPES[dtype]).contiguous() for name, t in to_hf_names(weights).items()}
    config = hf_config(info, dtype, special_ids)
    building = temporary_path(output)
    with reported_os_errors("the export", output):
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(building, ignore_errors=True)
        try:
            _write(building, output.name, stored, config, tokenizer)
            swap_directory_into_place(building, output)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return output


# ------------------------------------------------------------------------------------ reading


def _read_config(directory: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((directory / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return config if isinstance(config, dict) else None


def _is_dlm_export(directory: Path) -> bool:
    return (_read_config(directory) or {}).get("format") == EXPORT_FORMAT


def is_hf_export(directory: str | Path) -> bool:
    """Whether `directory` holds a dlm model in the Hugging Face format."""

    return (_read_config(Path(directory)) or {}).get("model_type") == MODEL_TYPE


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
_HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "rope_theta", "rms_norm_eps", "mask_token_id")  # fmt: skip
_HF_FIELDS = {"dlm": (dict, type(None)), "schedule": (str,), "padded_vocab_size": (int,)}
_HF_DLM_FIELDS = {"model": (dict, type(None)), "diffusion": (dict,), "training": (dict, type(None)),
                  "step": (int, type(None)), "tokens_seen": (int, type(None)), "weights": (str,)}  # fmt: skip


def read_hf_export(directory: Path) -> tuple[SourceInfo, dict[str, Tensor]]:
    """Metadata and dlm-named CPU weights of a Hugging Face export."""

    from pydantic import ValidationError
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from dlm.config.schema import format_validation_error

    config = _read_config(directory) or {}
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
    info = SourceInfo(
        path=directory,
        kind="hf",
        model=model,
        weights=str(meta.get("weights", "live")),
        step=meta.get("step"),
        tokens_seen=meta.get("tokens_seen"),
        # The directory's own tokenizer is the model's: a transformers re-save may reformat its bytes.
        tokenizer_sha256=tokenizer_sha256(tokenizer) if tokenizer.is_file() else "",
        tokenizer_path=tokenizer,
        diffusion=diffusion,
        training=dict(meta.get("training") or {}),
    )
    return info, weights


def hf_summary(directory: Path) -> dict[str, Any]:
    """The figures `dlm export` reports, read from a Hugging Face export's config and weights."""

    from safetensors import safe_open

    config = _read_config(directory) or {}
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
