"""`dlm import HF_DIR --output MODEL_DIR`: a dlm export written from a Hugging Face model directory.

`dlm.artifacts.hf.foreign` reads the directory (as data only); this writes the export, with a
`tokenizer_config.json` naming the end-of-document, mask and pad tokens and carrying the source's chat
template, so `dlm pack --chat` and `dlm sample --chat` render the model's own. A causal model's tokenizer
has no mask token: `add_mask_token` adds `<|mask|>` and gives it the mean embedding (and head) row,
growing the tables by one row only when no spare row exists.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer
from torch import Tensor

from dlm.artifacts.export import check_import_output, write_streamed_export
from dlm.artifacts.export_layout import TOKENIZER_NAME, SourceInfo
from dlm.artifacts.hf.conversion import Transform
from dlm.artifacts.hf.dlm_format import is_hf_export
from dlm.artifacts.hf.foreign import IMPORT_KIND, MASK_TOKEN, SOURCE_KIND, check_tokenizer_fits, read_source
from dlm.choices import ExportDtype
from dlm.config.schema import DiffusionConfig, ModelConfig
from dlm.data.chat import TOKENIZER_CONFIG_NAME
from dlm.data.tokenizer import tokenizer_sha256
from dlm.errors import UserError


def _mask_token_rows(
    work: Path, source_tokenizer: Path, rows: int, settings: dict[str, Any]
) -> tuple[int, dict[str, Transform], int]:
    """Add `<|mask|>` to the tokenizer (written into `work`); its id, the change that gives it the mean
    embedding (and head) row as those tables are read, and the rows they grow by: a spare row of a
    padded vocabulary is used when there is one, else a new row is added."""

    tokenizer = Tokenizer.from_file(str(source_tokenizer))
    used = tokenizer.get_vocab_size(with_added_tokens=True)  # rows past it (padding) were never trained
    tokenizer.add_special_tokens([AddedToken(MASK_TOKEN, special=True, normalized=False)])
    mask_id = tokenizer.token_to_id(MASK_TOKEN)
    assert mask_id is not None  # just added
    tokenizer.save(str(work / TOKENIZER_NAME))
    settings["mask_token"] = MASK_TOKEN

    def with_mask_row(table: Tensor) -> Tensor:
        mean = table[:used].float().mean(dim=0, keepdim=True).to(table.dtype)
        table = torch.cat([table, mean]) if mask_id >= rows else table
        table[mask_id] = mean[0]
        return table

    transforms: dict[str, Transform] = {"token_embedding.weight": with_mask_row, "head.weight": with_mask_row}
    return mask_id, transforms, int(mask_id >= rows)


def import_model(
    source: str | Path,
    output: str | Path,
    *,
    add_mask_token: bool = False,
    dtype: ExportDtype = "bfloat16",
    overwrite: bool = False,
) -> Path:
    """`dlm import`: a dlm export directory from a Hugging Face model directory."""

    directory, output = Path(source), Path(output)
    check_import_output(output, overwrite)
    if is_hf_export(directory):
        raise UserError(
            "this is dlm's own Hugging Face export: it needs no import",
            path=directory,
            fix=f"use it as it is (dlm sample {directory}), or write dlm's format: dlm export {directory} --output DIR",
        )
    hf = read_source(directory)
    if hf.has_mask_token and add_mask_token:
        raise UserError(
            f"the tokenizer already has a mask token ({hf.settings.get('mask_token')})",
            path=directory,
            fix="omit --add-mask-token",
        )
    if not hf.has_mask_token and not add_mask_token:
        raise UserError(
            f"the tokenizer of this {hf.family.name} model has no mask token",
            path=directory,
            fix="pass --add-mask-token to add <|mask|> (its row starts as the mean)",
        )
    settings = dict(hf.settings)
    with tempfile.TemporaryDirectory(prefix="dlm-import-") as scratch:
        work = Path(scratch)
        if add_mask_token:  # a stand-in mask id until the token exists
            source_model = hf.model(mask_token_id=0)
            mask_id, transforms, grown = _mask_token_rows(
                work, directory / TOKENIZER_NAME, source_model.vocab_size, settings
            )
            model = source_model.model_copy(
                update={"mask_token_id": mask_id, "vocab_size": source_model.vocab_size + grown}
            )
        else:
            source_model = model = hf.model()
            transforms, grown = {}, 0
            shutil.copyfile(directory / TOKENIZER_NAME, work / TOKENIZER_NAME)
        check_tokenizer_fits(directory / TOKENIZER_NAME, source_model)
        # Every tensor's shape and dtype checked now, from the headers; each is read (and checked finite)
        # only as it is written, so the import never holds the model whole.
        weights = hf.weights(source_model, transforms, grown)
        info = SourceInfo(
            path=directory,
            kind=SOURCE_KIND,
            model=ModelConfig.model_validate(model.model_dump()),
            weights="live",
            step=None,
            tokens_seen=None,
            tokenizer_sha256=tokenizer_sha256(work / TOKENIZER_NAME),
            tokenizer_path=work / TOKENIZER_NAME,
            diffusion=DiffusionConfig(),
            training={},
        )
        (work / TOKENIZER_CONFIG_NAME).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
        record = {
            "kind": IMPORT_KIND,
            "file": directory.name,
            "model_type": hf.family.name,
            "added_mask_token": add_mask_token,
        }
        return write_streamed_export(
            info,
            weights,
            output,
            dtype=dtype,
            tokenizer=info.tokenizer_path,
            tokenizer_settings=work / TOKENIZER_CONFIG_NAME,
            source=record,
        )
