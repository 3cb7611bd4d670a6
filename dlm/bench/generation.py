"""Generation benchmark: speed and quality of sampler settings, measured together.

Speed alone rewards a sampler that commits everything in one step and repeats itself, so every
setting also reports two quality figures of its samples:

- generative perplexity under a judge model: exp of the judge's negative log-likelihood per token.
  A block model with `block_size = 1` is autoregressive and scores the exact NLL (every position
  masked, the clean sequence as context); any other model scores its Monte Carlo negative ELBO, an
  upper bound on its NLL, with the estimator of `dlm.evaluation.evaluate`.
- unigram entropy (bits) of all generated tokens pooled: repetition lowers it.

Settings are sampler options of `dlm.sampling.generation.generate` (`steps`, `block_length`, `threshold`,
`cache`, `remasking`, ...), one row per combination of the `--compare key=v1,v2` values.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dlm.bench.setup import compare_settings
from dlm.diffusion.distillation import distilled_steps
from dlm.diffusion.objective import elbo_nll
from dlm.diffusion.schedules import DEFAULT_MASK_EPS, model_schedule
from dlm.errors import UserError
from dlm.model.denoiser import block_size, masked_logits
from dlm.sampling.options import SamplingOptions

if TYPE_CHECKING:
    from dlm.model.denoiser import Denoiser
    from dlm.sampling.options import SampleResult

# Sampler options a setting may name, and how each value is read ("none" turns an optional one off).
_OPTION_TYPES: dict[str, Callable[[str], Any]] = {
    "steps": int,
    "block_length": int,
    "threshold": float,
    "cache": str,
    "remasking": str,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "reveal_split": str,
}
Progress = Callable[[str], None]


def parse_generate_compare(items: list[str]) -> list[dict[str, Any]]:
    """`["cache=none,dual", "threshold=none,0.9"]` -> one dict of sampler options per combination."""

    parsed: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        choices = [value.strip() for value in values.split(",") if value.strip()]
        if not sep or not choices or key not in _OPTION_TYPES:
            raise UserError(
                f"--compare {item!r} is not of the form key=value1,value2 with a sampler option as key",
                fix=f"keys: {', '.join(_OPTION_TYPES)}; e.g. --compare cache=none,prefix,dual",
            )
        parsed.append((key, choices))
    settings = []
    for setting in compare_settings(parsed):
        try:
            settings.append(
                {
                    key: None if value == "none" and key != "cache" else _OPTION_TYPES[key](value)
                    for key, value in setting.items()
                }
            )
        except ValueError as exc:
            raise UserError(f"--compare has a value of the wrong type: {exc}") from None
    return settings


def check_judge_tokenizer(model: tuple[Path, Any], judge: tuple[Path, Any]) -> None:
    """Refuse a judge whose tokenizer is not the model's: the judge scores the generated token ids, which
    under another vocabulary are other text (or out of its range). Each side is (tokenizer file, tokenizer),
    compared by the full contents loading exposes (vocabulary, merges, special tokens, normalization)."""

    (model_path, model_tokenizer), (judge_path, judge_tokenizer) = model, judge
    if model_tokenizer.to_str() == judge_tokenizer.to_str():
        return

    def name(path: Path, tokenizer: Any) -> str:
        return f"{path} ({tokenizer.get_vocab_size():,} tokens)"

    raise UserError(
        f"the judge's tokenizer {name(judge_path, judge_tokenizer)} is not the model's "
        f"{name(model_path, model_tokenizer)}: the judge scores the generated token ids",
        fix="judge with a model trained with the same tokenizer, or leave out --judge",
    )


@dataclass(frozen=True)
class GenerateRow:
    """One setting's figures."""

    setting: dict[str, Any]
    generated_tokens: int
    seconds: float
    tokens_per_second: float
    passes_per_token: float  # forward passes per generated token of one sample
    forward_tokens_per_token: float  # token positions fed to the model per generated token: compute
    judge_perplexity: float
    unigram_entropy_bits: float
    example: str
    # CPU seconds of this process (all its threads) in the least of the runs: on shared cores, other
    # work stretches wall time but hardly the CPU time a setting uses.
    cpu_seconds: float = math.nan
    tokens_per_cpu_second: float = math.nan
    distinct_2: float = math.nan  # distinct bigrams of the generated tokens (`distinct_ngrams`)


