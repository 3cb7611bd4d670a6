"""`dlm eval`: parse, call the library (`dlm.evaluate`), render the report.

Libraries load inside the command so that `dlm --help` never pays for torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from dlm.cli.common import DeviceOption, EmaOption, JsonOption, console, print_json, wants_json

if TYPE_CHECKING:
    from dlm.evaluate import EvalReport


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
    device: DeviceOption = "auto",
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


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
