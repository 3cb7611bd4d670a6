"""`dlm eval` and `dlm export`: parse, call the library (`dlm.evaluate`, `dlm.export`), render.

Each command is a separate function, registered in `register` with `dlm bench`.
Libraries load inside the commands so that `dlm --help` never pays for torch.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from dlm.cli.common import ConfigOption, JsonOption, SetOption, console, print_json, wants_json

if TYPE_CHECKING:
    from dlm.evaluate import EvalReport

EmaOption = Annotated[
    bool,
    typer.Option("--ema/--no-ema", help="Use the EMA weights when the checkpoint has them (else the live ones)."),
]


# ------------------------------------------------------------------------------------ dlm eval


def _figure(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _with_error(value: float | None, error: float | None) -> str:
    return _figure(value) if error is None else f"{_figure(value)} ± {_figure(error)}"


# What `context["weights"]` names: the table's value and note.
_WEIGHTS = {
    "ema": ("EMA", "moving average of the trained weights; --no-ema scores the live ones"),
    "live": ("live", "the weights as trained"),
}


def render_report(report: EvalReport) -> None:
    """Two rich tables: the headline figures, then the loss by noise level."""

    from rich.table import Column, Table

    context = report.context
    step = context.get("step")
    title = escape(str(context.get("path", "model")))
    title += f" (step {step})" if step is not None else ""
    table = Table(Column("figure", no_wrap=True), Column("value", justify="right"), "note", title=title)
    size = f"{report.sequences} sequences, {report.tokens:,} tokens"
    table.add_row("data", escape(str(context.get("data", ""))), size)
    if context.get("weights") in _WEIGHTS:  # EMA and live weights of one run score differently
        table.add_row("weights", *_WEIGHTS[context["weights"]])
    table.add_row("masked CE (fixed noise)", _figure(report.fixed_noise_loss), f"{report.batches} fixed noise levels")
    table.add_row("masked accuracy (fixed noise)", _figure(report.fixed_noise_accuracy), "")
    mc_note = f"K = {report.mc_samples} antithetic times; Monte Carlo part ± {_figure(report.nll_mc_stderr)}"
    table.add_row("ELBO NLL (nats / token)", _with_error(report.nll, report.nll_stderr), mc_note)
    table.add_row("perplexity bound", _figure(report.perplexity_bound, 2), "exp(NLL)")
    bits_note = "" if report.bytes is None else "exact UTF-8 bytes of the scored tokens"
    table.add_row("bits per byte", _with_error(report.bits_per_byte, report.bits_per_byte_stderr), bits_note)
    console.print(table)
    if report.bits_per_byte is not None:  # the counts behind the figure, so that anyone can recompute it
        console.print(
            f"bits per byte = NLL {report.nll:.6f} x {report.tokens:,} tokens / ({report.bytes:,} bytes x ln 2)"
            f" = {report.bits_per_byte:.4f}",
            highlight=False,
            soft_wrap=True,
        )
    buckets = Table(
        "t",
        Column("sequences", justify="right"),
        Column("loss", justify="right"),
        Column("CE / masked token", justify="right"),
        title="loss by noise level t",
    )
    for bucket in report.loss_by_t:
        t_range = f"{bucket.t_low:.3g} – {bucket.t_high:.3g}"
        buckets.add_row(t_range, str(bucket.sequences), _figure(bucket.loss), _figure(bucket.masked_ce))
    console.print(buckets)
    for note in report.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")


def eval_command(
    model_path: Annotated[
        Path,
        typer.Argument(
            metavar="CHECKPOINT_OR_MODEL_DIR",
            help="A training or inference checkpoint, a run directory (its latest.pt) or an exported model.",
        ),
    ],
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="A `dlm pack` output directory (its val split) or a .bin file; default: the run's validation data.",
            show_default=False,
        ),
    ] = None,
    batches: Annotated[
        int | None,
        typer.Option(
            "--batches", help="Batches to evaluate; default: the run's eval_batches, else 8.", show_default=False
        ),
    ] = None,
    mc_samples: Annotated[
        int, typer.Option("--mc-samples", help="Monte Carlo diffusion times per sequence for the ELBO (K).")
    ] = 8,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size", help="Sequences per batch; default: the run's batch_size, else 8.", show_default=False
        ),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, mps, cuda or cuda:N.")] = "auto",
    ema: EmaOption = True,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Also write the report as JSON (eval.json).", show_default=False),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Evaluate a model: masked CE and accuracy, ELBO NLL with its error, perplexity bound, bits per byte."""

    from dlm.errors import check_can_create, reported_os_errors
    from dlm.evaluate import evaluate_source, write_report
    from dlm.runtime import resolve_device

    if output is not None:  # before the evaluation, which can take minutes
        check_can_create(output, "--output")
    report = evaluate_source(
        model_path,
        data,
        batches=batches,
        mc_samples=mc_samples,
        batch_size=batch_size,
        device=str(resolve_device(device, "--device")),
        use_ema=ema,
    )
    if output is not None:
        with reported_os_errors("the report", output):
            write_report(report, output)
    if wants_json(as_json):
        print_json(report.to_dict())
    else:
        render_report(report)


# ------------------------------------------------------------------------------------ dlm export


