"""Read a Hugging Face model directory of a supported family (`dlm.artifacts.hf.families`) as dlm
weights and a `SourceInfo` (`dlm.artifacts.import_model` writes `dlm import`'s export from it).

Only data is read: `config.json`, the safetensors weights (one file, or the shards that
`model.safetensors.index.json` lists; pickled `.bin` weights are refused), `tokenizer.json` and the
chat template of `tokenizer_config.json` (or `chat_template.jinja`). The import writes a
`tokenizer_config.json` naming the end-of-document, mask and pad tokens, which `dlm.data.tokenizer`
reads for a tokenizer that lacks dlm's own. A causal model's tokenizer has no mask token:
`add_mask_token` adds `<|mask|>` and gives it an embedding (and head) row, the mean of the others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from tokenizers import Tokenizer
from torch import Tensor

from dlm.artifacts.export_layout import CONFIG_NAME, EXPORT_FORMAT, TOKENIZER_NAME, SourceInfo, read_config_json
from dlm.artifacts.hf.conversion import ConvertedWeights, Placement, Transform, convert_weights
from dlm.artifacts.hf.families import FAMILIES, Family, family_of
from dlm.config.schema import DiffusionConfig, ModelConfig, format_validation_error
from dlm.data.chat import TOKENIZER_CONFIG_NAME, chat_template_of, read_config, special_tokens_of
from dlm.data.tokenizer import SPECIAL_TOKENS, tokenizer_sha256
from dlm.errors import UserError

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
            raise UserError(
                f"the shard index names {unsafe[0]!r}, which is not a .safetensors file in this directory",
                path=index,
                fix="list bare .safetensors file names of this directory in weight_map",
            )
        shards = [directory / str(name) for name in names]
        if missing := [shard.name for shard in shards if not shard.is_file()]:
            raise UserError(
                f"the shard index lists {', '.join(missing[:3])}, which is missing",
                path=index,
                fix="download every shard of the model again",
            )
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

    return (
        isinstance(name, str) and name.endswith(".safetensors") and name == Path(name).name and not name.startswith(".")
    )


# ------------------------------------------------------------------------------------ tokenizer


def _load_tokenizer(directory: Path) -> Any:
    path = directory / TOKENIZER_NAME
    if not path.is_file():
        raise UserError(
            f"no {TOKENIZER_NAME}: dlm reads the fast tokenizer's file",
            path=directory,
            fix="save the tokenizer with save_pretrained, which writes tokenizer.json",
        )
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
            raise UserError(
                f"the tokenizer of this {self.family.name} model has no mask token",
                path=self.directory,
                fix=ADD_MASK_FIX,
            )
        try:
            return ModelConfig.model_validate(fields)
        except ValidationError as exc:
            raise UserError(format_validation_error(exc), path=self.directory / CONFIG_NAME) from None

    def weights(
        self, model: ModelConfig, transforms: dict[str, Transform] | None = None, grown_rows: int = 0
    ) -> ConvertedWeights:
        """The directory's weights for `model`, checked from the headers and read only when asked for."""

        return ConvertedWeights(
            self.directory, _weight_files(self.directory), self.family, model, transforms, grown_rows
        )

    def read(
        self, model: ModelConfig, place: Placement = lambda tensor: tensor
    ) -> tuple[SourceInfo, dict[str, Tensor]]:
        """Metadata and dlm-named weights for `model` (this directory's, perhaps with a mask id added), each
        handed to `place` as it is read (by default kept as read, on the CPU)."""

        tokenizer = self.directory / TOKENIZER_NAME
        check_tokenizer_fits(tokenizer, model)
        weights = convert_weights(self.weights(model), place)
        info = SourceInfo(
            path=self.directory,
            kind=SOURCE_KIND,
            model=model,
            weights="live",
            step=None,
            tokens_seen=None,
            tokenizer_sha256=tokenizer_sha256(tokenizer),
            tokenizer_path=tokenizer,
            diffusion=DiffusionConfig(),
            training={},
        )
        return info, weights


def check_tokenizer_fits(path: Path, model: ModelConfig) -> None:
    """Refuse a tokenizer that can produce ids past the embedding's rows (a model would index beyond it)."""

    size = _load_tokenizer(path.parent).get_vocab_size(with_added_tokens=True)
    if size > model.vocab_size:
        raise UserError(
            f"{TOKENIZER_NAME} has {size} tokens but the model's embedding only {model.vocab_size} rows, "
            "so some token ids have no embedding",
            path=path,
            fix="use the tokenizer the model was saved with",
        )


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
        raise UserError(
            "neither tokenizer_config.json nor config.json names an end-of-document token",
            path=directory,
            fix="set eos_token in tokenizer_config.json",
        )
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
