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

import contextlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import Tensor

from dlm.artifacts.checkpoint import INFERENCE_FORMAT, TRAINING_FORMAT, check_finite_weights, load_checkpoint
from dlm.artifacts.checksum import weights_sha256
from dlm.artifacts.export_layout import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_FORMAT,
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    TOKENIZER_NAME,
    WEIGHTS_NAME,
    FieldTypes,
    SourceInfo,
    check_config_fields,
    is_dlm_export,
    load_checked_tokenizer,
    read_distillation,
    read_export_config,
)
from dlm.artifacts.hf.dlm_format import is_hf_export, read_hf_export
from dlm.artifacts.hf.foreign import Placement, is_hf_source, read_hf_source
from dlm.artifacts.run_dir import RunDir
from dlm.artifacts.sharded_checkpoint import ShardedWeights, is_sharded_checkpoint, open_sharded_weights
from dlm.config.lora import LoraConfig
from dlm.config.schema import DiffusionConfig, ExperimentConfig, ModelConfig, format_validation_error
from dlm.diffusion.distillation import attach_distilled_steps
from dlm.diffusion.schedules import attach_schedule
from dlm.errors import UserError
from dlm.model.lora import from_peft_names, merged_weights
from dlm.model.transformer import DiffusionTransformer
from dlm.runtime.device import inference_dtype

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

    if "model" not in checkpoint:
        raise UserError("this checkpoint holds no model weights", path=path, fix="pass a checkpoint a dlm run saved")
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


def checkpoint_lora(checkpoint: dict[str, Any], experiment: ExperimentConfig) -> tuple[LoraConfig | None, Any]:
    """A LoRA run's adapter settings and its recorded base (`{"path", "sha256"}`); (None, None) otherwise."""

    lora = experiment.training.lora
    return (lora, checkpoint.get("lora_base")) if lora.enabled else (None, None)


def _checkpoint_info(checkpoint: dict[str, Any], path: Path, kind: str, holds_model: bool = True) -> SourceInfo:
    """What a checkpoint says of itself; `holds_model`: its weights are in it (not in shards)."""

    fields = ("config", "model", "step", "tokens_seen", "tokenizer_sha256")
    required = [name for name in fields if holds_model or name != "model"]
    if missing := [key for key in required if key not in checkpoint]:
        raise UserError(f"damaged checkpoint: it lacks {', '.join(missing)}", path=path)
    experiment = ExperimentConfig.from_dict(checkpoint["config"], source=path)
    return SourceInfo(
        path=path,
        kind="training" if checkpoint.get("format", TRAINING_FORMAT) == TRAINING_FORMAT else "inference",
        model=experiment.model,
        weights=kind,
        step=int(checkpoint["step"]),
        tokens_seen=int(checkpoint["tokens_seen"]),
        tokenizer_sha256=str(checkpoint["tokenizer_sha256"]),
        tokenizer_path=Path(experiment.training.tokenizer),
        diffusion=experiment.diffusion,
        experiment=experiment,
        training=_training_settings(experiment),
        distillation=None if experiment.distill is None else experiment.distill.record(int(checkpoint["step"])),
    )


def _checkpoint_path(path: Path) -> Path:
    """A run directory means its latest checkpoint, of either format."""

    return RunDir(path).latest_checkpoint() if path.is_dir() and not is_sharded_checkpoint(path) else path


def sharded_model_source(path: str | Path, use_ema: bool = True) -> tuple[SourceInfo, ShardedWeights] | None:
    """Metadata and lazily read weights of a sharded checkpoint (or a run directory whose latest
    checkpoint is sharded); None for any other source. The files are verified, no tensor is read."""

    path = _checkpoint_path(Path(path))
    if not is_sharded_checkpoint(path):
        return None
    weights = open_sharded_weights(path, use_ema)
    return _checkpoint_info(weights.record, weights.directory, weights.kind, holds_model=False), weights


