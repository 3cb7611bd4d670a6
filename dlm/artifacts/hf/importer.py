"""Read a Hugging Face model directory of a supported family (`dlm.artifacts.hf.families`) as dlm
weights and a `SourceInfo` (`dlm.artifacts.hf_import` writes `dlm import`'s export from it).

Only data is read: `config.json`, the safetensors weights (one file, or the shards that
`model.safetensors.index.json` lists; pickled `.bin` weights are refused), `tokenizer.json` and the
chat template of `tokenizer_config.json` (or `chat_template.jinja`). The import writes a
`tokenizer_config.json` naming the end-of-document, mask and pad tokens, which `dlm.data.tokenizer`
reads for a tokenizer that lacks dlm's own. A causal model's tokenizer has no mask token:
`add_mask_token` adds `<|mask|>` and gives it an embedding (and head) row, the mean of the others.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import Tensor

from dlm.artifacts.checkpoint import check_finite_weights
from dlm.artifacts.export_layout import CONFIG_NAME, EXPORT_FORMAT, TOKENIZER_NAME, SourceInfo, read_config_json
from dlm.artifacts.hf.families import FAMILIES, Family, family_of
from dlm.config.schema import DiffusionConfig, ModelConfig, format_validation_error
from dlm.config.shapes import parameter_shapes
from dlm.data.chat import TOKENIZER_CONFIG_NAME, chat_template_of, read_config, special_tokens_of
from dlm.data.tokenizer import SPECIAL_TOKENS, tokenizer_sha256
from dlm.errors import UserError

Placement = Callable[[Tensor], Tensor]  # where a converted tensor goes as soon as it is made
SOURCE_KIND = "hf-source"
IMPORT_KIND = "hf-import"  # an export's source.kind when `dlm import` wrote it
INDEX_NAME, SINGLE_NAME, TEMPLATE_NAME = "model.safetensors.index.json", "model.safetensors", "chat_template.jinja"
MASK_TOKEN = SPECIAL_TOKENS["mask"]
ADD_MASK_FIX = "add one: dlm import DIR --output MODEL_DIR --add-mask-token, then use MODEL_DIR"


def is_hf_source(directory: str | Path) -> bool:
    """Whether `directory` holds a Hugging Face model of a family dlm imports."""

    config = read_config_json(Path(directory)) or {}
    return str(config.get("model_type", "")).lower() in FAMILIES


# ------------------------------------------------------------------------------------ weights


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files holding the weights: the shards of the index, else model.safetensors."""

    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"unreadable shard index: {exc}", path=index) from None
        if unsafe := [str(name) for name in names if not _bare_shard_name(name)]:
            raise UserError(f"the shard index names {unsafe[0]!r}, which is not a .safetensors file in this "
                            "directory", path=index,
                            fix="list bare .safetensors file names of this directory in weight_map")  # fmt: skip
        shards = [directory / str(name) for name in names]
        if missing := [shard.name for shard in shards if not shard.is_file()]:
            raise UserError(f"the shard index lists {', '.join(missing[:3])}, which is missing", path=index,
                            fix="download every shard of the model again")  # fmt: skip
        return shards
    if (directory / SINGLE_NAME).is_file():
        return [directory / SINGLE_NAME]
    pickled = sorted(p.name for p in directory.glob("*.bin"))
    fix = "save it with safetensors (save_pretrained(..., safe_serialization=True))"
    what = f"only pickled weights ({', '.join(pickled[:2])}), which dlm never loads" if pickled else "no weights"
    raise UserError(f"{what}: no {SINGLE_NAME} or {INDEX_NAME}", path=directory, fix=fix)


def _bare_shard_name(name: object) -> bool:
    """A file name of the directory itself: no folder part, no `..`, a `.safetensors` suffix. Links are
    not resolved: a Hugging Face cache snapshot is a directory of links into its blob store."""

    return isinstance(name, str) and name.endswith(".safetensors") and name == Path(name).name and \
        not name.startswith(".")  # fmt: skip


