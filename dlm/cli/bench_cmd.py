"""`dlm bench`: parse, call the library (`dlm.bench`), render the timings.

The library loads inside the command so that `dlm --help` never pays for torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Column, Table

from dlm.cli.common import (
    DeviceMemoryOption,
    DtypeOption,
    JsonOption,
    SetOption,
    TrainingDeviceOption,
    console,
    given_options,
    print_json,
    refuse_other_mode,
    wants_json,
)
from dlm.config.schema import load_config
from dlm.errors import UserError

if TYPE_CHECKING:
    from dlm.config.schema import ExperimentConfig

# Left out first when the terminal is too narrow for every header word whole (least useful first).
_DROP_ORDER = ("attention", "MFU measured", "dtype", "compile", "model GFLOP/s", "model TFLOP/s", "MFU")


def _min_width(cells: list[str]) -> int:
    """Rich's narrowest rendering of a wrapping column: its longest word."""

    return max((len(word) for cell in cells for word in str(cell).split()), default=1)


def fit_columns(headers: list[str], rows: list[list[str]], width: int) -> tuple[list[str], list[list[str]], list[str]]:
    """Drop columns in `_DROP_ORDER` until every header word fits whole in `width` (a box table
    takes 3 characters per column and 1 more); return the headers, rows and names left out."""

    keep = list(range(len(headers)))
    left_out: list[str] = []

    def needed() -> int:
        return 1 + sum(_min_width([headers[i], *(row[i] for row in rows)]) + 3 for i in keep)

    for name in _DROP_ORDER:
        if needed() <= width:
            break
        if name in headers:
            keep.remove(headers.index(name))
            left_out.append(name)
    return [headers[i] for i in keep], [[row[i] for i in keep] for row in rows], left_out


BenchConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="Experiment config (TOML) of the training step to time.")
]
GenerateOption = Annotated[
    Path | None,
    typer.Option(
        "--generate",
        metavar="MODEL",
        help="Benchmark sampling from this exported model instead: "
        "tokens/s, forward passes per token, judge perplexity, unigram entropy and distinct bigrams "
        "per setting.",
        show_default=False,
    ),
]
JudgeOption = Annotated[
    Path | None,
    typer.Option(
        "--judge",
        metavar="MODEL",
        help="With --generate: the model that scores the samples "
        "(default: the sampled model); a block_size = 1 model scores exact likelihoods.",
        show_default=False,
    ),
]
LengthOption = Annotated[
    int | None, typer.Option("--length", min=1, help="With --generate: tokens per sample (default: the context).")
]
SamplesOption = Annotated[int, typer.Option("--num-samples", min=1, help="With --generate: samples per setting.")]
RepeatsOption = Annotated[
    int, typer.Option("--repeats", min=1, help="With --generate: rounds over the settings; the fastest run counts.")
]
BenchSeedOption = Annotated[int, typer.Option("--seed", min=0, help="With --generate: the seed of every setting.")]
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
BenchEstimateOption = Annotated[
    bool,
    typer.Option(
        "--estimate",
        help="Only estimate the training memory, from the config alone (the model on the meta device: no weights, "
        "no data, no step run); with --device-memory, whether it fits.",
    ),
]
BenchPeakOption = Annotated[
    bool,
    typer.Option("--measure-peak", help="Also time a large matmul and report MFU against that measured ceiling."),
]


# The options only one mode reads (by parameter name); the others (--compare, --device, --json) serve both.
# Given to the other mode they are refused, never ignored. --steps counts optimizer steps: the
# sampler's steps are a setting of --compare.
MODE_OPTIONS: dict[str, tuple[str, ...]] = {
    "training": (
        "config",
        "overrides",
        "fused_attention",
        "steps",
        "warmup",
        "batch_size",
        "find_max_batch",
        "memory_limit",
        "measure_peak",
        "estimate",
        "device_memory",
    ),
    "generation": ("judge", "length", "num_samples", "repeats", "seed", "dtype"),
}


def _check_mode_options(ctx: typer.Context, generating: bool) -> None:
    given = given_options(ctx)
    if generating:
        steps = "; the sampler's steps are a setting: --compare steps=N" if "steps" in given else ""
        refuse_other_mode(given, MODE_OPTIONS["training"], "to --generate, which times sampling", steps)
    else:
        refuse_other_mode(
            given,
            MODE_OPTIONS["generation"],
            "without --generate (timing the training step)",
            ", or time sampling with --generate MODEL",
        )


def _generate_command(model_path: Path, judge_path: Path | None, options: dict[str, Any], as_json: bool) -> None:
    """`dlm bench --generate`: one row per sampler setting."""

    # lazy: keeps torch out of `dlm --help` and of every other command's start
    from dlm.artifacts.loading import load_model_with_info
    from dlm.bench.generation import benchmark_generation, check_judge_tokenizer, report_table
    from dlm.bench.measure import machine_stamp
    from dlm.runtime.device import compute_dtype, dtype_name

    device, wanted = options.pop("device"), compute_dtype(options.pop("dtype"))
    loaded = load_model_with_info(model_path, device=device, dtype=wanted)
    model, tokenizer = loaded.model, loaded.tokenizer
    judge = None
    if judge_path is not None:
        judged = load_model_with_info(judge_path, device=device)  # the judge's figures: its auto dtype
        check_judge_tokenizer((loaded.info.tokenizer_path, tokenizer), (judged.info.tokenizer_path, judged.tokenizer))
        judge = judged.model
    judge_name = "the model itself" if judge_path is None else str(judge_path)
    # What the rates hang on besides the machine (a bfloat16 export computes in float32 on a CPU without it).
    dtype = dtype_name(next(iter(model.parameters())).dtype)
    if wants_json(as_json):
        report = benchmark_generation(model, tokenizer, judge=judge, judge_name=judge_name, **options)
        print_json(report.to_dict() | {"dtype": dtype, "machine": machine_stamp().to_dict()})
        return
    with console.status("benchmarking generation") as status:
        report = benchmark_generation(
            model,
            tokenizer,
            judge=judge,
            judge_name=judge_name,
            progress=lambda text: status.update(escape(text)),
            **options,
        )
    console.print(
        f"{report.num_samples} samples of {report.length} tokens per setting, fastest of {report.repeats} "
        f"runs; the model in {dtype}; judge: {escape(judge_name)}"
    )
    headers, rows = report_table(report)
    table = Table(*headers)
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    console.print(table)