def _read_checkpoint(path: Path, use_ema: bool, merge: bool) -> tuple[SourceInfo, dict[str, Tensor]]:
    sharded = sharded_model_source(path, use_ema)
    if sharded is not None:
        info, lazy = sharded
        weights = {name: lazy.read(name) for name in lazy.names}
        check_finite_weights(weights, info.path, step=info.step)
        return info, weights
    path = _checkpoint_path(path)
    checkpoint = load_checkpoint(path)
    info = _checkpoint_info(checkpoint, path, "")
    weights, kind = _checkpoint_weights(checkpoint, path, use_ema)
    assert info.experiment is not None  # a checkpoint's info always holds its config
    lora, lora_base = checkpoint_lora(checkpoint, info.experiment)
    info = replace(info, weights=kind, lora=lora, lora_base=lora_base)
    return info, _merged_if_asked(info, weights, merge)


_OBJECT, _TEXT, _COUNT = (dict,), (str,), (int, type(None))
_EXPORT_FIELDS: FieldTypes = {
    "model": _OBJECT,
    "diffusion": _OBJECT,
    "training": _OBJECT,
    "tied": _OBJECT,
    "source": _OBJECT,
    "step": _COUNT,
    "tokens_seen": _COUNT,
    "weights": _TEXT,
    "tokenizer_sha256": _TEXT,
    "name": _TEXT,
    "distillation": (dict, type(None)),
}


def _export_diffusion(config: dict[str, Any]) -> DiffusionConfig:
    """The `[diffusion]` settings of an export; older exports hold only a training mask_eps, and
    were trained with the linear schedule (the only one there was)."""

    if "diffusion" in config:
        return DiffusionConfig.model_validate(config["diffusion"])
    legacy = config.get("training", {}).get("mask_eps")
    return DiffusionConfig() if legacy is None else DiffusionConfig(mask_eps=legacy)


def _read_export(directory: Path) -> tuple[SourceInfo, dict[str, Tensor]]:
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
    info = SourceInfo.from_record(
        directory,
        "export",
        model_config,
        diffusion,
        config,
        directory / TOKENIZER_NAME,
        distillation=read_distillation(config, config_path),
    )
    return info, weights


def read_adapter_config(directory: Path) -> dict[str, Any]:
    """The `dlm` section of an adapter export's `adapter_config.json`, its fields checked."""

    path = directory / ADAPTER_CONFIG_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"unreadable {ADAPTER_CONFIG_NAME}: {exc}", path=path) from None
    dlm = config.get("dlm") if isinstance(config, dict) else None
    if not isinstance(dlm, dict) or dlm.get("format") != ADAPTER_FORMAT:
        raise UserError(f"not a dlm adapter export: it lacks dlm.format {ADAPTER_FORMAT!r}", path=path)
    check_config_fields(
        dlm,
        {**_EXPORT_FIELDS, "lora": _OBJECT, "base": _OBJECT},
        path,
        required=("model", "lora", "base"),
        within="dlm.",
    )
    return dlm


def _read_adapter_export(directory: Path) -> tuple[SourceInfo, dict[str, Tensor]]:
    """The adapters of `dlm export --adapters-only` (peft's names turned back into the model's)."""

    path = directory / ADAPTER_CONFIG_NAME
    dlm = read_adapter_config(directory)
    try:
        model, lora = ModelConfig.model_validate(dlm["model"]), LoraConfig.model_validate(dlm["lora"])
        diffusion = _export_diffusion(dlm)
        adapters = from_peft_names(load_file(str(directory / ADAPTER_WEIGHTS_NAME), device="cpu"))
    except ValidationError as exc:
        raise UserError(format_validation_error(exc), path=path) from None
    except (OSError, SafetensorError) as exc:
        raise UserError(f"damaged adapter export: {exc}", path=directory, fix="export the adapters again") from None
    info = SourceInfo.from_record(
        directory, "adapters", model, diffusion, dlm, directory / TOKENIZER_NAME, lora=lora, lora_base=dlm["base"]
    )
    return info, adapters