class ExportDtype(str, Enum):
    bfloat16 = "bfloat16"
    float32 = "float32"


def _human_size(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} B"


def export_summary(output: Path) -> dict[str, Any]:
    """What an export holds, for the table or JSON: its metadata and file sizes."""

    from dlm.export import read_export_config

    config = read_export_config(output)
    files = {path.name: path.stat().st_size for path in sorted(output.iterdir()) if path.is_file()}
    keys = ("parameters", "dtype", "weights", "step", "tokens_seen", "tokenizer_sha256")
    return {"output": str(output), **{key: config.get(key) for key in keys}, "files": files}


def export_command(
    checkpoint: Annotated[
        Path, typer.Argument(help="A training or inference checkpoint, or a run directory (its latest.pt).")
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory to create.", show_default=False)],
    dtype: Annotated[ExportDtype, typer.Option("--dtype", help="Weight dtype in model.safetensors.")] = (
        ExportDtype.bfloat16
    ),
    ema: EmaOption = True,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing export at --output.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Export a checkpoint as safetensors weights, config, tokenizer and a model card."""

    from dlm.export import export_model

    summary = export_summary(export_model(checkpoint, output, dtype=dtype.value, use_ema=ema, overwrite=overwrite))
    if wants_json(as_json):
        print_json(summary)
        return
    from rich.table import Column, Table

    table = Table("file", Column("size", justify="right"), title=escape(summary["output"]))
    for name, size in summary["files"].items():
        table.add_row(name, _human_size(size))
    console.print(table)
    console.print(
        f"{summary['parameters']:,} parameters, {summary['dtype']}, {summary['weights']} weights, step "
        f"{summary['step']}. Load it with [bold]dlm.load({escape(repr(summary['output']))})[/] or "
        f"[bold]dlm sample {escape(summary['output'])}[/].",
        highlight=False,
        soft_wrap=True,  # the load call and the command are copied: never broken at the terminal's width
    )


# ------------------------------------------------------------------------------------ dlm bench


BenchFusedOption = Annotated[
    bool,
    typer.Option(
        "--fused-attention", help="Require the flash or memory-efficient attention kernel (CUDA): never math."
    ),
]
BenchStepsOption = Annotated[int, typer.Option("--steps", min=1, help="Timed optimizer steps.")]
BenchWarmupOption = Annotated[int, typer.Option("--warmup", min=0, help="Untimed steps first (compilation, caches).")]
BenchBatchOption = Annotated[
    int | None, typer.Option("--batch-size", min=1, help="Override training.batch_size.", show_default=False)
]
BenchFindOption = Annotated[
    bool, typer.Option("--find-max-batch", help="Find the largest micro-batch that fits (CUDA), then time it.")
]
BenchMemoryOption = Annotated[
    float | None,
    typer.Option(
        "--memory-limit", metavar="GIB", help="Cap this process's GPU memory (search and timing).", show_default=False
    ),
]
BenchCompareOption = Annotated[
    list[str] | None,
    typer.Option(
        "--compare",
        metavar="KEY=V1,V2",
        show_default=False,
        help="Time every combination side by side, e.g. optimizer=adamw,adamw8bit (repeatable).",
    ),
]
BenchPeakOption = Annotated[
    bool,
    typer.Option("--measure-peak", help="Also time a large matmul and report MFU against that measured ceiling."),
]
BenchDeviceOption = Annotated[
    str | None,
    typer.Option("--device", help="Override training.device: auto, cpu, cuda, cuda:N or mps.", show_default=False),
]


def bench_command(
    config: ConfigOption,
    overrides: SetOption = None,
    fused_attention: BenchFusedOption = False,
    steps: BenchStepsOption = 20,
    warmup: BenchWarmupOption = 5,
    batch_size: BenchBatchOption = None,
    find_max_batch: BenchFindOption = False,
    memory_limit: BenchMemoryOption = None,
    compare: BenchCompareOption = None,
    measure_peak: BenchPeakOption = False,
    device: BenchDeviceOption = None,
    as_json: JsonOption = False,
) -> None:
    """Time the full training step on synthetic tokens: tokens/s, model FLOP/s, MFU and peak memory."""

    from rich.table import Table

    from dlm.bench import BenchReport, Progress, benchmark, report_summary, report_table
    from dlm.config import load_config

    experiment = load_config(config, overrides)
    options = {"steps": steps, "warmup": warmup, "batch_size": batch_size, "fused_attention": fused_attention}
    options |= {"device": device, "find_batch": find_max_batch, "memory_limit_gib": memory_limit, "compare": compare}
    options["measure_peak"] = measure_peak

    def run(progress: Progress | None) -> BenchReport:
        return benchmark(experiment, progress=progress, **options)

    if wants_json(as_json):
        print_json(run(None).to_dict())
        return
    with console.status("benchmarking") as status:
        report = run(lambda text: status.update(escape(text)))
    for line in report_summary(report):
        console.print(escape(line), highlight=False)
    headers, rows = report_table(report)
    table = Table(*headers)
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    console.print(table)
    for failure in report.failures:
        console.print(f"[yellow]note:[/] {escape(failure['error'])}")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
    app.command("export")(export_command)
    app.command("bench")(bench_command)