@dataclass(frozen=True)
class Relative:
    """A row's figures as ratios to the default sampler's row of the same run."""

    speedup: float  # tokens/s over the default's
    cpu_speedup: float  # tokens per CPU second over the default's
    perplexity_change: float  # judge perplexity / the default's - 1
    entropy_change: float  # unigram entropy / the default's - 1
    frontier: bool  # no other row has both more tokens per CPU second and a lower judge perplexity

    def within(self, perplexity_bound: float, entropy_bound: float) -> bool:
        return abs(self.perplexity_change) <= perplexity_bound and abs(self.entropy_change) <= entropy_bound


@dataclass
class GenerateReport:
    length: int
    num_samples: int
    judge: str
    repeats: int = 1
    rows: list[GenerateRow] = field(default_factory=list)
    seed: int = 0
    default_steps: int | None = None  # the default sampler's steps: a distilled student's, else one per token

    def default_row(self) -> GenerateRow | None:
        """The row of the default sampler (`dlm sample`'s options, one step per token), when a setting is it."""

        defaults = asdict(SamplingOptions()) | {"steps": self.default_steps or self.length}
        return next(
            (
                row
                for row in self.rows
                if all(defaults.get(key, object()) == value for key, value in row.setting.items())
            ),
            None,
        )

    def relative(self) -> list[Relative] | None:
        """Every row against the default sampler's row (None without one): ratios taken within one run,
        where other work on the machine slowed all settings alike, carry over; absolute tokens/s do not."""

        reference = self.default_row()
        if reference is None:
            return None
        return [
            Relative(
                row.tokens_per_second / reference.tokens_per_second,
                row.tokens_per_cpu_second / reference.tokens_per_cpu_second,
                row.judge_perplexity / reference.judge_perplexity - 1,
                row.unigram_entropy_bits / reference.unigram_entropy_bits - 1,
                not any(
                    other.tokens_per_cpu_second > row.tokens_per_cpu_second
                    and other.judge_perplexity < row.judge_perplexity
                    for other in self.rows
                ),
            )
            for row in self.rows
        ]

    def to_dict(self) -> dict[str, Any]:
        relative = self.relative()
        return asdict(self) | {"relative_to_default": None if relative is None else [asdict(r) for r in relative]}


def unigram_entropy(token_ids: list[list[int]]) -> float:
    """Entropy in bits of the pooled token frequencies."""

    counts = Counter(token for row in token_ids for token in row)
    total = sum(counts.values())
    return -sum(n / total * math.log2(n / total) for n in counts.values()) if total else 0.0


