"""Export a trained model to a self-contained directory.

An exported directory holds everything needed to use the model on another machine:

    model.safetensors   the weights (bf16 or fp32), each storage written once
    config.json         format "dlm-export-v1", model and diffusion config, step, tokenizer sha256, ...
    tokenizer.json      the exact tokenizer the model was trained with (hash checked)
    tokenizer_config.json  copied when one lies beside that tokenizer: its chat_template, for `sample --chat`
    README.md           a short model card: how it was trained, eval figures, how to load it

`dlm.artifacts.loading` reads exports (and checkpoints) back; `dlm.artifacts.export_layout` names the
files and the format both sides share.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file
from torch import Tensor

from dlm import __version__
from dlm.artifacts.card_data import export_tokenizer_config
from dlm.artifacts.checkpoint import LOCK_NAME, check_finite_weights
from dlm.artifacts.export_layout import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_FORMAT,
    ADAPTER_WEIGHTS_NAME,
    CARD_NAME,
    CONFIG_NAME,
    EXPORT_FILES,
    EXPORT_FORMAT,
    TOKENIZER_NAME,
    WEIGHTS_NAME,
    SourceInfo,
    checked_tokenizer,
    read_export_config,
)
from dlm.artifacts.hf.dlm_format import is_hf_export
from dlm.artifacts.loading import check_weight_shapes, read_model_source, sharded_model_source
from dlm.artifacts.model_card import eval_figures, model_card
from dlm.artifacts.run_dir import run_files
from dlm.choices import ExportDtype
from dlm.data.chat import TOKENIZER_CONFIG_NAME
from dlm.errors import UserError, check_can_create, reported_os_errors
from dlm.fileio import share_as_created, swap_directory_into_place, temporary_path
from dlm.model.lora import peft_config, to_peft_names

EXPORT_DTYPES: dict[ExportDtype, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ------------------------------------------------------------------------------------ exporting


def _store_once(weights: dict[str, Tensor], dtype: torch.dtype) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Cast floating tensors to `dtype`, keeping each shared storage once (safetensors refuses
    aliases); returns the tensors to store and {alias: stored name} to re-tie on load."""

    stored: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in sorted(weights):
        tensor = weights[name]
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        value = tensor.detach().to(device="cpu", dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        stored[name] = value.contiguous()
    return stored, tied


def check_export_output(
    output: Path, overwrite: bool, replaceable: Callable[[Path], bool], kind: str, ours: Collection[str] = EXPORT_FILES
) -> None:
    """Refuse an --output that exists, unless --overwrite and it is a directory `replaceable` accepts
    holding only files an export writes (`ours`): --overwrite replaces the whole directory, so it
    must be an export, never a user's folder, nor an export beside which the user kept a file."""

    check_can_create(output, "--output")
    if not output.exists():
        return
    _refuse_run_directory(output)
    if not overwrite:
        raise UserError("output already exists", path=output, fix="pass --overwrite to replace it, or pick another")
    if not (output.is_dir() and replaceable(output)):
        raise UserError(f"output is not {kind}, refusing to replace it", path=output, fix="choose another --output")
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in output.iterdir() if p.name not in ours)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(
            f"output holds files an export does not write ({shown}); --overwrite would delete them",
            path=output,
            fix="move them out of the directory, or choose another --output",
        )


def _refuse_run_directory(output: Path) -> None:
    """A run directory holds a config.json too: say that it is a run, not list its files as foreign."""

    found = sorted({path.name for path in run_files(output) if path.name != CONFIG_NAME})
    found += [LOCK_NAME] if (output / LOCK_NAME).exists() else []
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise UserError(
            f"output is a run directory ({shown}), which an export never replaces",
            path=output,
            fix=f"choose another --output, e.g. {output / 'export'}",
        )


def _is_export(path: Path) -> bool:
    return (path / CONFIG_NAME).is_file() or (path / ADAPTER_CONFIG_NAME).is_file()


