"""A Hugging Face model's tensors as dlm's, read lazily: which source tensors make each dlm tensor (q, k, v
and gate, up fused), checked against the `[model]` from the safetensors headers before any data is read,
then each produced only when asked for.

`dlm.load` reads them into the model as they come (to the GPU at once); `dlm import` streams them into
the export's file (`dlm.artifacts.export.write_streamed_export`): neither holds the source whole.
`SourceTensors` reads the files itself, by the format's documented layout (an 8-byte header length, a
JSON header of names, dtypes, shapes and offsets, then the raw little-endian data), mapping only one
tensor's bytes at a time: safetensors' own memory map keeps every page it touched resident until the
file closes, as much again as the weights.
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

import torch
from torch import Tensor

from dlm.artifacts.checkpoint import check_finite_weights
from dlm.artifacts.export_layout import CONFIG_NAME
from dlm.artifacts.hf.families import Family
from dlm.config.schema import ModelConfig
from dlm.config.shapes import parameter_shapes
from dlm.errors import UserError

# The dtypes of safetensors' header and torch's; a weight of any other is refused by name.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CONFIG_FIX = "restore the config.json and weights the model was saved with (download both again)"
MISSING_FIX = "download every file of the model again"
Transform = Callable[[Tensor], Tensor]  # a tensor changed as it is read (the mask token's new row)
Placement = Callable[[Tensor], Tensor]  # where a converted tensor goes as soon as it is read


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


class SourceTensors:
    """The tensors of a model directory's safetensors files: names, shapes and dtypes from the headers,
    each tensor's data read only when taken."""

    def __init__(self, files: list[Path]):
        self.entries: dict[str, _Entry] = {}
        for file in files:
            self.entries.update(self._header(file))

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
                described = spec.get("dtype") if isinstance(spec, dict) else spec
                raise self._damaged(file, f"tensor {name} has dtype {described!r} or a field dlm cannot read") from None
            if (
                any(n < 0 for n in shape)
                or not 8 + length <= start <= end <= size
                or end - start != math.prod(shape) * dtype.itemsize
            ):
                raise self._damaged(file, f"tensor {name} lies outside the file or has the wrong size")
            entries[name] = _Entry(file, dtype, shape, start, end)
        return entries

    def read(self, name: str, out: Tensor | None = None) -> Tensor:
        """The tensor `name` read from disk, into `out` (a contiguous tensor of its shape and dtype) or
        into memory of its own. Its bytes alone are mapped, copied (torch's copy, on every thread) and
        unmapped at once."""

        entry = self.entries[name]
        tensor = torch.empty(entry.shape, dtype=entry.dtype) if out is None else out
        assert tensor.shape == entry.shape and tensor.dtype == entry.dtype and tensor.is_contiguous()
        if not tensor.numel():
            return tensor
        start = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
        try:
            with (
                open(entry.file, "rb") as handle,
                mmap.mmap(handle.fileno(), entry.end - start, access=mmap.ACCESS_READ, offset=start) as mapped,
            ):
                with warnings.catch_warnings():  # read-only memory, which the copy only reads
                    warnings.simplefilter("ignore", UserWarning)
                    stored = torch.frombuffer(
                        mapped, dtype=torch.uint8, count=entry.end - entry.start, offset=entry.start - start
                    )
                tensor.view(-1).view(torch.uint8).copy_(stored)
                del stored  # the mapping closes only once nothing points into it
        except (OSError, ValueError) as exc:  # ValueError: the file shrank under the mapping's range
            raise self._damaged(entry.file, f"tensor {name}: {exc}") from None
        if sys.byteorder != "little":  # safetensors stores little-endian
            flipped = tensor.view(torch.uint8).view(-1, entry.dtype.itemsize).flip(-1)
            tensor.copy_(flipped.contiguous().view(entry.dtype).view(entry.shape))
        return tensor


def conversion_plan(family: Family, model: ModelConfig) -> dict[str, list[str]]:
    """dlm's tensor names, in the order of `parameter_shapes`, and the family's tensors each is made of
    (several are stacked in order: q, k, v and gate, up)."""

    plan = {"token_embedding.weight": [family.top["token_embedding.weight"]]}
    for index in range(model.n_layers):
        prefix, names = family.block_prefix.format(n=index), family.block
        ours = f"blocks.{index}."
        plan[ours + "attention_norm.weight"] = [prefix + names["attention_norm"]]
        plan[ours + "attention.qkv.weight"] = [prefix + names[role] + ".weight" for role in "qkv"]
        if model.qkv_bias:
            plan[ours + "attention.qkv.bias"] = [prefix + names[role] + ".bias" for role in "qkv"]
        if model.qk_norm:
            plan[ours + "attention.q_norm.weight"] = [prefix + names["q_norm"]]
            plan[ours + "attention.k_norm.weight"] = [prefix + names["k_norm"]]
        plan[ours + "attention.out.weight"] = [prefix + names["out"]]
        plan[ours + "mlp_norm.weight"] = [prefix + names["mlp_norm"]]
        plan[ours + "mlp.gate_up.weight"] = [prefix + names["gate"], prefix + names["up"]]
        plan[ours + "mlp.down.weight"] = [prefix + names["down"]]
    plan["norm.weight"] = [family.top["norm.weight"]]
    if not model.tie_embeddings:
        plan["head.weight"] = [family.top["head.weight"]]
    return plan