def _estimate_command(experiment: ExperimentConfig, device_memory: float | None, as_json: bool) -> None:
    """`dlm bench --estimate`: the memory of one training process, part by part, from the config alone."""

    from dlm.fileio import format_bytes
    from dlm.train.memory import plan_memory

    plan = plan_memory(experiment, device_memory)
    if wants_json(as_json):
        print_json(plan.to_dict())
        return
    estimate = plan.estimate
    console.print(escape(f"{estimate.breakdown()}; {plan.precision}"), highlight=False)
    table = Table("memory", Column("estimate", justify="right"))
    parts = {
        "weights": estimate.weights,
        "gradients": estimate.gradients,
        f"{estimate.optimizer} state": estimate.optimizer_state,
        "EMA": estimate.ema,
        "distillation teacher": estimate.teacher,
        "activations (one micro-batch)": estimate.activations,
        f"{plan.precision} weight copies": estimate.weight_copies,
    }
    for name, size in parts.items():
        if size or name == "weights":
            table.add_row(escape(name), format_bytes(size))
    table.add_row("[bold]total[/]", f"[bold]{format_bytes(estimate.total)}[/]")
    console.print(table)
    if plan.verdict is not None:
        verdict = "fits" if plan.fits else "does not fit"
        console.print(f"{verdict} one {device_memory:g} GiB GPU: {escape(plan.verdict.detail)}", highlight=False)
        if plan.verdict.fix:
            console.print(f"[yellow]fix:[/] {escape(plan.verdict.fix)}", highlight=False)


def bench_command(
    ctx: typer.Context,
    config: BenchConfigOption = None,
    overrides: SetOption = None,
    fused_attention: BenchFusedOption = False,
    steps: BenchStepsOption = 20,
    warmup: BenchWarmupOption = 5,
    batch_size: BenchBatchOption = None,
    find_max_batch: BenchFindOption = False,
    memory_limit: BenchMemoryOption = None,
    compare: BenchCompareOption = None,
    measure_peak: BenchPeakOption = False,
    estimate: BenchEstimateOption = False,
    device_memory: DeviceMemoryOption = None,
    device: TrainingDeviceOption = None,
    as_json: JsonOption = False,
    generate: GenerateOption = None,
    judge: JudgeOption = None,
    length: LengthOption = None,
    num_samples: SamplesOption = 4,
    repeats: RepeatsOption = 1,
    seed: BenchSeedOption = 0,
    dtype: DtypeOption = "auto",
) -> None:
    """Time the full training step on synthetic tokens: tokens/s, model FLOP/s, MFU and peak memory.

    With --generate MODEL, time sampling instead, with the quality of the samples beside the speed.
    """

    _check_mode_options(ctx, generating=generate is not None)
    if generate is not None:
        sampling: dict[str, Any] = {"compare": compare, "length": length, "num_samples": num_samples}
        sampling |= {"repeats": repeats, "seed": seed}
        return _generate_command(generate, judge, sampling | {"device": device or "cpu", "dtype": dtype}, as_json)
    if config is None:
        raise UserError("dlm bench needs --config (time training) or --generate MODEL (time sampling)")

    from dlm.bench.measure import machine_stamp
    from dlm.bench.results import BenchReport, report_summary, report_table
    from dlm.bench.throughput import Progress, benchmark

    experiment = load_config(config, overrides)
    if estimate:
        timing = tuple(
            name
            for name in MODE_OPTIONS["training"]
            if name not in ("config", "overrides", "estimate", "device_memory")
        )
        refuse_other_mode(given_options(ctx), (*timing, "compare", "device"), "to --estimate, which runs no step")
        return _estimate_command(experiment, device_memory, as_json)
    if device_memory is not None:
        raise UserError("--device-memory plans for another GPU: it goes with --estimate", fix="add --estimate")
    options: dict[str, Any] = {"steps": steps, "warmup": warmup, "batch_size": batch_size}
    options["fused_attention"] = fused_attention
    options |= {"device": device, "find_batch": find_max_batch, "memory_limit_gib": memory_limit, "compare": compare}
    options["measure_peak"] = measure_peak

    def run(progress: Progress | None) -> BenchReport:
        return benchmark(experiment, progress=progress, **options)

    if wants_json(as_json):
        print_json(run(None).to_dict() | {"machine": machine_stamp().to_dict()})
        return
    with console.status("benchmarking") as status:
        report = run(lambda text: status.update(escape(text)))
    for line in report_summary(report):
        console.print(escape(line), highlight=False)
    headers, rows, left_out = fit_columns(*report_table(report), console.width)
    table = Table(*headers)
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    console.print(table)
    if left_out:
        note = f"too narrow for {', '.join(left_out)}: --json has every column"
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    for failure in report.failures:
        console.print(f"[yellow]note:[/] {escape(failure['error'])}")


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_command)
