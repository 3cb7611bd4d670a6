"""The configuration reference, docs/configuration.md, generated from the schema's fields, their
bounds and descriptions, and the cross-field rules (`dlm config docs`; a test keeps the file current).
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel

from dlm.config.distill import DistillConfig
from dlm.config.lora import LoraConfig
from dlm.config.rl import RewardSpec, RLConfig
from dlm.config.rules import EXPERIMENT_RULES, MODEL_RULES, TRAINING_RULES
from dlm.config.schema import MOVED_FIELDS, DiffusionConfig, LoggingConfig, ModelConfig, TrainingConfig


def _bounds(info: Any) -> str:
    parts = []
    for item in info.metadata:
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("pattern", "matches")):
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    return ", ".join(parts)


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("pathlib.", "")
    # A literal "|" would split the Markdown table cell.
    return text.replace("<class '", "").replace("'>", "").replace(" | ", " or ")


def config_reference_markdown() -> str:
    """The configuration reference, generated from the schema (docs/configuration.md)."""

    lines = [
        "# Configuration reference",
        "",
        "Generated from `dlm/config/schema.py` by `dlm config docs`; a test fails when this file is stale.",
        "Config files are TOML with `[model]`, `[diffusion]`, `[training]`, `[training.lora]` and `[logging]`",
        "tables, and `[distill]` for a distillation run (`dlm distill`). Any command that takes `--config`",
        "also takes repeated `--set section.field=value` overrides (`--set training.lora.rank=8` for the",
        "nested table), parsed with the",
        "field's own type (`none` clears an optional field). Relative paths are relative to the",
        "working directory; the run directory keeps the resolved config as `config.json`.",
        "",
    ]
    sections = ("model", ModelConfig), ("diffusion", DiffusionConfig), ("training", TrainingConfig)
    for name, section in (
        *sections,
        ("training.lora", LoraConfig),
        ("logging", LoggingConfig),
        ("distill", DistillConfig),
        ("rl", RLConfig),
        ("rl.rewards", RewardSpec),
    ):
        lines += [f"## `[{name}]`", "", inspect.cleandoc(section.__doc__ or ""), ""]
        lines += ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
        for field, info in section.model_fields.items():
            default = "required" if info.is_required() else info.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                default = f"[{name}.{field}]"
            elif default is None:
                default = "none"
            lines.append(
                f"| `{field}` | `{_type_name(info.annotation)}` | `{default}` | {_bounds(info)} "
                f"| {info.description or ''} |"
            )
        lines.append("")
    moved = ", ".join(f"`{old}` is now `{new}`" for old, new in MOVED_FIELDS.items())
    lines += [
        "## Cross-field rules",
        "",
        *(f"- {rule.statement}." for rule in (*MODEL_RULES, *TRAINING_RULES, *EXPERIMENT_RULES)),
        "- `dlm validate` additionally checks the tokenizer and data files against the model fields.",
        f"- Moved fields still load from their old place, with a warning: {moved}.",
        "",
    ]
    return "\n".join(lines)