# The dtypes of safetensors' header and torch's; a weight of any other is refused by name.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # fmt: skip


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


class SourceTensors:
    """The tensors of a model directory's safetensors files, each read only when taken, so that a load
    or an import never holds the source beside what it makes of it.

    It reads the files itself, by the format's documented layout (an 8-byte header length, a JSON
    header of names, dtypes, shapes and offsets, then the raw little-endian data), straight into each
    tensor's own memory: safetensors' memory map would keep every page it touched resident (and
    counted against the process) until the file is closed, as much again as the weights.
    """

    def __init__(self, files: list[Path]):
        self._entries: dict[str, _Entry] = {}
        for file in files:
            self._entries.update(self._header(file))

    @staticmethod
    def _damaged(file: Path, problem: str) -> UserError:
        return UserError(f"damaged weights: {problem}", path=file, fix="download the file again")

    def _header(self, file: Path) -> dict[str, _Entry]:
        try:
            with open(file, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length)) if length <= 100 << 20 else None
                size = os.fstat(handle.fileno()).st_size
        except (OSError, ValueError, struct.error) as exc:
            raise self._damaged(file, f"unreadable safetensors header ({exc})") from None
        if not isinstance(header, dict):
            raise self._damaged(file, "its safetensors header is not a JSON object")
        entries = {}
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape = _DTYPES[spec["dtype"]], tuple(int(n) for n in spec["shape"])
                start, end = (8 + length + int(offset) for offset in spec["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._damaged(file, f"tensor {name} has dtype {spec.get('dtype')!r} or a field dlm cannot "
                                    "read") from None  # fmt: skip
            if not 8 + length <= start <= end <= size or end - start != math.prod(shape) * dtype.itemsize:
                raise self._damaged(file, f"tensor {name} lies outside the file or has the wrong size")
            entries[name] = _Entry(file, dtype, shape, start, end)
        return entries

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        entry = self._entries.get(name)
        return None if entry is None else (entry.shape, entry.dtype)

    def pop(self, name: str, out: Tensor | None = None) -> Tensor | None:
        """The tensor `name` read from disk, into `out` (a contiguous tensor of its shape and dtype) or
        into memory of its own; None if there is no such tensor (left)."""

        entry = self._entries.pop(name, None)
        if entry is None:
            return None
        tensor = torch.empty(entry.shape, dtype=entry.dtype) if out is None else out
        assert tensor.shape == entry.shape and tensor.dtype == entry.dtype and tensor.is_contiguous()
        if not tensor.numel():
            return tensor
        # The tensor's bytes alone are mapped, copied (torch's copy, on every thread) and unmapped at once.
        start = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
        try:
            with open(entry.file, "rb") as handle, mmap.mmap(
                handle.fileno(), entry.end - start, access=mmap.ACCESS_READ, offset=start
            ) as mapped:
                with warnings.catch_warnings():  # read-only memory, which the copy only reads
                    warnings.simplefilter("ignore", UserWarning)
                    stored = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.end - entry.start,
                                              offset=entry.start - start)  # fmt: skip
                tensor.view(-1).view(torch.uint8).copy_(stored)
                del stored  # the mapping closes only once nothing points into it
        except (OSError, ValueError) as exc:  # ValueError: the file shrank under the mapping's range
            raise self._damaged(entry.file, f"tensor {name}: {exc}") from None
        if sys.byteorder != "little":  # safetensors stores little-endian
            tensor.copy_(tensor.view(torch.uint8).view(-1, entry.dtype.itemsize).flip(-1).view(entry.dtype)
                         .view(entry.shape))  # fmt: skip
        return tensor


CONFIG_FIX = "restore the config.json and weights the model was saved with (download both again)"


def _take(tensors: SourceTensors, name: str, directory: Path) -> Tensor:
    tensor = tensors.pop(name)
    if tensor is None:
        raise UserError(f"the weights lack {name}", path=directory, fix="download every file of the model again")
    return tensor