def distinct_ngrams(token_ids: list[list[int]], n: int = 2) -> float:
    """Distinct n-grams over all n-grams of the rows (distinct-n): 1 when nothing repeats, low for a
    sampler that writes the same phrases again and again, whatever its perplexity."""

    grams = [tuple(row[i : i + n]) for row in token_ids for i in range(len(row) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def quality_changes(figures: Mapping[str, float], reference: Mapping[str, float]) -> dict[str, float]:
    """Samples' judge perplexity, unigram entropy and distinct-2 (`judge_perplexity`, `unigram_entropy_bits`,
    `distinct_2`) as changes against a reference's from the same run: value / reference - 1."""

    return {
        "perplexity_change": figures["judge_perplexity"] / reference["judge_perplexity"] - 1,
        "entropy_change": figures["unigram_entropy_bits"] / reference["unigram_entropy_bits"] - 1,
        "distinct_2_change": figures["distinct_2"] / reference["distinct_2"] - 1,
    }


def _row_nll(judge: Denoiser, clean: torch.Tensor, mc_samples: int, generator: torch.Generator) -> float:
    """NLL per token of one sequence [1, L]: exact for an autoregressive judge, else the MC ELBO."""

    config = judge.config
    if block_size(config) == 1:  # every position sees only the clean prefix
        noisy = torch.full_like(clean, config.mask_token_id)
        logits = masked_logits(judge, noisy, torch.ones_like(clean, dtype=torch.bool), clean)
        return float(torch.nn.functional.cross_entropy(logits.double(), clean[0], reduction="mean"))

    def logits_fn(noisy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return masked_logits(judge, noisy, mask, clean)

    mean, _ = elbo_nll(
        logits_fn,
        clean,
        config.mask_token_id,
        mc_samples,
        DEFAULT_MASK_EPS,
        generator,
        schedule=model_schedule(judge),
        block_size=block_size(config),
    )
    return float(mean[0])


@torch.inference_mode()
def judge_nll(judge: Denoiser, token_ids: list[list[int]], *, mc_samples: int = 16, seed: int = 0) -> float:
    """The judge's negative log-likelihood per token (nats) over all rows, token-weighted."""

    return token_weighted(judge_row_nlls(judge, token_ids, mc_samples=mc_samples, seed=seed))


def token_weighted(scored: list[tuple[float, int]]) -> float:
    """The NLL per token over rows scored by `judge_row_nlls`, each row weighted by its tokens."""

    return sum(nll * count for nll, count in scored) / max(sum(count for _, count in scored), 1)


@torch.inference_mode()
def judge_row_nlls(
    judge: Denoiser, token_ids: list[list[int]], *, mc_samples: int = 16, seed: int = 0
) -> list[tuple[float, int]]:
    """Each row's negative log-likelihood per token (nats) under the judge, with the tokens scored.

    Rows are scored one by one (they may differ in length), cut to the judge's context, drawing from one
    generator in row order: a row's figure depends on the rows before it only through a Monte Carlo judge.
    """

    config = judge.config
    device = next(iter(judge.parameters())).device
    generator = torch.Generator(device=device).manual_seed(seed)
    scored: list[tuple[float, int]] = []
    for row in token_ids:
        clean = torch.tensor([row[: config.max_seq_len]], device=device)
        scored.append((_row_nll(judge, clean, mc_samples, generator), clean.shape[1]))
    return scored


def _measure(
    judge: Denoiser,
    setting: dict[str, Any],
    base: dict[str, Any],
    mc_samples: int,
    result: SampleResult,
    cpu_seconds: float,
) -> GenerateRow:
    options = base | setting
    generated = sum(result.lengths)
    per_sample = generated / max(len(result.lengths), 1)
    judge.eval()
    nll = judge_nll(judge, result.token_ids, mc_samples=mc_samples, seed=options["seed"])
    fill_from = len(result.token_ids[0]) - result.lengths[0]  # the prompt, when there is one
    samples = [row[fill_from:] for row in result.token_ids]
    return GenerateRow(
        setting=setting,
        generated_tokens=generated,
        seconds=result.seconds,
        tokens_per_second=generated / result.seconds if result.seconds > 0 else math.inf,
        passes_per_token=result.forward_passes / per_sample,
        forward_tokens_per_token=result.forward_tokens / max(generated, 1),
        judge_perplexity=math.exp(nll),
        unigram_entropy_bits=unigram_entropy(samples),
        example=result.texts[0][:120],
        cpu_seconds=cpu_seconds,
        tokens_per_cpu_second=generated / cpu_seconds if cpu_seconds > 0 else math.inf,
        distinct_2=distinct_ngrams(samples, 2),
    )


def benchmark_generation(
    model: Denoiser,
    tokenizer: Any,
    *,
    judge: Denoiser | None = None,
    judge_name: str = "the model itself",
    compare: list[str] | None = None,
    length: int | None = None,
    num_samples: int = 4,
    seed: int = 0,
    mc_samples: int = 16,
    repeats: int = 1,
    progress: Progress | None = None,
) -> GenerateReport:
    """Sample with every setting, timing it, and score the samples with `judge` (default: the model).

    `length` defaults to the model's context; the base setting takes one step per token (the
    slowest, reference sampler), or a distilled student's own steps, unless a setting names `steps`.
    The settings run in `repeats` interleaved rounds and each reports its fastest run (and, apart, its
    least CPU time of a run).
    """

    context = model.config.max_seq_len
    length = context if length is None else length
    # Checked here, in bench's own words: generate would blame a --prompt that bench does not have.
    if length > context and not block_size(model.config):
        raise UserError(
            f"--length ({length}) is more than the model's max_seq_len ({context})",
            fix="lower --length (default: the context), or bench a block model ([model] block_size), "
            "which generates past its context",
        )
    # One step per token, or the steps a distilled student samples in (what `dlm sample` runs).
    steps = distilled_steps(model) or length
    base: dict[str, Any] = {"length": length, "steps": steps, "num_samples": num_samples, "seed": seed}
    settings = parse_generate_compare(compare or []) or [{}]
    report = GenerateReport(length, num_samples, judge_name, repeats, seed=seed, default_steps=steps)
    from dlm.sampling.generation import generate  # looked up per call: tests count the calls

    # Untimed warm-up of the kernels, one token a step: what every model accepts, also one whose
    # blocks are shorter than the warm-up (an autoregressive block_size = 1 model needs a step a block).
    warmup = min(8, length)
    generate(model, tokenizer, **(base | {"length": warmup, "steps": warmup}))
    # Rounds: every setting runs once per round, so other work on the machine slows them alike and
    # the ratios stay fair. The same seed repeats the same samples; the fastest run of each setting
    # is the one least disturbed.
    fastest: list[SampleResult | None] = [None] * len(settings)
    least_cpu = [math.inf] * len(settings)
    for round_index in range(repeats):
        for index, setting in enumerate(settings):
            if progress is not None:
                progress(f"round {round_index + 1}/{repeats}: generating with {setting or 'the defaults'}")
            cpu_start = time.process_time()
            result = generate(model, tokenizer, **(base | setting))
            least_cpu[index] = min(least_cpu[index], time.process_time() - cpu_start)
            best = fastest[index]
            fastest[index] = result if best is None or result.seconds < best.seconds else best
    for setting, kept, cpu_seconds in zip(settings, fastest, least_cpu, strict=True):
        assert kept is not None
        report.rows.append(_measure(judge or model, setting, base, mc_samples, kept, cpu_seconds))
    return report


def setting_label(setting: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in setting.items()) or "defaults"


def report_table(report: GenerateReport) -> tuple[list[str], list[list[str]]]:
    """Headers and rows; with the default sampler among the settings, also each row's speed-up over it."""

    headers = ["setting", "tokens/s", "passes/token", "fed/token", "judge ppl", "entropy (bits)", "distinct-2"]
    rows = [
        [
            setting_label(row.setting),
            f"{row.tokens_per_second:.1f}",
            f"{row.passes_per_token:.3f}",
            f"{row.forward_tokens_per_token:.1f}",
            f"{row.judge_perplexity:.2f}",
            f"{row.unigram_entropy_bits:.3f}",
            f"{row.distinct_2:.3f}",
        ]
        for row in report.rows
    ]
    relative = report.relative()
    if relative is not None:
        headers[2:2] = ["x default", "x default (CPU s)"]
        for row, figures in zip(rows, relative, strict=True):
            row[2:2] = [f"{figures.speedup:.2f}", f"{figures.cpu_speedup:.2f}"]
    return headers, rows
