"""`dlm eval`: parse, call the library (`dlm.evaluation.evaluate`), render the report.

Libraries load inside the command so that `dlm --help` never pays for torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Column, Table

from dlm.choices import ElboEstimator
from dlm.cli.common import DeviceOption, EmaOption, JsonOption, console, err_console, print_json, wants_json
from dlm.cli.progress import ProgressView
from dlm.errors import reported_os_errors

if TYPE_CHECKING:
    from dlm.evaluation.evaluate import EvalReport


def _figure(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _with_error(value: float | None, error: float | None) -> str:
    return _figure(value) if error is None else f"{_figure(value)} ± {_figure(error)}"


# What `context["weights"]` names: the table's value and note.
_WEIGHTS = {
    "ema": ("EMA", "moving average of the trained weights; --no-ema scores the live ones"),
    "live": ("live", "the weights as trained"),
}


class EvalProgress(ProgressView):
    """Batches scored, with rate and ETA, on stderr: stdout keeps the one report document."""

    def __init__(self, as_json: bool) -> None:
        super().__init__("scoring", as_json, err_console, sys.stderr)

    def update(self, done: int, total: int) -> None:
        rate = done / self.elapsed
        eta = (total - done) / rate if rate > 0 else None
        text = f"{done}/{total} batches  {rate:.2f} batches/s" + (f"  ETA {eta:.0f}s" if eta is not None else "")
        fields = {"batches": done, "total_batches": total, "batches_per_s": rate, "eta_s": eta}
        self.show(done, total, text, fields)


def partial_note(report: EvalReport) -> str | None:
    """Say so when the report scored only the first part of the split."""

    total = report.context.get("data_sequences")
    if total is None or report.sequences >= total:
        return None
    return f"scored {report.sequences} of {total} sequences; --batches N or --all for all"


def render_report(report: EvalReport) -> None:
    """Two rich tables: the headline figures, then the loss by noise level."""

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
    drawn = "counts" if report.estimator == "exact-count" else "times"
    mc_note = f"K = {report.mc_samples} antithetic {drawn}; Monte Carlo part ± {_figure(report.nll_mc_stderr)}"
    table.add_row("ELBO NLL (nats / token)", _with_error(report.nll, report.nll_stderr), mc_note)
    table.add_row("perplexity bound", _figure(report.perplexity_bound, 2), "exp(NLL)")
    bits_note = "" if report.bytes is None else "exact UTF-8 bytes of the scored tokens"
    table.add_row("bits per byte", _with_error(report.bits_per_byte, report.bits_per_byte_stderr), bits_note)
    if report.unigram_bits_per_byte is not None:
        table.add_row(
            "unigram level (bits / byte)",
            _figure(report.unigram_bits_per_byte),
            "training token frequencies, no context",
        )
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
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)


def eval_command(
    model_path: Annotated[
        Path,
        typer.Argument(
            metavar="CHECKPOINT_OR_MODEL_DIR",
            help="A training or inference checkpoint (a sharded step-N directory too), a run directory (its latest "
            "checkpoint) or an exported model.",
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
    every_batch: Annotated[
        bool, typer.Option("--all", help="Score the whole split (instead of --batches).", show_default=False)
    ] = False,
    mc_samples: Annotated[
        int, typer.Option("--mc-samples", help="Monte Carlo samples per sequence for the ELBO (K).")
    ] = 8,
    batch_size: Annotated[
        int | None,
        typer.Option(
            "--batch-size", help="Sequences per batch; default: the run's batch_size, else 8.", show_default=False
        ),
    ] = None,
    estimator: Annotated[
        ElboEstimator,
        typer.Option(
            "--estimator",
            help="How each Monte Carlo sample masks a sequence: bernoulli (a random time, each token masked "
            "independently, as in training) or exact-count (exactly l ~ U{1..L} tokens, weight L / l; "
            "lower variance).",
        ),
    ] = "bernoulli",
    device: DeviceOption = "auto",
    ema: EmaOption = True,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Also write the report as JSON (eval.json).", show_default=False),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace a file at --output that is not an earlier eval report.")
    ] = False,
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            help="Instead of held-out text: sample each prompt of this JSONL file (`prompt` or `messages`, plus "
            "the fields the rewards read) and report accuracy (pass@k) under --reward.",
            show_default=False,
        ),
    ] = None,
    reward: Annotated[
        list[str] | None,
        typer.Option(
            "--reward",
            help="With --prompts: a reward name (exact_match, regex...) or module:function; "
            "the first decides correctness. Default exact_match.",
        ),
    ] = None,
    samples: Annotated[int, typer.Option("--samples", min=1, help="With --prompts: samples per prompt.")] = 1,
    pass_at: Annotated[
        list[int] | None, typer.Option("--pass-at", min=1, help="With --prompts: k of pass@k (repeatable; default 1).")
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="With --prompts: the first N prompts.", show_default=False)
    ] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", min=1, help="With --prompts: sampler steps.", show_default=False)
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="With --prompts: the seed of the samples.")] = 0,
    temperature: Annotated[
        float, typer.Option("--temperature", min=0.01, help="With --prompts: the sampling temperature.")
    ] = 1.0,
    as_json: JsonOption = False,
) -> None:
    """Evaluate a model: masked CE and accuracy, ELBO NLL with its error, perplexity bound, bits per byte;
    with --prompts, accuracy (pass@k with its standard error) on prompts with a verifiable reward.

    Progress goes to stderr. Ctrl-C stops the evaluation with exit code 130 and writes nothing. An
    earlier eval report at --output is replaced; any other file only with --overwrite.
    """

    # lazy: keeps torch out of `dlm --help` and of every other command's start
    from dlm.artifacts.eval_report import check_eval_output
    from dlm.evaluation.evaluate import evaluate_source, write_report
    from dlm.runtime.device import resolve_device

    if prompts is not None:
        _evaluate_prompts(
            model_path,
            prompts,
            reward,
            samples,
            pass_at,
            limit,
            steps,
            seed,
            temperature,
            batch_size or 64,
            device,
            as_json,
        )
        return
    if output is not None:  # before the evaluation, which can take minutes
        check_eval_output(output, overwrite)
    if every_batch and batches is not None:
        raise typer.BadParameter("pass --batches or --all, not both", param_hint="--all")
    json_mode = wants_json(as_json)
    try:
        with EvalProgress(json_mode) as progress:
            report = evaluate_source(
                model_path,
                data,
                batches="all" if every_batch else batches,
                mc_samples=mc_samples,
                batch_size=batch_size,
                estimator=estimator,
                device=str(resolve_device(device, "--device")),
                use_ema=ema,
                progress=progress.update,
            )
    except KeyboardInterrupt:
        err_console.print("interrupted: evaluation stopped, nothing written", highlight=False)
        raise typer.Exit(130) from None
    partial = partial_note(report)
    report.notes += [partial] if partial else []  # in the table, the JSON and eval.json alike
    if output is not None:
        with reported_os_errors("the report", output):
            write_report(report, output)
    if json_mode:
        print_json(report.to_dict())
    else:
        render_report(report)


def _evaluate_prompts(
    model_path: Path,
    prompts: Path,
    reward: list[str] | None,
    samples: int,
    pass_at: list[int] | None,
    limit: int | None,
    steps: int | None,
    seed: int,
    temperature: float,
    batch_size: int,
    device: str,
    as_json: bool,
) -> None:
    from dlm.rl.evaluation import evaluate_model
    from dlm.runtime.device import resolve_device

    json_mode = wants_json(as_json)
    with PromptProgress(json_mode) as progress:
        result = evaluate_model(
            model_path,
            prompts,
            rewards=reward or ["exact_match"],
            samples=samples,
            ks=pass_at or [1],
            limit=limit,
            steps=steps,
            seed=seed,
            temperature=temperature,
            batch_size=batch_size,
            device=str(resolve_device(device, "--device")),
            progress=progress.update,
        )
    if json_mode:
        print_json(result.to_dict())
        return
    table = Table(title=f"{escape(str(model_path))} on {result.prompts} prompts x {result.samples} samples")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, value in result.pass_at.items():
        table.add_row(f"pass@{k}", f"{value:.4f} ± {result.stderr[k]:.4f}")
    table.add_row("mean reward", f"{result.mean_reward:.4f}")
    console.print(table)
    for example in result.examples:
        mark = "correct" if example["correct"] else "wrong"
        console.print(f"{escape(example['prompt'])}[bold]{escape(example['completion'])}[/]  ({mark})", soft_wrap=True)


class PromptProgress(EvalProgress):
    """Prompts sampled, with rate and ETA."""

    def update(self, done: int, total: int) -> None:
        rate = done / self.elapsed
        eta = (total - done) / rate if rate > 0 else None
        text = f"{done}/{total} prompts  {rate:.1f} prompts/s" + (f"  ETA {eta:.0f}s" if eta is not None else "")
        self.show(done, total, text, {"prompts": done, "total_prompts": total, "prompts_per_s": rate, "eta_s": eta})


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)