class ConvertedWeights:
    """A Hugging Face directory's weights under dlm's names, checked against `model` from the headers and
    read one tensor at a time (`read`). `transforms` change a tensor as it is read (the mask token's new
    embedding row); `grown_rows` says by how many rows each changes its first dimension.

    It has what `dlm.artifacts.export` streams a file from: `names`, `shape`, `dtypes`, `read`,
    `directory` and `record`."""

    def __init__(
        self,
        directory: Path,
        files: list[Path],
        family: Family,
        model: ModelConfig,
        transforms: dict[str, Transform] | None = None,
        grown_rows: int = 0,
    ):
        self.directory, self.family, self.record = directory, family, {"step": None}
        self.tensors = SourceTensors(files)
        self.plan = conversion_plan(family, model)
        self.transforms, self.grown_rows = transforms or {}, grown_rows
        self._check(model)
        self.names = list(self.plan)
        self.dtypes = {name: self.tensors.entries[parts[0]].dtype for name, parts in self.plan.items()}

    def _source(self, name: str) -> str:
        if name in self.family.top:
            return self.family.top[name]
        _, index, *_ = name.split(".")
        return f"{name} (from {self.family.block_prefix.format(n=index)}*)"

    def _check(self, model: ModelConfig) -> None:
        """Refuse, before any data is read, what `model` could not load: a missing or an extra tensor, a
        shape config.json does not imply (the vocabulary's rows above all), one that is not floating point."""

        entries = self.tensors.entries
        wanted = {part for parts in self.plan.values() for part in parts}
        if missing := sorted(wanted - entries.keys()):
            raise UserError(f"the weights lack {missing[0]}", path=self.directory, fix=MISSING_FIX)
        tied_copy = self.family.top["head.weight"] if model.tie_embeddings else None
        extra = sorted(
            name for name in entries.keys() - wanted if name != tied_copy and not name.endswith("rotary_emb.inv_freq")
        )
        if extra:
            raise UserError(
                f"the weights hold tensors the {self.family.name} layout has no place for ({extra[:3]})",
                path=self.directory,
                fix="import a checkpoint of the published layout",
            )
        for name, shape in parameter_shapes(model):
            parts = [entries[part] for part in self.plan[name]]
            if len({part.shape[1:] for part in parts}) > 1 or any(not part.shape for part in parts):
                listed = ", ".join(f"{part} {entries[part].shape}" for part in self.plan[name])
                raise UserError(
                    f"tensors of one layer do not fit together: {listed}", path=self.directory, fix=CONFIG_FIX
                )
            found = (sum(part.shape[0] for part in parts), *parts[0].shape[1:])
            source = self._source(name)
            if found != shape:
                if name in self.family.top and len(found) == 2 and found[1] == shape[1]:
                    raise UserError(
                        f"config.json's vocabulary ({shape[0]} rows) disagrees with {source}, which "
                        f"has {found[0]} rows",
                        path=self.directory / CONFIG_NAME,
                        fix=CONFIG_FIX,
                    )
                raise UserError(
                    f"{source} has shape {found}, but config.json implies {shape}",
                    path=self.directory / CONFIG_NAME,
                    fix=CONFIG_FIX,
                )
            if not all(part.dtype.is_floating_point for part in parts):
                raise UserError(
                    f"{source} holds {parts[0].dtype} values, not floating point weights",
                    path=self.directory,
                    fix="download the weights again",
                )

    def shape(self, name: str) -> tuple[int, ...]:
        parts = [self.tensors.entries[part].shape for part in self.plan[name]]
        rows = sum(shape[0] for shape in parts) + (self.grown_rows if name in self.transforms else 0)
        return (rows, *parts[0][1:])

    def read(self, name: str) -> Tensor:
        """dlm's tensor `name`: its parts read straight into their rows of one tensor, transformed, and
        refused if it holds a NaN or an inf."""

        parts = self.plan[name]
        if len(parts) == 1:
            tensor = self.tensors.read(parts[0])
        else:  # never transformed: only the embedding and the head are
            first = self.tensors.entries[parts[0]]
            tensor = torch.empty(self.shape(name), dtype=first.dtype)
            offset = 0
            for part in parts:
                entry = self.tensors.entries[part]
                rows = tensor[offset : offset + entry.shape[0]]
                if entry.dtype == first.dtype:
                    self.tensors.read(part, out=rows)
                else:  # a part stored in another dtype than the first: read, then cast into place
                    rows.copy_(self.tensors.read(part))
                offset += entry.shape[0]
        if name in self.transforms:
            tensor = self.transforms[name](tensor)
        fix = "download the model again; a source that itself holds them cannot be used"
        check_finite_weights({self._source(name): tensor}, self.directory, what="source weights", fix=fix)
        return tensor

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for name in self.names:
            yield name, self.read(name)


def convert_weights(weights: ConvertedWeights, place: Placement) -> dict[str, Tensor]:
    """Every tensor, each handed to `place` (e.g. moved to the GPU) as soon as it is read."""

    return {name: place(tensor) for name, tensor in weights}
