"""What an export's model card says about the run behind it: a title, the data, a usage prompt.

Everything here is best effort: an export made from a checkpoint whose data has moved still gets a
card, with a neutral prompt and without the data section's counts. Metadata that is there but records
its sources in a shape no packer writes is refused, naming the file, rather than guessed at.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

from dlm.artifacts.export_layout import SourceInfo, tokenizer_config
from dlm.data.dataset import load_packed_dataset
from dlm.data.tokenizer import load_tokenizer
from dlm.errors import UserError, UserNote

NEUTRAL_PROMPT = "The"  # when no text of the run's data can be read
_PROMPT_WORDS = 3  # enough to steer a sample, short enough to leave it room


def _data_path(info: SourceInfo, split: str) -> Path | None:
    if info.experiment is None:
        return None
    training = info.experiment.training
    path = training.train_data if split == "train" else training.val_data
    return None if path is None else Path(path)


def _metadata_path(info: SourceInfo, split: str) -> Path | None:
    path = _data_path(info, split)
    if path is None:
        return None
    return path / f"{split}.json" if path.is_dir() else path.with_suffix(".json")


def _split_metadata(info: SourceInfo, split: str) -> dict[str, Any] | None:
    """The `dlm pack` metadata (train.json / val.json) of the run's data, if it can be read."""

    meta = _metadata_path(info, split)
    if meta is None:
        return None
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def data_name(info: SourceInfo) -> str | None:
    """The name of the run's training data: its packed directory (or .bin file) name."""

    path = _data_path(info, "train")
    if path is None:
        return None
    return path.name if path.is_dir() or path.suffix != ".bin" else path.parent.name


def card_title(info: SourceInfo, parameters: str) -> str:
    """E.g. "1.2M-parameter diffusion LM on shakespeare-data, step 600" (not the export's folder name)."""

    name = data_name(info)
    title = f"{parameters}-parameter diffusion language model"
    title += f" on {name}" if name else ""
    return title + (f", step {info.step}" if info.step is not None else "")


_REPACK = "pack the data again with `dlm pack`, or restore the file"


def _count(record: dict[str, Any], key: str, meta: Path, within: str = "") -> int:
    """A count of the metadata (absent is 0), refused naming the file when it is not an integer."""

    value = record.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool):  # JSON true is no count
        raise UserError(
            f"the packed data's metadata records {within}{key} as {json.dumps(value)[:60]}, not an integer",
            path=meta,
            fix=_REPACK,
        )
    return value


def _source_path(source: object, meta: Path) -> str:
    """One recorded input: `dlm pack` records {"path", "bytes", "sha256"}, `dlm pack --chat` the path."""

    if isinstance(source, str):
        return source
    if isinstance(source, dict) and isinstance(source.get("path"), str):
        return str(source["path"])
    raise UserError(
        f"the packed data's metadata records a source as {json.dumps(source)[:60]}, not a path",
        path=meta,
        fix=_REPACK,
    )


def _source_names(metadata: dict[str, Any], meta: Path, shown: int = 4) -> str:
    sources = metadata.get("sources") or []
    if not isinstance(sources, list):
        raise UserError("the packed data's metadata records its sources as no list", path=meta, fix=_REPACK)
    names = [Path(_source_path(source, meta)).name for source in sources]
    text = ", ".join(f"`{name}`" for name in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def data_lines(info: SourceInfo) -> list[str]:
    """Markdown lines: for each split, the tokens, blocks and text bytes packed and the source files."""

    lines = []
    for split, label in (("train", "training"), ("val", "validation")):
        metadata, meta = _split_metadata(info, split), _metadata_path(info, split)
        if metadata is None or meta is None:
            continue
        text = f"- {label}: {_count(metadata, 'num_tokens', meta):,} tokens in "
        text += f"{_count(metadata, 'num_blocks', meta):,} blocks of {_count(metadata, 'seq_len', meta)}"
        chat = metadata.get("chat")
        if isinstance(chat, dict):  # `dlm pack --chat` packs one example a block and counts no text bytes
            text += f", {_count(chat, 'examples', meta, 'chat.'):,} chat examples"
        else:
            text += f", {_count(metadata, 'text_bytes', meta):,} bytes of text"
        sources = _source_names(metadata, meta)
        lines.append(text + (f", from {sources}" if sources else ""))
    return lines


def usage_prompt(info: SourceInfo) -> str:
    """The first words of the validation (else training) text, so the example suits the data."""

    for split in ("val", "train"):
        path = _data_path(info, split)
        if path is None:
            continue
        try:
            tokens = load_packed_dataset(path, split=split)[0]
            text = load_tokenizer(info.tokenizer_path).decode([int(t) for t in tokens])
        except Exception:  # any unreadable data means the neutral prompt, never a failed export
            continue
        words = re.findall(r"[^\s\"'`\\$]+", text)[:_PROMPT_WORDS]  # nothing a shell or Python string mangles
        if words:
            return " ".join(words)
    return NEUTRAL_PROMPT


def export_tokenizer_config(info: SourceInfo) -> tuple[Path | None, str | None]:
    """`tokenizer_config(info)`, with a warning when the run's chat data was packed with a tokenizer's
    own template that no tokenizer_config.json beside the model's tokenizer file holds any more (a
    pack made before packs copied that file beside their tokenizer.json): `dlm sample --chat` on the
    export would render dlm's default template instead."""

    path, template = tokenizer_config(info)
    packed = (_split_metadata(info, "train") or {}).get("chat") or {}
    used = packed.get("template") if isinstance(packed, dict) else None
    if template is None and isinstance(used, str) and used != "default":
        warnings.warn(
            f"the chat data was packed with a {used}, but no tokenizer_config.json with one lies beside "
            f"{info.tokenizer_path}; the export has none, so `dlm sample --chat` on it uses dlm's default "
            "template (copy that tokenizer_config.json beside the export's tokenizer.json)",
            UserNote,
            stacklevel=2,
        )
    return path, template