def _check_output(output: Path, overwrite: bool) -> None:
    # Either format's export may be replaced: re-exporting a model in the other format is common.
    check_export_output(output, overwrite, _is_export, "an export")
    if output.exists() and not is_hf_export(output) and not (output / ADAPTER_CONFIG_NAME).is_file():
        read_export_config(output)  # a damaged export is said so, not silently replaced


# safetensors' names of the dtypes an export can hold.
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_WEIGHTS_METADATA = {"format": "pt", "dlm_format": EXPORT_FORMAT}


class StreamedWeights(Protocol):
    """Weights whose names, shapes and dtypes are known before any is read, then read one at a time: a
    sharded checkpoint's (`ShardedWeights`) or a Hugging Face directory's (`ConvertedWeights`)."""

    @property
    def names(self) -> list[str]: ...

    @property
    def dtypes(self) -> Mapping[str, torch.dtype]: ...

    @property
    def directory(self) -> Path: ...

    @property
    def record(self) -> Mapping[str, Any]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str) -> Tensor: ...


def _stream_safetensors(path: Path, weights: StreamedWeights, dtype: torch.dtype) -> int:
    """Write streamed weights as one safetensors file, one tensor in memory at a time.

    The header (names, dtypes, shapes, offsets) comes from the source's index before any tensor is
    read, then each tensor is read, cast, checked finite and appended. Returns the parameter count.
    """

    def stored_dtype(name: str) -> torch.dtype:
        return dtype if weights.dtypes[name].is_floating_point else weights.dtypes[name]

    header: dict[str, Any] = {"__metadata__": _WEIGHTS_METADATA}
    offset = 0
    for name in weights.names:
        size = math.prod(weights.shape(name)) * stored_dtype(name).itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[stored_dtype(name)],
            "shape": list(weights.shape(name)),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for name in weights.names:
            tensor = weights.read(name)
            if tuple(tensor.shape) != tuple(weights.shape(name)):  # the header already promised its size
                raise ValueError(f"{name} was read with shape {tuple(tensor.shape)}, not {weights.shape(name)}")
            check_finite_weights({name: tensor}, weights.directory, step=weights.record.get("step"))
            flat = tensor.to(stored_dtype(name)).contiguous().reshape(-1)
            handle.write(flat.view(torch.uint8).numpy().data)  # little-endian, as safetensors stores
    return sum(math.prod(weights.shape(name)) for name in weights.names)


def _write_export(
    directory: Path,
    write_weights: Callable[[Path], object],
    config: dict[str, Any],
    card: str,
    tokenizer: Path,
    tokenizer_settings: Path | None,
) -> None:
    directory.mkdir()
    write_weights(directory / WEIGHTS_NAME)
    # safetensors creates its file 0600; an export is for sharing, so give it the umask's usual mode.
    share_as_created(directory / WEIGHTS_NAME)
    shutil.copyfile(tokenizer, directory / TOKENIZER_NAME)
    if tokenizer_settings is not None:  # its chat_template, beside the tokenizer as `dlm.data.chat` reads it
        shutil.copyfile(tokenizer_settings, directory / TOKENIZER_CONFIG_NAME)
    (directory / CARD_NAME).write_text(card, encoding="utf-8")
    # config.json last: it is what marks the directory as a complete export.
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


WeightsWriter = tuple[Callable[[Path], object], int, dict[str, str]]  # write(path), parameter count, ties


def _stored_writer(weights: dict[str, Tensor], dtype: torch.dtype) -> WeightsWriter:
    """Weights held in memory, stored once per tie in `dtype` and written with safetensors' own writer."""

    stored, tied = _store_once(weights, dtype)

    def write(path: Path) -> None:
        save_file(stored, str(path), metadata=_WEIGHTS_METADATA)

    return write, sum(tensor.numel() for tensor in stored.values()), tied


