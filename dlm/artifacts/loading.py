"""Load any model source without pickle: an exported directory, a checkpoint or a run directory.

`load_model` (and `dlm.load`) reads an exported directory (written by `dlm.artifacts.export`), a training
checkpoint, an inference checkpoint or a run directory (its `latest.pt`); checkpoints go through
`dlm.artifacts.checkpoint.load_checkpoint` (`weights_only=True`) and exports through safetensors, so no path
ever unpickles code. The model it returns carries its noise schedule
(`dlm.diffusion.schedules.model_schedule`), which sampling uses; an export written before the `[diffusion]`
section existed was trained with the linear schedule.

The layout of an exported directory is named in `dlm.artifacts.export_layout`; `dlm.artifacts.export`
writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from tokenizers import Tokenizer
from torch import Tensor

from dlm.artifacts.checkpoint import INFERENCE_FORMAT, TRAINING_FORMAT, check_finite_weights, load_checkpoint
from dlm.artifacts.export_layout import (
    CONFIG_NAME,
    TOKENIZER_NAME,
    WEIGHTS_NAME,
    FieldTypes,
    SourceInfo,
    check_config_fields,
    checked_tokenizer,
    read_export_config,
)
from dlm.artifacts.hf.importer import is_hf_source, read_hf_source
from dlm.artifacts.hf.reader import is_hf_export, read_hf_export
from dlm.artifacts.run_dir import RunDir
from dlm.config.schema import DiffusionConfig, ExperimentConfig, ModelConfig, format_validation_error
from dlm.data.tokenizer import load_tokenizer
from dlm.diffusion.schedules import attach_schedule
from dlm.errors import UserError
from dlm.model.transformer import DiffusionTransformer

# Machine-specific paths stay out of an export (they mean nothing elsewhere and leak home dirs).
_PATH_FIELDS = ("tokenizer", "train_data", "val_data", "output_dir", "init_from")


@dataclass
class LoadedModel:
    """A model ready for inference, its tokenizer, and where it came from."""

    model: DiffusionTransformer
    tokenizer: Tokenizer
    info: SourceInfo


# ------------------------------------------------------------------------------------ reading


def _training_settings(experiment: ExperimentConfig) -> dict[str, Any]:
    return {k: v for k, v in experiment.training.model_dump(mode="json").items() if k not in _PATH_FIELDS}


def _checkpoint_weights(checkpoint: dict[str, Any], path: Path, use_ema: bool) -> tuple[dict[str, Tensor], str]:
    """The model weights of a checkpoint: EMA when present and wanted, else the live ones."""

    weights = dict(checkpoint["model"])
    if checkpoint["format"] == INFERENCE_FORMAT:
        stored = str(checkpoint.get("weights", "live"))
        if stored == "ema" and not use_ema:
            raise UserError(
                "this inference checkpoint holds only the EMA weights",
                path=path,
                fix="use latest.pt (the training checkpoint) for the live weights, or keep --ema",
            )
        return weights, stored
    ema = checkpoint.get("ema")
    if not use_ema or ema is None:
        return weights, "live"
    shadow = ema["shadow"]
    if unknown := sorted(set(shadow) - set(weights)):
        raise UserError(f"the EMA weights name tensors the model lacks ({unknown[:3]})", path=path)
    for name, value in shadow.items():
        weights[name] = value.to(weights[name].dtype)
    return weights, "ema"


def _read_checkpoint(path: Path, use_ema: bool) -> tuple[SourceInfo, dict[str, Tensor]]:
    checkpoint = load_checkpoint(path)
    if path.is_dir():
        path = RunDir(path).latest
    required = ("config", "model", "step", "tokens_seen", "tokenizer_sha256")
    if missing := [key for key in required if key not in checkpoint]:
        raise UserError(f"damaged checkpoint: it lacks {', '.join(missing)}", path=path)
    experiment = ExperimentConfig.from_dict(checkpoint["config"], source=path)
    weights, kind = _checkpoint_weights(checkpoint, path, use_ema)
    info = SourceInfo(
        path=path,
        kind="training" if checkpoint["format"] == TRAINING_FORMAT else "inference",
        model=experiment.model,
        weights=kind,
        step=int(checkpoint["step"]),
        tokens_seen=int(checkpoint["tokens_seen"]),
        tokenizer_sha256=str(checkpoint["tokenizer_sha256"]),
        tokenizer_path=Path(experiment.training.tokenizer),
        diffusion=experiment.diffusion,
        experiment=experiment,
        training=_training_settings(experiment),
    )
    return info, weights


_OBJECT, _TEXT, _COUNT = (dict,), (str,), (int, type(None))
_EXPORT_FIELDS: FieldTypes = {
    "model": _OBJECT, "diffusion": _OBJECT, "training": _OBJECT, "tied": _OBJECT, "source": _OBJECT,
    "step": _COUNT, "tokens_seen": _COUNT, "weights": _TEXT, "tokenizer_sha256": _TEXT, "name": _TEXT,
}  # fmt: skip
def _export_diffusion(config: dict[str, Any]) -> DiffusionConfig:
    """The `[diffusion]` settings of an export; older exports hold only a training mask_eps, and
    were trained with the linear schedule (the only one there was)."""

    if "diffusion" in config:
        return DiffusionConfig.model_validate(config["diffusion"])
    legacy = config.get("training", {}).get("mask_eps")
    return DiffusionConfig() if legacy is None else DiffusionConfig(mask_eps=legacy)


def _read_export(directory: Path) -> tuple[SourceInfo, dict[str, Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_export_config(directory)
    config_path = directory / CONFIG_NAME
    check_config_fields(config, _EXPORT_FIELDS, config_path, required=("model",))
    tied = config.get("tied", {})
    if not all(isinstance(alias, str) and isinstance(name, str) for alias, name in tied.items()):
        raise UserError("the field tied must map tensor names to tensor names", path=config_path)
    try:
        model_config = ModelConfig.model_validate(config["model"])
        diffusion = _export_diffusion(config)
        weights = load_file(str(directory / WEIGHTS_NAME), device="cpu")
    except ValidationError as exc:
        raise UserError(format_validation_error(exc), path=config_path) from None
    except (KeyError, OSError, SafetensorError) as exc:
        raise UserError(f"damaged export: {exc}", path=directory, fix="export the checkpoint again") from None
    if missing := sorted(name for name in tied.values() if name not in weights):
        raise UserError(f"the field tied names tensors {WEIGHTS_NAME} lacks ({missing[:3]})", path=config_path)
    for alias, canonical in tied.items():
        weights[alias] = weights[canonical]  # re-tie what was stored once
    info = SourceInfo(
        path=directory,
        kind="export",
        model=model_config,
        weights=str(config.get("weights", "live")),
        step=config.get("step"),
        tokens_seen=config.get("tokens_seen"),
        tokenizer_sha256=str(config.get("tokenizer_sha256", "")),
        tokenizer_path=directory / TOKENIZER_NAME,
        diffusion=diffusion,
        training=dict(config.get("training", {})),
    )
    return info, weights


def read_model_source(path: str | Path, use_ema: bool = True) -> tuple[SourceInfo, dict[str, Tensor]]:
    """Metadata and CPU weights of an exported dir, a checkpoint file, a run dir (its latest.pt) or a
    Hugging Face model directory of a family dlm imports (`dlm.artifacts.hf.importer`)."""

    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        path = path.parent  # the weights file of an export: the directory is the model
    if path.is_dir() and is_hf_source(path):  # LLaDA, Dream, Llama, Qwen, Mistral: read as data, never run
        info, weights = read_hf_source(path)
        check_finite_weights(weights, path)
        return info, weights
    if path.is_dir() and (path / WEIGHTS_NAME).exists():
        info, weights = read_hf_export(path) if is_hf_export(path) else _read_export(path)
        check_finite_weights(weights, path / WEIGHTS_NAME)  # a checkpoint's are checked as it loads
        return info, weights
    return _read_checkpoint(path, use_ema)


# ------------------------------------------------------------------------------------ building


def _check_weights(expected: dict[str, Tensor], weights: dict[str, Tensor], source: Path) -> None:
    """Refuse weights whose names or shapes do not fit the model config, naming a few of each."""

    missing, extra = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    wrong = [n for n in expected.keys() & weights.keys() if tuple(expected[n].shape) != tuple(weights[n].shape)]
    if missing or extra or wrong:
        raise UserError(
            f"the weights do not fit the model config (missing {missing[:3]}, unexpected {extra[:3]}, "
            f"wrong shape {sorted(wrong)[:3]})",
            path=source,
            fix="the file was written by another model or dlm version; export it again",
        )


def build_model(
    config: ModelConfig,
    weights: dict[str, Tensor],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    source: Path = Path("<weights>"),
) -> DiffusionTransformer:
    """A model in eval mode on `device` holding `weights`; `dtype` None keeps the stored float dtype."""

    if dtype is None:
        dtype = next((t.dtype for t in weights.values() if t.is_floating_point()), torch.float32)
    # Built directly on the device. Its random init is wasted, but building on the meta device
    # instead would import torch._dynamo (seconds) for the meta kernels of the init functions.
    # MPS lacks the float64 the rotary tables are computed in: build on the CPU and move.
    device = torch.device(device)
    with torch.device("cpu" if device.type == "mps" else device):
        model = DiffusionTransformer(config)
    _check_weights(model.state_dict(), weights, source)
    with torch.no_grad():
        for parameter in model.parameters():  # parameters only: the rotary tables stay float32
            parameter.data = parameter.data.to(dtype)
        model.load_state_dict(weights, strict=True)
    return model.to(device).eval()


def load_model_with_info(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, use_ema: bool = True
) -> LoadedModel:
    """Model (eval mode, on `device`), checked tokenizer and metadata of any model source."""

    info, weights = read_model_source(path, use_ema)
    tokenizer = load_tokenizer(checked_tokenizer(info))
    model = build_model(info.model, weights, device, dtype, source=info.path)
    attach_schedule(model, info.diffusion.schedule)
    return LoadedModel(model, tokenizer, info)


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, use_ema: bool = True
) -> tuple[DiffusionTransformer, Tokenizer]:
    """(model, tokenizer) from an exported dir, a checkpoint or a run dir; no pickle involved."""

    loaded = load_model_with_info(path, device, dtype, use_ema)
    return loaded.model, loaded.tokenizer