def _merged_if_asked(info: SourceInfo, weights: dict[str, Tensor], merge: bool) -> dict[str, Tensor]:
    """Plain weights: a LoRA source's adapters merged onto the base model it records (read again, and
    refused unless its weights' sha256 is the recorded one)."""

    if info.lora is None or not merge:
        return weights
    record = info.lora_base if isinstance(info.lora_base, dict) else {}
    base_path, sha256 = record.get("path"), record.get("sha256")
    if not isinstance(base_path, str) or not isinstance(sha256, str):
        raise UserError("damaged LoRA source: it does not name the base model of its adapters", path=info.path)
    if not Path(base_path).exists():
        raise UserError(
            f"the base model of these LoRA adapters is missing: {base_path}",
            path=info.path,
            fix="restore the base model there (an adapter export needs it), or export merged weights where it is",
        )
    _, base = read_model_source(base_path)
    if (found := weights_sha256(base)) != sha256:
        raise UserError(
            f"the base model at {base_path} has changed since the adapters were trained on it (its weights' "
            f"sha256 is {found[:12]}, the adapters recorded {sha256[:12]})",
            path=info.path,
            fix="restore the base model the adapters were trained on",
        )
    return merged_weights(info.model, info.lora, base, weights)


def read_model_source(
    path: str | Path, use_ema: bool = True, merge_adapters: bool = True, place: Placement | None = None
) -> tuple[SourceInfo, dict[str, Tensor]]:
    """Metadata and CPU weights of an exported dir, an adapter export, a checkpoint file, a run dir (its
    latest checkpoint) or a Hugging Face model directory of a family dlm imports (`dlm.artifacts.hf.foreign`).
    A LoRA source's adapters come merged onto their base model unless `merge_adapters` is false (then the
    weights are the adapters alone, and `info.lora` says so). `place`, for a Hugging Face directory, takes
    each tensor as it is read (to its device and dtype), so the source is never held whole."""

    path = Path(path)
    if path.is_dir() and (path / ADAPTER_CONFIG_NAME).is_file():
        info, adapters = _read_adapter_export(path)
        return info, _merged_if_asked(info, adapters, merge_adapters)
    if path.is_file() and path.suffix == ".safetensors":
        path = path.parent  # the weights file of an export: the directory is the model
    if path.is_dir() and is_hf_source(path):  # LLaDA, Dream, Llama, Qwen, Mistral: read as data, never run
        # Its shapes, dtypes and finiteness are checked as it is read.
        return read_hf_source(path) if place is None else read_hf_source(path, place)
    if path.is_dir() and (path / WEIGHTS_NAME).exists():
        info, weights = read_hf_export(path) if is_hf_export(path) else _read_export(path)
        check_finite_weights(weights, path / WEIGHTS_NAME)  # a checkpoint's are checked as it loads
        return info, weights
    if path.is_dir() and (is_hf_export(path) or is_dlm_export(path)):  # an export without its weights
        pickled = [found.name for found in path.glob("*.bin")]
        raise UserError(
            f"the export's {WEIGHTS_NAME} is missing"
            + (f" ({', '.join(pickled)} is pickle: dlm refuses it)" if pickled else ""),
            path=path,
            fix="export the model again (dlm export RUN --output DIR)",
        )
    return _read_checkpoint(path, use_ema, merge_adapters)


# ------------------------------------------------------------------------------------ building


def check_weight_shapes(config: ModelConfig, shapes: Mapping[str, Sequence[int]], source: Path) -> None:
    """Refuse weights, by their names and `shapes`, that do not fit `config`, as loading them would: what an
    export checks before it writes them, so that it never writes a model nothing can load."""

    small = sum(math.prod(shape) for shape in shapes.values()) < _META_BUILD_MIN_PARAMETERS
    with contextlib.nullcontext() if small else torch.device("meta"):  # see _META_BUILD_MIN_PARAMETERS
        expected = DiffusionTransformer(config).state_dict()
    _check_shapes({name: tuple(tensor.shape) for name, tensor in expected.items()}, shapes, source)


def _check_weights(expected: dict[str, Tensor], weights: dict[str, Tensor], source: Path) -> None:
    """Refuse weights whose names or shapes do not fit the model config, naming a few of each."""

    _check_shapes(
        {name: tuple(tensor.shape) for name, tensor in expected.items()},
        {name: tuple(tensor.shape) for name, tensor in weights.items()},
        source,
    )