def _weights_writer(source: str | Path, use_ema: bool, dtype: torch.dtype) -> tuple[WeightsWriter, SourceInfo]:
    """How to write the source's weights file, and the source's metadata.

    A sharded checkpoint streams tensor by tensor into the file; any other source is read whole
    (it is one file already) and written with safetensors' own writer.
    """

    sharded = sharded_model_source(source, use_ema)
    if sharded is not None:
        info, lazy = sharded
        check_weight_shapes(info.model, {name: lazy.shape(name) for name in lazy.names}, info.path)
        parameters = sum(math.prod(lazy.shape(name)) for name in lazy.names)
        return (lambda path: _stream_safetensors(path, lazy, dtype), parameters, {}), info
    info, weights = read_model_source(source, use_ema)
    if info.kind in ("export", "adapters"):
        raise UserError("this is already an exported model", path=info.path, fix="copy the directory instead")
    check_weight_shapes(info.model, {name: tensor.shape for name, tensor in weights.items()}, info.path)
    return _stored_writer(weights, dtype), info


def check_import_output(output: Path, overwrite: bool) -> None:
    """`dlm import`'s --output: refused as an export's is (it writes the same layout)."""

    _check_output(output, overwrite)


def export_model(
    source: str | Path,
    output: str | Path,
    dtype: ExportDtype = "bfloat16",
    use_ema: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write an exported model directory from a training / inference checkpoint or a run dir."""

    output = Path(output)
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"unknown export dtype {dtype!r}", fix=f"use one of {', '.join(EXPORT_DTYPES)}")
    _check_output(output, overwrite)
    writer, info = _weights_writer(source, use_ema, EXPORT_DTYPES[dtype])
    tokenizer = checked_tokenizer(info)
    tokenizer_settings, _ = export_tokenizer_config(info)
    return _write_export_directory(
        info, writer, output, dtype=dtype, tokenizer=tokenizer, tokenizer_settings=tokenizer_settings
    )


def write_streamed_export(
    info: SourceInfo,
    weights: StreamedWeights,
    output: Path,
    *,
    dtype: ExportDtype,
    tokenizer: Path,
    tokenizer_settings: Path | None,
    source: dict[str, Any] | None = None,
) -> Path:
    """`write_export` for weights read one tensor at a time as they are written (`dlm import`): the
    export never holds the model whole."""

    stored = EXPORT_DTYPES[dtype]
    parameters = sum(math.prod(weights.shape(name)) for name in weights.names)
    writer: WeightsWriter = (lambda path: _stream_safetensors(path, weights, stored), parameters, {})
    return _write_export_directory(
        info, writer, output, dtype=dtype, tokenizer=tokenizer, tokenizer_settings=tokenizer_settings, source=source
    )


def write_export(
    info: SourceInfo,
    weights: dict[str, Tensor],
    output: Path,
    *,
    dtype: ExportDtype,
    tokenizer: Path,
    tokenizer_settings: Path | None,
    source: dict[str, Any] | None = None,
) -> Path:
    """Write `weights` and `info` as an export directory at `output` (checked by the caller), atomically;
    `source` records where the model came from (default: the kind and file name of `info.path`)."""

    if dtype not in EXPORT_DTYPES:
        raise UserError(f"unknown export dtype {dtype!r}", fix=f"use one of {', '.join(EXPORT_DTYPES)}")
    writer = _stored_writer(weights, EXPORT_DTYPES[dtype])
    del weights  # the stored tensors are what is written
    return _write_export_directory(
        info, writer, output, dtype=dtype, tokenizer=tokenizer, tokenizer_settings=tokenizer_settings, source=source
    )


def _write_export_directory(
    info: SourceInfo,
    writer: WeightsWriter,
    output: Path,
    *,
    dtype: ExportDtype,
    tokenizer: Path,
    tokenizer_settings: Path | None,
    source: dict[str, Any] | None = None,
) -> Path:
    write_weights, parameters, tied = writer
    config = {
        "format": EXPORT_FORMAT,
        "name": output.name,
        "dlm_version": __version__,
        "model": info.model.model_dump(mode="json"),
        "diffusion": info.diffusion.model_dump(mode="json"),
        "parameters": parameters,
        "dtype": dtype,
        "weights": info.weights,
        "step": info.step,
        "tokens_seen": info.tokens_seen,
        "tokenizer_sha256": info.tokenizer_sha256,
        "tied": tied,
        "training": info.training,
        "source": source or {"kind": info.kind, "file": info.path.name},
        "distillation": info.distillation,
    }
    card = model_card(info, config, eval_figures(info.run_dir))
    building = temporary_path(output)
    # A full disk or a file size limit fails the build, never the old export: it is replaced last.
    with reported_os_errors("the export", output):
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(building, ignore_errors=True)  # leftovers of a killed export with our pid
        try:
            _write_export(building, write_weights, config, card, tokenizer, tokenizer_settings)
            swap_directory_into_place(building, output)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return output


def export_adapters(source: str | Path, output: str | Path, use_ema: bool = True, overwrite: bool = False) -> Path:
    """`dlm export --adapters-only`: a LoRA run's adapters in float32 (peft's file names), its tokenizer
    (with the tokenizer_config.json beside it, if any), and an `adapter_config.json` that holds peft's
    LoRA settings and, under `dlm`, the model config and the base model the adapters need (its path and
    its weights' sha256). `dlm.load` on the directory merges them onto that base, refusing a base whose
    weights changed."""

    output = Path(output)
    _check_output(output, overwrite)
    info, adapters = read_model_source(source, use_ema, merge_adapters=False)
    if info.lora is None or info.kind == "adapters":
        raise UserError(
            "--adapters-only needs the checkpoint or run directory of a LoRA run ([training.lora] rank > 0)",
            path=info.path,
            fix="export merged weights without --adapters-only",
        )
    tokenizer = checked_tokenizer(info)
    # An imported tokenizer's special tokens (and any chat template) are named by its tokenizer_config.json.
    tokenizer_settings, _ = export_tokenizer_config(info)
    stored = {name: tensor.float().contiguous() for name, tensor in to_peft_names(adapters).items()}
    lora_settings = {
        key: sorted(value) if isinstance(value, set) else value
        for key, value in peft_config(info.lora).to_dict().items()
    }
    config = {
        **json.loads(json.dumps(lora_settings, default=str)),  # peft's own fields, as it writes them
        "dlm": {
            "format": ADAPTER_FORMAT,
            "name": output.name,
            "dlm_version": __version__,
            "model": info.model.model_dump(mode="json"),
            "diffusion": info.diffusion.model_dump(mode="json"),
            "lora": info.lora.model_dump(mode="json"),
            "base": info.lora_base,
            "weights": info.weights,
            "step": info.step,
            "tokens_seen": info.tokens_seen,
            "tokenizer_sha256": info.tokenizer_sha256,
            "training": info.training,
            "parameters": sum(t.numel() for t in stored.values()),
            "dtype": "float32",
        },
    }
    building = temporary_path(output)
    with reported_os_errors("the export", output):
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(building, ignore_errors=True)
        try:
            _write_adapters(building, stored, config, tokenizer, tokenizer_settings)
            swap_directory_into_place(building, output)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return output


def _write_adapters(
    directory: Path, stored: dict[str, Tensor], config: dict[str, Any], tokenizer: Path, tokenizer_settings: Path | None
) -> None:
    directory.mkdir()
    save_file(stored, str(directory / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt", "dlm_format": ADAPTER_FORMAT})
    share_as_created(directory / ADAPTER_WEIGHTS_NAME)
    shutil.copyfile(tokenizer, directory / TOKENIZER_NAME)
    if tokenizer_settings is not None:
        shutil.copyfile(tokenizer_settings, directory / TOKENIZER_CONFIG_NAME)
    # adapter_config.json last: it is what marks the directory as a complete adapter export.
    (directory / ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
