"""The layout of an exported model directory: its file names, its format tag, what is known of a model
source, and the checks every reader of an export shares.

`dlm.artifacts.export` writes a dlm export, `dlm.artifacts.hf_export` the Hugging Face format;
`dlm.artifacts.loading` and `dlm.artifacts.hf.dlm_format` read them back. The names live here so that
readers and writers import one module and never each other.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlm.config.lora import LoraConfig
from dlm.config.schema import DiffusionConfig, ExperimentConfig, ModelConfig
from dlm.data.chat import TOKENIZER_CONFIG_NAME, read_chat_template
from dlm.data.tokenizer import has_dlm_special_tokens, load_tokenizer, optional_token_id, tokenizer_sha256
from dlm.errors import UserError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EXPORT_FORMAT = "dlm-export-v1"
WEIGHTS_NAME, CONFIG_NAME, TOKENIZER_NAME = "model.safetensors", "config.json", "tokenizer.json"
CARD_NAME = "README.md"
# The Hugging Face format's own files besides those: the bundled code and the transformers tokenizer files.
CODE_FILES = ("configuration_dlm.py", "modeling_dlm.py")
HF_TOKENIZER_FILES = (TOKENIZER_CONFIG_NAME, "special_tokens_map.json")
# `dlm export --adapters-only`: a LoRA run's adapters apart, in peft's file names, and the base they need.
ADAPTER_WEIGHTS_NAME, ADAPTER_CONFIG_NAME = "adapter_model.safetensors", "adapter_config.json"
ADAPTER_FORMAT = "dlm-adapters-v1"
# Every file an export of any format writes: what `--overwrite` may replace, whichever format was there.
EXPORT_FILES = (
    WEIGHTS_NAME,
    CONFIG_NAME,
    TOKENIZER_NAME,
    CARD_NAME,
    *CODE_FILES,
    *HF_TOKENIZER_FILES,
    ADAPTER_WEIGHTS_NAME,
    ADAPTER_CONFIG_NAME,
)


@dataclass
class SourceInfo:
    """What is known about a model source besides its weights."""

    path: Path  # the checkpoint file or the exported directory actually read
    # "training" | "inference" | "export" | "hf" (the Hugging Face format, `dlm.artifacts.hf_export`) |
    # "hf-source" (a Hugging Face model of another family, `dlm.artifacts.hf.foreign`) | "adapters"
    kind: str
    model: ModelConfig
    weights: str  # "ema" | "live"
    step: int | None
    tokens_seen: int | None
    tokenizer_sha256: str
    tokenizer_path: Path  # where the tokenizer should be (checked when it is loaded)
    diffusion: DiffusionConfig  # the noise schedule and mask_eps the model was trained with
    experiment: ExperimentConfig | None = None  # full config: checkpoints only
    training: dict[str, Any] = field(default_factory=dict)  # path-free training settings
    # A LoRA run's adapters (checkpoints and adapter exports): their settings, and the base model they
    # were trained on (`{"path", "sha256"}` of its weights); None for plain weights.
    lora: LoraConfig | None = None
    lora_base: dict[str, str] | None = None
    # A distilled student (`dlm distill`): its method, the sampling `steps` it was distilled for (what
    # sampling defaults to), its teacher's steps and weights' sha256; None for any other model.
    distillation: dict[str, Any] | None = None

    @classmethod
    def from_record(
        cls,
        path: Path,
        kind: str,
        model: ModelConfig,
        diffusion: DiffusionConfig,
        record: dict[str, Any],
        tokenizer_path: Path,
        **more: Any,
    ) -> SourceInfo:
        """What an export's metadata `record` (its config.json, or the `dlm` part of a Hugging Face one)
        says of its weights, step, tokens seen, tokenizer hash and training; `more` adds or overrides fields."""

        recorded: dict[str, Any] = {
            "weights": str(record.get("weights", "live")),
            "step": record.get("step"),
            "tokens_seen": record.get("tokens_seen"),
            "tokenizer_sha256": str(record.get("tokenizer_sha256", "")),
            "training": dict(record.get("training") or {}),
        }
        return cls(
            path=path, kind=kind, model=model, diffusion=diffusion, tokenizer_path=tokenizer_path, **(recorded | more)
        )

    @property
    def run_dir(self) -> Path | None:
        """The run directory a checkpoint lives in (its metrics feed the model card)."""

        return None if self.kind in ("export", "hf", "hf-source", "adapters") else self.path.parent

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "kind": self.kind,
            "weights": self.weights,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "tokenizer_sha256": self.tokenizer_sha256,
        }


def read_export_config(directory: str | Path) -> dict[str, Any]:
    """The `config.json` of an exported directory, refused unless it is a dlm export."""

    path = Path(directory) / CONFIG_NAME
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"no {CONFIG_NAME} here, so this is not an exported dlm model", path=directory) from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"unreadable {CONFIG_NAME}: {exc}", path=path) from None
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise UserError(
            f"not a dlm export: {CONFIG_NAME} lacks format {EXPORT_FORMAT!r}",
            path=path,
            fix="pass a directory written by `dlm export`, a checkpoint or a run directory",
        )
    return config


# The JSON type of each field a loader reads; a wrong type is refused naming the field, never a traceback.
FieldTypes = Mapping[str, tuple[type, ...]]
_JSON_NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    type(None): "null",
}


def read_distillation(config: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """A distilled student's record in an export's `config` (None for other models); its `steps` must
    be a positive count, since sampling defaults to it."""

    record = config.get("distillation")
    if record is None:
        return None
    steps = record.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise UserError(
            "the field distillation.steps must be a positive integer (the steps the student samples "
            f"in), not {steps!r}",
            path=path,
            fix="export the distillation run again",
        )
    return dict(record)


def _json_type(value: object) -> str:
    return _JSON_NAMES.get(type(value), type(value).__name__)


def check_config_fields(
    config: Mapping[str, Any], fields: FieldTypes, path: Path, required: Iterable[str] = (), within: str = ""
) -> None:
    """Refuse a JSON object that lacks a `required` field or holds one of another type than `fields`
    says, naming the file and the field (`within` prefixes nested fields, e.g. "dlm.")."""

    fix = "export the model again, or restore the file"
    for name in required:
        if name not in config:
            raise UserError(f"the field {within}{name} is missing", path=path, fix=fix)
    for name, types in fields.items():
        value = config.get(name)
        # JSON true / false are Python bools, which are ints too: an integer field takes neither.
        if name in config and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            expected = " or ".join(_JSON_NAMES.get(kind, kind.__name__) for kind in types)
            raise UserError(f"the field {within}{name} is {_json_type(value)}, not {expected}", path=path, fix=fix)


def checked_tokenizer(info: SourceInfo) -> Path:
    """The tokenizer file the model was trained with, refused when missing, changed or of another shape."""

    load_checked_tokenizer(info)
    return info.tokenizer_path


def load_checked_tokenizer(info: SourceInfo) -> Tokenizer:
    """The tokenizer the model was trained with, loaded: refused when missing, changed since training (the
    sha256 its source records), or of a vocabulary or mask token the model does not have (a Hugging Face
    export records no sha256: a transformers re-save may reformat the file)."""

    path = _unchanged_tokenizer(info)
    tokenizer = load_tokenizer(path)
    vocab, model = tokenizer.get_vocab_size(with_added_tokens=True), info.model
    # An imported model's embedding may have rows past its tokenizer (padding); dlm's own has none.
    if vocab > model.vocab_size or (has_dlm_special_tokens(tokenizer) and vocab != model.vocab_size):
        raise UserError(
            f"the tokenizer has {vocab} tokens, the model {model.vocab_size}: it is not the model's",
            path=path,
            fix="put the tokenizer the model was trained with beside it",
        )
    mask = optional_token_id(tokenizer, "mask")
    if mask is not None and mask != model.mask_token_id:
        raise UserError(
            f"the tokenizer's mask token is id {mask}, the model's mask_token_id is {model.mask_token_id}",
            path=path,
            fix="put the tokenizer the model was trained with beside it",
        )
    return tokenizer


def _unchanged_tokenizer(info: SourceInfo) -> Path:
    path = info.tokenizer_path
    if not path.is_file():
        raise UserError(
            "the tokenizer the model was trained with is missing",
            path=path,
            fix="restore that file (the checkpoint records its sha256), or work on the machine that trained it",
        )
    if tokenizer_sha256(path) != info.tokenizer_sha256:
        raise UserError(
            f"the tokenizer file changed since training (sha256 differs from the one {info.path} records)",
            path=path,
            fix="restore the tokenizer the model was trained with",
        )
    return path


def tokenizer_config(info: SourceInfo) -> tuple[Path | None, str | None]:
    """The tokenizer_config.json beside the model's tokenizer file and its chat_template (each None
    when absent). An export carries both, so that `dlm sample --chat` on it renders the template the
    chat data was packed with; an unreadable file is refused here, not copied to fail there."""

    path = info.tokenizer_path.parent / TOKENIZER_CONFIG_NAME
    if not path.is_file():
        return None, None
    return path, read_chat_template(path)


def read_config_json(directory: Path) -> dict[str, Any] | None:
    """The `config.json` object of a directory, or None when it is missing, unreadable or not an object."""

    try:
        config = json.loads((directory / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return config if isinstance(config, dict) else None


def is_dlm_export(directory: Path) -> bool:
    """Whether `directory` holds a dlm export (not the Hugging Face format)."""

    return (read_config_json(directory) or {}).get("format") == EXPORT_FORMAT