def _check_shapes(expected: Mapping[str, Sequence[int]], given: Mapping[str, Sequence[int]], source: Path) -> None:
    missing, extra = sorted(expected.keys() - given.keys()), sorted(given.keys() - expected.keys())
    wrong = [name for name in expected.keys() & given.keys() if tuple(expected[name]) != tuple(given[name])]
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
    """A model in eval mode on `device` holding `weights`; `dtype` None keeps the stored float dtype,
    except where the device only emulates it (`dlm.runtime.device.inference_dtype`). A large model (or one
    on an accelerator) takes `weights` over: the dict is emptied as they are placed."""

    device = torch.device(device)
    parameters = sum(tensor.numel() for tensor in {id(t): t for t in weights.values()}.values())  # tied: once
    if dtype is None:
        stored = next((t.dtype for t in weights.values() if t.is_floating_point()), torch.float32)
        dtype = inference_dtype(stored, device, parameters)
    if device.type == "cpu" and parameters < _META_BUILD_MIN_PARAMETERS:
        model = _built_and_copied(config, weights, dtype, source)
    else:
        model = _built_on_meta(config, weights, device, dtype, source)
    return model.to(device).eval()


# Below this size a CPU model is built for real and the weights copied in: its random init costs less
# than the meta device's first use, which imports torch._dynamo (about a second) for the meta kernels
# of the init functions. Above it, and on any accelerator, the model is built on the meta device so
# that loading never holds a float32 copy beside the weights (an 8B model would need 3x its size).
_META_BUILD_MIN_PARAMETERS = 100_000_000


def _built_and_copied(
    config: ModelConfig, weights: dict[str, Tensor], dtype: torch.dtype, source: Path
) -> DiffusionTransformer:
    model = DiffusionTransformer(config)
    _check_weights(model.state_dict(), weights, source)
    with torch.no_grad():
        for parameter in model.parameters():  # parameters only: the rotary tables stay float32
            parameter.data = parameter.data.to(dtype)
        model.load_state_dict(weights, strict=True)
    return model


def _built_on_meta(
    config: ModelConfig, weights: dict[str, Tensor], device: torch.device, dtype: torch.dtype, source: Path
) -> DiffusionTransformer:
    """Each weight moved to `device` in `dtype` and taken as the parameter itself
    (`DiffusionTransformer.from_weights`). `weights` is emptied as they are placed, so that a converted
    weight never lies beside the whole source (a bfloat16 source upcast to float32 peaks near the float32
    model, not half again above it); a tensor stored under two names (a tied head) is placed once."""

    with torch.device("meta"):
        _check_weights(DiffusionTransformer(config).state_dict(), weights, source)
    names_of: dict[int, list[str]] = {}  # by identity, while every source tensor is alive
    for name, tensor in weights.items():
        names_of.setdefault(id(tensor), []).append(name)
    placed: dict[str, Tensor] = {}
    for names in names_of.values():
        tensor = weights[names[0]]
        converted = tensor.to(device, dtype if tensor.is_floating_point() else tensor.dtype)
        for name in names:
            placed[name] = converted
            del weights[name]
        del tensor
    return DiffusionTransformer.from_weights(config, placed)


def load_model_with_info(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, use_ema: bool = True
) -> LoadedModel:
    """Model (eval mode, on `device`), checked tokenizer and metadata of any model source."""

    def place(tensor: Tensor) -> Tensor:  # each weight of a Hugging Face directory, as soon as it is read
        return tensor.to(device, dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype)

    info, weights = read_model_source(path, use_ema, place=place)
    tokenizer = load_checked_tokenizer(info)
    model = build_model(info.model, weights, device, dtype, source=info.path)
    attach_schedule(model, info.diffusion.schedule)
    if info.distillation is not None:
        record = info.distillation
        attach_distilled_steps(model, int(record["steps"]), str(record.get("remasking", "random")))
    return LoadedModel(model, tokenizer, info)


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, use_ema: bool = True
) -> tuple[DiffusionTransformer, Tokenizer]:
    """(model, tokenizer) from an exported dir, a checkpoint or a run dir; no pickle involved."""

    loaded = load_model_with_info(path, device, dtype, use_ema)
    return loaded.model, loaded.tokenizer