def _fused(tensors: SourceTensors, names: list[str], directory: Path) -> Tensor:
    """The family's separate projections stacked as dlm's one fused matrix, when their widths agree: each
    read straight into its rows of the fused tensor, which is the only copy ever made."""

    found = {name: tensors.shape_and_dtype(name) for name in names}
    if missing := [name for name, spec in found.items() if spec is None]:
        raise UserError(f"the weights lack {missing[0]}", path=directory, fix="download every file of the model again")
    specs = {name: spec for name, spec in found.items() if spec is not None}
    shapes = [shape for shape, _ in specs.values()]
    if len({shape[1:] for shape in shapes}) > 1 or any(len(shape) == 0 for shape in shapes):
        listed = ", ".join(f"{name} {shape}" for name, (shape, _) in specs.items())
        raise UserError(f"tensors of one layer do not fit together: {listed}", path=directory, fix=CONFIG_FIX)
    dtype = next(iter(specs.values()))[1]
    fused = torch.empty((sum(shape[0] for shape in shapes), *shapes[0][1:]), dtype=dtype)
    offset = 0
    for name, (shape, part_dtype) in specs.items():
        rows = fused[offset : offset + shape[0]]
        if part_dtype == dtype:
            tensors.pop(name, out=rows)
        else:  # a part stored in another dtype than the first: read, then cast into place
            rows.copy_(_take(tensors, name, directory))
        offset += shape[0]
    return fused


def _block_weights(tensors: SourceTensors, family: Family, model: ModelConfig, index: int, directory: Path,
                   place: Placement) -> dict[str, Tensor]:  # fmt: skip
    prefix, names = family.block_prefix.format(n=index), family.block

    def take(role: str, suffix: str = "") -> Tensor:
        return place(_take(tensors, prefix + names[role] + suffix, directory))

    def fused(roles: str | tuple[str, ...], suffix: str = "") -> Tensor:
        return place(_fused(tensors, [prefix + names[role] + suffix for role in roles], directory))

    ours = f"blocks.{index}."
    weights = {
        ours + "attention_norm.weight": take("attention_norm"),
        ours + "attention.qkv.weight": fused("qkv", ".weight"),
        ours + "attention.out.weight": take("out"),
        ours + "mlp_norm.weight": take("mlp_norm"),
        ours + "mlp.gate_up.weight": fused(("gate", "up")),
        ours + "mlp.down.weight": take("down"),
    }
    if model.qkv_bias:
        weights[ours + "attention.qkv.bias"] = fused("qkv", ".bias")
    if model.qk_norm:
        weights[ours + "attention.q_norm.weight"] = take("q_norm")
        weights[ours + "attention.k_norm.weight"] = take("k_norm")
    return weights


