"""`dlm export` and `dlm import`: parse, call the library (`dlm.artifacts.export`,
`dlm.artifacts.import_model`), render what the model directory holds.

The library loads inside the command so that `dlm --help` never pays for torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Column, Table

from dlm.choices import ExportDtype, ExportFormat
from dlm.cli.common import EmaOption, JsonOption, console, print_json, wants_json
from dlm.errors import UserError


def _human_size(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} B"


def export_summary(output: Path) -> dict[str, Any]:
    """What an export holds, for the table or JSON: its metadata and file sizes."""

    # lazy: keeps torch out of `dlm --help` and of every other command's start
    from dlm.artifacts.export_layout import ADAPTER_CONFIG_NAME, read_export_config
    from dlm.artifacts.hf.dlm_format import hf_summary, is_hf_export
    from dlm.artifacts.loading import read_adapter_config

    if (output / ADAPTER_CONFIG_NAME).is_file():
        config = read_adapter_config(output)
    else:
        config = hf_summary(output) if is_hf_export(output) else read_export_config(output)
    files = {path.name: path.stat().st_size for path in sorted(output.iterdir()) if path.is_file()}
    keys = ("parameters", "dtype", "weights", "step", "tokens_seen", "tokenizer_sha256")
    return {"output": str(output), **{key: config.get(key) for key in keys}, "files": files}


def export_command(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="A training or inference checkpoint (a sharded step-N directory too), a run directory (its latest "
            "checkpoint), or an export to convert (a Hugging Face one to dlm's format, dlm's to --format hf)."
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory to create.", show_default=False)],
    dtype: Annotated[ExportDtype, typer.Option("--dtype", help="Weight dtype in model.safetensors.")] = "bfloat16",
    ema: EmaOption = True,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing export at --output.")] = False,
    export_format: Annotated[
        ExportFormat, typer.Option("--format", help="dlm's own directory, or Hugging Face transformers' (hf).")
    ] = "dlm",
    adapters_only: Annotated[
        bool,
        typer.Option(
            "--adapters-only",
            help="A LoRA run's adapters apart (adapter_model.safetensors + adapter_config.json naming the base), "
            "instead of weights merged with them.",
        ),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Export a checkpoint as safetensors weights, config, tokenizer and a model card (a LoRA run's adapters
    merged into the weights, or apart with --adapters-only)."""

    from dlm.artifacts.export import export_adapters, export_model
    from dlm.artifacts.hf_export import export_hf

    if adapters_only:
        if export_format == "hf":
            raise UserError("--adapters-only writes dlm's adapter format", fix="drop --format hf or --adapters-only")
        summary = export_summary(export_adapters(checkpoint, output, use_ema=ema, overwrite=overwrite))
        _render(summary, f"dlm.load({summary['output']!r})", as_json)
        return
    export = export_hf if export_format == "hf" else export_model
    summary = export_summary(export(checkpoint, output, dtype=dtype, use_ema=ema, overwrite=overwrite))
    load = f"dlm.load({summary['output']!r})"
    if export_format == "hf":
        load = f"AutoModelForMaskedLM.from_pretrained({summary['output']!r}, trust_remote_code=True)"
    _render(summary, load, as_json)


def _render(summary: dict[str, Any], load: str, as_json: bool) -> None:
    if wants_json(as_json):
        print_json(summary)
        return

    table = Table("file", Column("size", justify="right"), title=escape(summary["output"]))
    for name, size in summary["files"].items():
        table.add_row(name, _human_size(size))
    console.print(table)
    step = "step not recorded" if summary["step"] is None else f"step {summary['step']}"
    console.print(
        f"{summary['parameters']:,} parameters, {summary['dtype']}, {summary['weights']} weights, "
        f"{step}. Load it with [bold]{escape(load)}[/] or "
        f"[bold]dlm sample {escape(summary['output'])}[/].",
        highlight=False,
        soft_wrap=True,  # the load call and the command are copied: never broken at the terminal's width
    )


def import_command(
    source: Annotated[
        Path, typer.Argument(help="A Hugging Face model directory: LLaDA, Dream, Llama, Qwen2, Qwen3 or Mistral.")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory to create.", show_default=False)],
    add_mask_token: Annotated[
        bool,
        typer.Option("--add-mask-token", help="Add a <|mask|> token (a causal model's tokenizer has none)."),
    ] = False,
    dtype: Annotated[ExportDtype, typer.Option("--dtype", help="Weight dtype in model.safetensors.")] = "bfloat16",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing export at --output.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Import a Hugging Face model directory as a dlm model (safetensors only; no code is run)."""

    from dlm.artifacts.import_model import import_model

    path = import_model(source, output, add_mask_token=add_mask_token, dtype=dtype, overwrite=overwrite)
    summary = export_summary(path)
    if wants_json(as_json):
        print_json(summary)
        return
    console.print(
        f"{summary['parameters']:,} parameters, {summary['dtype']} in {escape(summary['output'])}. Sample it "
        f"with [bold]dlm sample {escape(summary['output'])}[/] or fine-tune it with "
        f"[bold]dlm train --init-from {escape(summary['output'])}[/].",
        highlight=False,
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
    app.command("import")(import_command)
