"""Models against each other at their own sampling steps: a teacher, its distilled students, a twin, judged.

A student is worth shipping only if it is faster than its teacher at the quality it keeps, so each
model samples the same unconditional batch in its own steps (a distilled student's, else one per
token, or as its `@` settings say) and a judge scores all of them: best an autoregressive model,
whose likelihood is exact. For every seed the models sample in interleaved rounds on one thread
(`dlm.bench.measure.interleaved`), and the least CPU time of a model's rounds is its time for that
seed; speed is tokens per CPU second as a ratio to the first model's, because ratios carry over
between machines where absolute times do not. Beside the judge's perplexity stand the unigram
entropy and distinct bigrams: a student that looks good by perplexity alone while repeating itself
shows it there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from benchmarks import harness
from dlm.bench.measure import interleaved


@dataclass
class Entry:
    label: str
    path: Path
    steps: int | None  # None: the model's own (a student's distilled steps, else one per token)
    threshold: float | None = None  # commit every position above this confidence (`--threshold`)
    remasking: str | None = None  # which positions a step reveals (`--remasking`; None: the model's own)
    model: Any = None
    tokenizer: Any = None


@dataclass(frozen=True)
class Figures:
    label: str
    steps: int
    passes_per_token: float
    tokens_per_cpu_second: float
    speedup: float  # tokens per CPU second over the first model's
    over_last: float  # tokens per CPU second over the last model's (an autoregressive twin, listed last)
    judge_perplexity: float
    unigram_entropy_bits: float
    distinct_2: float
    perplexity_change: float  # each as a relative change from the first model's
    entropy_change: float
    distinct_2_change: float
    # The perplexity change's 95% interval over the samples: what the samples drawn leave uncertain.
    perplexity_change_low: float
    perplexity_change_high: float


def parse_entry(text: str) -> Entry:
    """`PATH`, `PATH@STEPS` or `PATH@KEY=VALUE,...` with the keys `steps`, `threshold` and `remasking`."""

    path, _, spec = text.rpartition("@") if "@" in text else (text, "", "")
    if "/" in spec:  # an "@" inside the path itself
        path, spec = text, ""
    if not spec or spec.isdigit():
        return Entry(label=text, path=Path(path), steps=int(spec) if spec else None)
    settings = dict(item.split("=", 1) for item in spec.split(","))
    unknown = set(settings) - {"steps", "threshold", "remasking"}
    if unknown:
        raise typer.BadParameter(f"{text}: unknown setting {', '.join(sorted(unknown))} (steps, threshold, remasking)")
    steps, threshold = settings.get("steps"), settings.get("threshold")
    return Entry(
        label=text,
        path=Path(path),
        steps=int(steps) if steps else None,
        threshold=float(threshold) if threshold else None,
        remasking=settings.get("remasking"),
    )


def _sampler(entry: Entry, length: int, num_samples: int, seed: int, produced: dict[str, Any]) -> Callable[[], None]:
    """One model's batch at `seed`, in its own steps; the result lands in `produced` (the same in every round)."""

    from dlm.diffusion.distillation import distilled_steps
    from dlm.sampling.generation import generate

    steps = entry.steps or distilled_steps(entry.model) or length

    def sample() -> None:
        produced[entry.label] = generate(
            entry.model,
            entry.tokenizer,
            length=length,
            steps=steps,
            num_samples=num_samples,
            seed=seed,
            threshold=entry.threshold,
            remasking=entry.remasking,
        )

    return sample


def change_interval(reference: list[tuple[float, int]], other: list[tuple[float, int]]) -> tuple[float, float]:
    """The 95% interval of the relative change in perplexity from `reference` to `other`, each a list of
    (row NLL per token, tokens): the token-weighted mean NLL's standard error over the rows of each,
    independent samples, under the normal approximation. A model against itself gives (0, 0)."""

    from dlm.bench.generation import token_weighted

    if other is reference:
        return 0.0, 0.0

    def mean_and_variance(rows: list[tuple[float, int]]) -> tuple[float, float]:
        mean, total = token_weighted(rows), sum(count for _, count in rows)
        return mean, sum((count * (nll - mean)) ** 2 for nll, count in rows) / total**2

    (first, first_var), (second, second_var) = mean_and_variance(reference), mean_and_variance(other)
    half = 1.96 * math.sqrt(first_var + second_var)
    return math.expm1(second - first - half), math.expm1(second - first + half)


