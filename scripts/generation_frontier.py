"""The speed-quality frontier of the sampler settings on one model, against the default sampler.

usage: python scripts/generation_frontier.py MODEL --judge JUDGE [--length N] [--num-samples N ...]
                                             [--repeats N] [--seed N] [--compare key=v1,v2 ...] [--json FILE]

For each --num-samples (default: 1 and 16) it runs what `dlm bench --generate MODEL --judge JUDGE
--length N --num-samples S --repeats R --seed SEED --compare ...` runs (the same library call: every
combination of the --compare values, in interleaved rounds, the fastest run of each kept), then
prints a markdown table per batch size with each setting's tokens/s as a ratio to the default
sampler's in the same run (no blocks, no cache, no threshold, one step per token: the grid must hold
that combination), its judge perplexity and unigram entropy as changes from the default's, whether
it stays within the bounds (perplexity within --ppl-bound, entropy within --entropy-bound), and
whether it is on the frontier (no other setting is both faster and of lower judge perplexity).
Rows are ranked by tokens per CPU second of the process (the least over the runs), which other
work on shared cores disturbs far less than wall time; run it with OMP_NUM_THREADS=1 there. The
default grid: blocks none, 16 and 8 tokens; no cache and the dual cache; no threshold and
thresholds 0.9, 0.7, 0.5; the length, half of it and a quarter of it in steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from dlm.bench.generation import GenerateReport


def default_grid(length: int) -> list[str]:
    steps = sorted({length, max(length // 2, 1), max(length // 4, 1)}, reverse=True)
    return [
        "block_length=none,16,8",
        "cache=none,dual",
        "threshold=none,0.9,0.7,0.5",
        f"steps={','.join(map(str, steps))}",
    ]


def table(report: GenerateReport, ppl_bound: float, entropy_bound: float) -> list[str]:
    """Markdown rows, fastest first, and the fastest setting within the bounds."""

    from dlm.bench.generation import setting_label

    relative = report.relative()
    if relative is None:
        sys.exit(
            "error: the grid needs the default sampler (block_length=none, cache=none, threshold=none and "
            "steps=LENGTH) as the reference of the ratios"
        )
    lines = [
        "| setting | tokens/s | x default | x default (CPU s) | passes/token | judge ppl | ppl change | "
        "entropy (bits) | entropy change | within bounds | frontier |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    ranked = sorted(zip(report.rows, relative, strict=True), key=lambda pair: -pair[1].cpu_speedup)
    best = next(((row, r) for row, r in ranked if r.within(ppl_bound, entropy_bound)), None)
    for row, r in ranked:
        within, frontier = "yes" if r.within(ppl_bound, entropy_bound) else "no", "yes" if r.frontier else ""
        lines.append(
            f"| {setting_label(row.setting)} | {row.tokens_per_second:.0f} | {r.speedup:.2f} | "
            f"{r.cpu_speedup:.2f} | "
            f"{row.passes_per_token:.3f} | {row.judge_perplexity:.1f} | {r.perplexity_change:+.1%} | "
            f"{row.unigram_entropy_bits:.3f} | {r.entropy_change:+.1%} | {within} | {frontier} |"
        )
    if best is not None:
        lines.append(
            f"\nFastest within the bounds (by CPU seconds): {setting_label(best[0].setting)}, "
            f"{best[1].cpu_speedup:.2f}x the default sampler's tokens per CPU second "
            f"({best[1].speedup:.2f}x its tokens/s)."
        )
    return lines


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--judge", type=Path, required=True)
    parser.add_argument("--length", type=int, default=None, help="tokens per sample (default: the context)")
    parser.add_argument("--num-samples", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", action="append", default=None, help="as dlm bench's (default: the grid above)")
    parser.add_argument("--ppl-bound", type=float, default=0.10)
    parser.add_argument("--entropy-bound", type=float, default=0.05)
    parser.add_argument("--json", type=Path, default=None, help="also write every report here")
    args = parser.parse_args()
    from dlm.artifacts.loading import load_model_with_info
    from dlm.bench.generation import benchmark_generation, check_judge_tokenizer

    loaded, judged = load_model_with_info(args.model, device="cpu"), load_model_with_info(args.judge, device="cpu")
    check_judge_tokenizer(
        (loaded.info.tokenizer_path, loaded.tokenizer), (judged.info.tokenizer_path, judged.tokenizer)
    )
    length = args.length or loaded.model.config.max_seq_len
    compare = args.compare or default_grid(length)
    reports = []
    for num_samples in args.num_samples:
        report = benchmark_generation(
            loaded.model,
            loaded.tokenizer,
            judge=judged.model,
            judge_name=str(args.judge),
            compare=compare,
            length=length,
            num_samples=num_samples,
            seed=args.seed,
            repeats=args.repeats,
            progress=print_progress,
        )
        reports.append(report.to_dict())
        print(
            f"\n{num_samples} samples of {length} tokens per setting, fastest of {args.repeats} runs; "
            f"--compare {' --compare '.join(compare)}\n"
        )
        print("\n".join(table(report, args.ppl_bound, args.entropy_bound)), flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps(reports, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
