"""The speed-quality frontier of fewer sampling passes: the demo model judged by its autoregressive twin.

Every setting samples the same prompts-free batch (`dlm.bench.generation.benchmark_generation`, the
call behind `dlm bench --generate`) in interleaved rounds on one thread; speed is tokens per CPU
second (the least over the rounds) as a ratio to the default sampler's (one pass per token), and
quality the judge's perplexity of the samples as a change from the default's. A setting is within
bounds when its perplexity rises by at most --ppl-bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from benchmarks import harness
from benchmarks.demo import DEFAULT_OUTPUT


def generation(
    model: Annotated[Path, typer.Option(help="The model to sample.")] = DEFAULT_OUTPUT / "demo" / "model",
    judge: Annotated[Path, typer.Option(help="The model that scores the samples.")] = DEFAULT_OUTPUT / "twin" / "model",
    length: Annotated[int, typer.Option(help="Tokens per sample.")] = 64,
    num_samples: Annotated[int, typer.Option(help="Samples per setting (one batch).")] = 16,
    repeats: Annotated[int, typer.Option(help="Interleaved rounds.")] = 2,
    steps: Annotated[str, typer.Option(help="Sampling passes to compare, comma-separated.")] = "64,32,16,8",
    ppl_bound: Annotated[float, typer.Option(help="The largest judge perplexity rise within bounds.")] = 0.10,
    seed: int = 0,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """Tokens per CPU second and judge perplexity of each number of sampling passes, against one per token."""

    from dlm.artifacts.loading import load_model_with_info
    from dlm.bench.generation import benchmark_generation, check_judge_tokenizer, setting_label

    run = harness.start(
        "generation",
        model=str(model),
        judge=str(judge),
        length=length,
        num_samples=num_samples,
        repeats=repeats,
        steps=steps,
        ppl_bound=ppl_bound,
        seed=seed,
    )
    torch.set_num_threads(1)  # tokens per CPU second, least disturbed by other work on one thread
    loaded, judged = load_model_with_info(model, device="cpu"), load_model_with_info(judge, device="cpu")
    check_judge_tokenizer(
        (loaded.info.tokenizer_path, loaded.tokenizer), (judged.info.tokenizer_path, judged.tokenizer)
    )
    report = benchmark_generation(
        loaded.model,
        loaded.tokenizer,
        judge=judged.model,
        judge_name=str(judge),
        compare=[f"steps={steps}"],
        length=length,
        num_samples=num_samples,
        seed=seed,
        repeats=repeats,
        progress=harness.progress,
    )
    relative = report.relative()
    if relative is None:
        raise typer.BadParameter(f"--steps must include {length}, the default sampler's one pass per token")
    settings: list[dict[str, Any]] = []
    for row, change in zip(report.rows, relative, strict=True):
        settings.append(
            {
                "setting": setting_label(row.setting),
                "passes": int(row.setting.get("steps", length)),
                "cpu_speedup": change.cpu_speedup,
                "judge_perplexity": row.judge_perplexity,
                "perplexity_change": change.perplexity_change,
                "within_bounds": change.perplexity_change <= ppl_bound,
            }
        )
    by_passes = {f"steps_{entry['passes']}": entry for entry in settings}
    within = [entry for entry in settings if entry["within_bounds"]]
    fastest = max(within, key=lambda entry: entry["cpu_speedup"]) if within else None
    figures = {
        "ppl_bound": ppl_bound,
        "by_passes": by_passes,
        "fastest_within_bounds": fastest,
        "tokens_per_pass_within_bounds": length / fastest["passes"] if fastest else 0.0,
    }
    for entry in settings:
        typer.echo(
            f"{entry['passes']:>4} passes: {entry['cpu_speedup']:.2f}x tokens per CPU s, "
            f"judge perplexity {entry['perplexity_change']:+.1%}"
        )
    typer.echo(f"wrote {run.save(figures, {'report': report.to_dict()}, results=results)}")