def measure(
    entries: list[Entry], judge: Any, *, length: int, num_samples: int, seeds: list[int], repeats: int
) -> tuple[list[Figures], dict[str, Any]]:
    """Every model's figures over the seeds, and the raw rounds (CPU and wall seconds by seed and model)."""

    from dlm.bench.generation import (
        distinct_ngrams,
        judge_row_nlls,
        quality_changes,
        token_weighted,
        unigram_entropy,
    )
    from dlm.sampling.generation import generate

    torch.set_num_threads(1)
    labels = [entry.label for entry in entries]
    tokens: dict[str, list[list[int]]] = {label: [] for label in labels}
    cpu, passes = dict.fromkeys(labels, 0.0), dict.fromkeys(labels, 0.0)
    steps: dict[str, int] = {}
    raw: dict[str, Any] = {}
    for entry in entries:  # an untimed warm-up of each model's kernels, in its own steps
        generate(
            entry.model,
            entry.tokenizer,
            length=8,
            steps=entry.steps,
            num_samples=num_samples,
            threshold=entry.threshold,
            remasking=entry.remasking,
        )
    for seed in seeds:
        produced: dict[str, Any] = {}
        samplers = {entry.label: _sampler(entry, length, num_samples, seed, produced) for entry in entries}
        timings = interleaved(samplers, repeats, warmup=0, progress=harness.progress)
        raw[f"seed_{seed}"] = {
            label: {"cpu_s": [t.cpu_s for t in runs], "wall_s": [t.wall_s for t in runs]}
            for label, runs in timings.items()
        }
        for label in labels:
            result = produced[label]
            steps[label] = result.steps
            tokens[label] += [row[len(row) - length :] for row in result.token_ids]
            cpu[label] += min(t.cpu_s for t in timings[label])
            passes[label] += result.forward_passes / length / len(seeds)
    rows: list[dict[str, Any]] = []
    scored = {label: judge_row_nlls(judge, tokens[label]) for label in labels}
    for label in labels:
        rate = sum(len(row) for row in tokens[label]) / cpu[label]
        rows.append(
            {
                "label": label,
                "steps": steps[label],
                "passes_per_token": passes[label],
                "tokens_per_cpu_second": rate,
                "judge_perplexity": math.exp(token_weighted(scored[label])),
                "unigram_entropy_bits": unigram_entropy(tokens[label]),
                "distinct_2": distinct_ngrams(tokens[label], 2),
            }
        )
    first, last = rows[0], rows[-1]
    figures = [
        Figures(
            **(row | quality_changes(row, first)),
            speedup=row["tokens_per_cpu_second"] / first["tokens_per_cpu_second"],
            over_last=row["tokens_per_cpu_second"] / last["tokens_per_cpu_second"],
            perplexity_change_low=low,
            perplexity_change_high=high,
        )
        for row, (low, high) in zip(
            rows, (change_interval(scored[labels[0]], scored[label]) for label in labels), strict=True
        )
    ]
    return figures, raw


def table(figures: list[Figures]) -> str:
    lines = [
        "| model | steps | passes/token | tokens/CPU s | x first | judge ppl | entropy (bits) | distinct-2 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in figures:
        lines.append(
            f"| {row.label} | {row.steps} | {row.passes_per_token:.3f} | {row.tokens_per_cpu_second:.0f} | "
            f"{row.speedup:.2f} | {row.judge_perplexity:.1f} ({row.perplexity_change:+.1%}, "
            f"{row.perplexity_change_low:+.1%} to {row.perplexity_change_high:+.1%}) | "
            f"{row.unigram_entropy_bits:.3f} ({row.entropy_change:+.1%}) | "
            f"{row.distinct_2:.3f} ({row.distinct_2_change:+.1%}) |"
        )
    return "\n".join(lines)


def distill(
    models: Annotated[
        list[str],
        typer.Argument(
            help="PATH, PATH@STEPS or PATH@KEY=VALUE,... (steps=S, threshold=P, remasking=NAME), first the reference."
        ),
    ],
    judge: Annotated[Path, typer.Option(help="The model that scores every sample (best autoregressive).")],
    length: Annotated[int, typer.Option(help="Tokens per sample.")] = 64,
    num_samples: Annotated[int, typer.Option(help="Samples per model and seed (one batch).")] = 16,
    seeds: Annotated[str, typer.Option(help="Seeds, comma-separated.")] = "0,1,2",
    repeats: Annotated[int, typer.Option(help="Interleaved rounds per seed.")] = 2,
    name: Annotated[str, typer.Option(help="Name of the result file.")] = "distill",
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """Tokens per CPU second over the first model's, judge perplexity and diversity of models at their own steps."""

    from dlm.artifacts.loading import load_model

    seed_list = [int(seed) for seed in seeds.split(",")]
    run = harness.start(
        name,
        models=models,
        judge=str(judge),
        length=length,
        num_samples=num_samples,
        seeds=seed_list,
        repeats=repeats,
    )
    entries = [parse_entry(text) for text in models]
    for entry in entries:
        entry.model, entry.tokenizer = load_model(entry.path)
    judged, _ = load_model(judge)
    figures, raw = measure(entries, judged, length=length, num_samples=num_samples, seeds=seed_list, repeats=repeats)
    path = run.save({"reference": models[0], "models": [asdict(row) for row in figures]}, raw, results=results)
    typer.echo(
        f"{num_samples} samples x {len(seed_list)} seeds of {length} tokens, least CPU time of "
        f"{repeats} interleaved rounds, one thread; judge: {judge}"
    )
    typer.echo(table(figures))
    typer.echo(f"wrote {path}")