def convert_weights(tensors: SourceTensors, family: Family, model: ModelConfig, directory: Path,
                    place: Placement = lambda tensor: tensor) -> dict[str, Tensor]:  # fmt: skip
    """The family's tensors under dlm's names (q, k, v and gate, up fused); a tensor left over is refused.
    Each is read when its turn comes and handed to `place` (e.g. moved to the GPU) as soon as it is made,
    so the source is never held whole beside the result."""

    weights = {"token_embedding.weight": place(_take(tensors, family.top["token_embedding.weight"], directory)),
               "norm.weight": place(_take(tensors, family.top["norm.weight"], directory))}  # fmt: skip
    head_name = family.top["head.weight"]
    if not model.tie_embeddings:
        weights["head.weight"] = place(_take(tensors, head_name, directory))
    elif head_name in tensors:
        tensors.pop(head_name)  # a tied model's saved copy of its embedding
    for index in range(model.n_layers):
        weights.update(_block_weights(tensors, family, model, index, directory, place))
    leftover = sorted(name for name in tensors if not name.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise UserError(f"the weights hold tensors the {family.name} layout has no place for ({leftover[:3]})",
                        path=directory, fix="import a checkpoint of the published layout")  # fmt: skip
    check_weights_fit(weights, family, model, directory)
    return weights


def _block_source(name: str, family: Family) -> str:
    """How an error names a block tensor: dlm's name and the family's tensors it was made of."""

    _, index, *_ = name.split(".")
    return f"{name} (from {family.block_prefix.format(n=index)}*)"


def check_weights_fit(weights: dict[str, Tensor], family: Family, model: ModelConfig, directory: Path) -> None:
    """Refuse weights that the model of config.json could not load: a shape the config does not imply
    (the vocabulary's rows above all), a tensor that is not floating point, a NaN or an inf."""

    for name, shape in parameter_shapes(model):
        tensor = weights[name]
        source = family.top.get(name) or _block_source(name, family)
        if tuple(tensor.shape) != shape:
            if name in family.top and tensor.dim() == 2 and tensor.shape[1] == shape[1]:
                raise UserError(f"config.json's vocabulary ({shape[0]} rows) disagrees with {source}, which has "
                                f"{tensor.shape[0]} rows", path=directory / CONFIG_NAME, fix=CONFIG_FIX)  # fmt: skip
            raise UserError(f"{source} has shape {tuple(tensor.shape)}, but config.json implies {shape}",
                            path=directory / CONFIG_NAME, fix=CONFIG_FIX)  # fmt: skip
        if not tensor.is_floating_point():
            raise UserError(f"{source} holds {tensor.dtype} values, not floating point weights", path=directory,
                            fix="download the weights again")  # fmt: skip
    fix = "download the model again; a source that itself holds them cannot be used"
    check_finite_weights(weights, directory, what="source weights", fix=fix)


# ------------------------------------------------------------------------------------ tokenizer


def _load_tokenizer(directory: Path) -> Any:
    from tokenizers import Tokenizer

    path = directory / TOKENIZER_NAME
    if not path.is_file():
        raise UserError(f"no {TOKENIZER_NAME}: dlm reads the fast tokenizer's file", path=directory,
                        fix="save the tokenizer with save_pretrained, which writes tokenizer.json")  # fmt: skip
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise UserError(f"not a tokenizer.json: {exc}", path=path) from None


def _single_id(value: Any) -> int | None:
    if isinstance(value, list):  # generation configs list several end tokens: the first ends a document
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def tokenizer_settings(directory: Path, config: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The source's tokenizer_config.json settings as the import writes them: its chat template (also
    from chat_template.jinja), and the eos / mask / pad tokens that dlm reads named explicitly (from
    the config's token ids where tokenizer_config.json does not name them)."""

    source = directory / TOKENIZER_CONFIG_NAME
    settings = read_config(source) if source.is_file() else {}
    template = chat_template_of(settings, source)
    if template is None and (directory / TEMPLATE_NAME).is_file():
        template = (directory / TEMPLATE_NAME).read_text(encoding="utf-8")
    named = special_tokens_of(settings)

    def token(value: Any) -> str | None:
        token_id = _single_id(value)
        return None if token_id is None else tokenizer.id_to_token(token_id)

    eos = named.get("eos_token") or token(config.get("eos_token_id"))
    mask = token(config.get("mask_token_id")) or named.get("mask_token")
    if mask is None and tokenizer.token_to_id(MASK_TOKEN) is not None:  # e.g. a tokenizer trained by dlm
        mask = MASK_TOKEN
    kept = {key: value for key, value in settings.items() if key not in ("chat_template", "auto_map")}
    updates = {"eos_token": eos, "mask_token": mask, "pad_token": named.get("pad_token"), "chat_template": template}
    return {**kept, **{key: value for key, value in updates.items() if value is not None}}


# ------------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class HfSource:
    """What a Hugging Face model directory says of itself, before any weight is read."""

    directory: Path
    family: Family
    fields: dict[str, Any]  # dlm [model] fields; mask_token_id among them when the tokenizer has a mask token
    settings: dict[str, Any]  # its tokenizer_config.json as `dlm import` writes it

    @property
    def has_mask_token(self) -> bool:
        return "mask_token_id" in self.fields

    def model(self, mask_token_id: int | None = None) -> ModelConfig:
        """The dlm `[model]`; `mask_token_id` stands in for the one a causal model's tokenizer lacks."""

        fields = self.fields if mask_token_id is None else {**self.fields, "mask_token_id": mask_token_id}
        if "mask_token_id" not in fields:
            raise UserError(f"the tokenizer of this {self.family.name} model has no mask token", path=self.directory,
                            fix=ADD_MASK_FIX)  # fmt: skip
        try:
            return ModelConfig.model_validate(fields)
        except ValidationError as exc:
            raise UserError(format_validation_error(exc), path=self.directory / CONFIG_NAME) from None

    def read(
        self, model: ModelConfig, place: Placement = lambda tensor: tensor
    ) -> tuple[SourceInfo, dict[str, Tensor]]:
        """Metadata and dlm-named weights for `model` (this directory's, perhaps with a mask id added), each
        handed to `place` as it is read (by default kept as read, on the CPU)."""

        tokenizer = self.directory / TOKENIZER_NAME
        _check_tokenizer_fits(tokenizer, model)
        tensors = SourceTensors(_weight_files(self.directory))
        weights = convert_weights(tensors, self.family, model, self.directory, place)
        info = SourceInfo(path=self.directory, kind=SOURCE_KIND, model=model, weights="live", step=None,
                          tokens_seen=None, tokenizer_sha256=tokenizer_sha256(tokenizer), tokenizer_path=tokenizer,
                          diffusion=DiffusionConfig(), training={})  # fmt: skip
        return info, weights


def _check_tokenizer_fits(path: Path, model: ModelConfig) -> None:
    """Refuse a tokenizer that can produce ids past the embedding's rows (a model would index beyond it)."""

    size = _load_tokenizer(path.parent).get_vocab_size(with_added_tokens=True)
    if size > model.vocab_size:
        raise UserError(f"{TOKENIZER_NAME} has {size} tokens but the model's embedding only {model.vocab_size} rows, "
                        "so some token ids have no embedding", path=path,
                        fix="use the tokenizer the model was saved with")  # fmt: skip


def read_source(directory: Path) -> HfSource:
    """The family, `[model]` fields and tokenizer settings of a Hugging Face directory; reads no weights."""

    config = read_config_json(directory)
    if config is None:
        raise UserError(f"no readable {CONFIG_NAME}", path=directory, fix="pass a Hugging Face model directory")
    family = family_of(config, directory)
    fields = family.model_fields(config, directory)
    tokenizer = _load_tokenizer(directory)
    settings = tokenizer_settings(directory, config, tokenizer)
    if "mask_token_id" not in fields and settings.get("mask_token") is not None:
        fields["mask_token_id"] = tokenizer.token_to_id(str(settings["mask_token"]))
    return HfSource(directory, family, fields, settings)


def read_hf_source(directory: Path, place: Placement = lambda tensor: tensor) -> tuple[SourceInfo, dict[str, Tensor]]:
    """Metadata and dlm-named weights of a Hugging Face model directory with a mask token, each handed to
    `place` as it is read (`dlm.load` moves them to the device then: the source is never held whole)."""

    source = read_source(directory)
    model = source.model()
    if source.settings.get("eos_token") is None:
        raise UserError("neither tokenizer_config.json nor config.json names an end-of-document token",
                        path=directory, fix="set eos_token in tokenizer_config.json")  # fmt: skip
    return source.read(model, place)


def source_shape(path: Path) -> tuple[ModelConfig, Path] | None:
    """The `[model]` and tokenizer file of a Hugging Face model that brings its own shape to
    `--init-from`: a directory of a family dlm imports, or a `dlm import` of one; None otherwise."""

    if not path.is_dir():
        return None
    if is_hf_source(path):
        return read_source(path).model(), path / TOKENIZER_NAME
    config = read_config_json(path) or {}
    source = config.get("source")
    if config.get("format") != EXPORT_FORMAT or not isinstance(source, dict) or source.get("kind") != IMPORT_KIND:
        return None
    try:
        return ModelConfig.model_validate(config.get("model")), path / TOKENIZER_NAME
    except ValidationError as exc:
        raise UserError(format_validation_error(exc), path=path / CONFIG_NAME) from None
