"""Models against each other at their own sampling steps: a teacher, its distilled students, a twin.

usage: python scripts/distill_frontier.py REFERENCE MODEL... --judge JUDGE [--length 64]
           [--num-samples 16] [--seeds 0,1,2] [--repeats 2] [--json FILE]

Each model is `PATH` (sampled in its own steps: a distilled student's, else one per token),
`PATH@STEPS`, or `PATH@KEY=VALUE,...` with the keys `steps` and `threshold` (e.g.
`student@threshold=0.7`: a certainty-forced student at a confidence threshold, whose passes per token
the table shows). For every seed the models sample `--num-samples` unconditional texts of `--length`
tokens in `--repeats` interleaved rounds on one thread; the least CPU time of a model's rounds is
its time for that seed. The judge (best an autoregressive model: its likelihood is exact) scores all
samples of all seeds. The table gives each model's tokens per CPU second as a ratio to the first
model's, its judge perplexity, unigram entropy and distinct bigrams and their changes from the
first model's: a student that looks good by perplexity alone while repeating itself shows it in
the last two. Ratios, not absolute times, carry over between machines.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass
class Entry:
    label: str
    path: Path
    steps: int | None  # None: the model's own (a student's distilled steps, else one per token)
    threshold: float | None = None  # commit every position above this confidence (`--threshold`)
    model: Any = None
    tokenizer: Any = None


@dataclass(frozen=True)
class Figures:
    label: str
    steps: int
    passes_per_token: float
    tokens_per_cpu_second: float
    speedup: float  # tokens per CPU second over the first model's
    judge_perplexity: float
    unigram_entropy_bits: float
    distinct_2: float


def parse_entry(text: str) -> Entry:
    path, _, spec = text.rpartition("@") if "@" in text else (text, "", "")
    if "/" in spec:  # an "@" inside the path itself
        path, spec = text, ""
    if not spec or spec.isdigit():
        return Entry(label=text, path=Path(path), steps=int(spec) if spec else None)
    settings = dict(item.split("=", 1) for item in spec.split(","))
    unknown = set(settings) - {"steps", "threshold"}
    if unknown:
        sys.exit(f"error: {text}: unknown setting {', '.join(sorted(unknown))} (steps, threshold)")
    steps, threshold = settings.get("steps"), settings.get("threshold")
    return Entry(
        label=text,
        path=Path(path),
        steps=int(steps) if steps else None,
        threshold=float(threshold) if threshold else None,
    )


def measure(
    entries: list[Entry], judge: Any, *, length: int, num_samples: int, seeds: list[int], repeats: int
) -> list[Figures]:
    import torch

    from dlm.bench.generation import distinct_ngrams, judge_nll, unigram_entropy
    from dlm.diffusion.distillation import distilled_steps
    from dlm.sampling.generation import generate

    torch.set_num_threads(1)
    tokens: dict[str, list[list[int]]] = {entry.label: [] for entry in entries}
    cpu: dict[str, float] = dict.fromkeys(tokens, 0.0)
    passes: dict[str, float] = dict.fromkeys(tokens, 0.0)
    steps: dict[str, int] = {}
    samples: dict[str, list[list[int]]] = {}
    passes_now: dict[str, int] = {}
    for entry in entries:  # an untimed warm-up of each model's kernels, in its own steps
        generate(
            entry.model,
            entry.tokenizer,
            length=8,
            steps=entry.steps,
            num_samples=num_samples,
            threshold=entry.threshold,
        )
    for seed in seeds:
        least = dict.fromkeys(tokens, math.inf)
        for _ in range(repeats):  # the same seed draws the same samples in every round
            for entry in entries:
                own = distilled_steps(entry.model) or length
                started = time.process_time()
                result = generate(
                    entry.model,
                    entry.tokenizer,
                    length=length,
                    steps=entry.steps or own,
                    num_samples=num_samples,
                    seed=seed,
                    threshold=entry.threshold,
                )
                least[entry.label] = min(least[entry.label], time.process_time() - started)
                steps[entry.label] = result.steps
                samples[entry.label] = [row[len(row) - length :] for row in result.token_ids]
                passes_now[entry.label] = result.forward_passes
        for entry in entries:
            tokens[entry.label] += samples[entry.label]
            cpu[entry.label] += least[entry.label]
            passes[entry.label] += passes_now[entry.label] / length / len(seeds)
    figures = []
    reference = None
    for entry in entries:
        generated = sum(len(row) for row in tokens[entry.label])
        rate = generated / cpu[entry.label]
        reference = rate if reference is None else reference
        figures.append(
            Figures(
                label=entry.label,
                steps=steps[entry.label],
                passes_per_token=passes[entry.label],
                tokens_per_cpu_second=rate,
                speedup=rate / reference,
                judge_perplexity=math.exp(judge_nll(judge, tokens[entry.label])),
                unigram_entropy_bits=unigram_entropy(tokens[entry.label]),
                distinct_2=distinct_ngrams(tokens[entry.label], 2),
            )
        )
    return figures


def table(figures: list[Figures]) -> str:
    first = figures[0]

    def change(value: float, base: float) -> str:
        return f"{value / base - 1:+.1%}"

    lines = [
        "| model | steps | passes/token | tokens/CPU s | x first | judge ppl | entropy (bits) | distinct-2 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in figures:
        lines.append(
            f"| {row.label} | {row.steps} | {row.passes_per_token:.3f} | {row.tokens_per_cpu_second:.0f} | "
            f"{row.speedup:.2f} | "
            f"{row.judge_perplexity:.1f} ({change(row.judge_perplexity, first.judge_perplexity)}) | "
            f"{row.unigram_entropy_bits:.3f} ({change(row.unigram_entropy_bits, first.unigram_entropy_bits)}) | "
            f"{row.distinct_2:.3f} ({change(row.distinct_2, first.distinct_2)}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="PATH, PATH@STEPS or PATH@threshold=P; the first is the reference")
    parser.add_argument("--judge", required=True)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from dlm.artifacts.loading import load_model

    entries = [parse_entry(text) for text in args.models]
    for entry in entries:
        entry.model, entry.tokenizer = load_model(entry.path)
    judge, _ = load_model(args.judge)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    figures = measure(
        entries, judge, length=args.length, num_samples=args.num_samples, seeds=seeds, repeats=args.repeats
    )
    print(
        f"{args.num_samples} samples x {len(seeds)} seeds of {args.length} tokens, least CPU time of "
        f"{args.repeats} interleaved rounds, one thread; judge: {args.judge}"
    )
    print(table(figures))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(row) for row in figures], indent=2) + "\n")


if __name__ == "__main__":
    main()
