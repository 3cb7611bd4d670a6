"""Two costs of sampling, each against what it replaced or is compared with, interleaved in one process on one thread.

token-draw: dlm's token draw against the textbook one. The textbook draw (written out below, as dlm
drew tokens before 0.10) sorts each row for the top-p cut and adds float64 Gumbel noise to every
logit; `dlm.sampling.tokens.sample_tokens` draws by the inverse of the distribution function in
blocks of 64, with the nucleus by rejection (no sort, one uniform per trial). On logits as a
bfloat16 model gives them it checks that both draw from the same distribution (each sampler's
frequencies over many draws of one row of 64 tokens against the exact nucleus distribution, as a
total variation) and times both on [rows, vocab] in CPU seconds. 128 rows is what one step of 16
samples x 64 tokens reveals at 8 steps.

forward-share: the share of sampling's CPU time spent in the model's forward passes, on an exported
model: the rest is the sampler's own work (the token draw, the reveal, Python per step), which a
step that reveals more tokens does not make cheaper.

threshold-cost: a threshold pass against a plain pass on an untrained whole-sequence model: plain
sampling (ancestral, the defaults: a pass samples only the positions it reveals), plain sampling
with `confidence` remasking (a pass samples every masked position, as a threshold pass must) and
threshold sampling, one step per token. The figure of each is its fastest per-pass wall time (the
least disturbed run), as the docs' figures were measured.

Only ratios carry over between machines: the candidates run in rounds with rotating order, so other
work on shared cores slows them alike.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import torch
import typer

import dlm
from benchmarks import harness
from dlm.bench.measure import interleaved, round_ratios, spread
from dlm.config.schema import ModelConfig
from dlm.model.transformer import DiffusionTransformer
from dlm.runtime.allocator import keep_freed_memory
from dlm.sampling.dispatch import denoise
from dlm.sampling.options import SamplingOptions
from dlm.sampling.tokens import filter_logits, sample_tokens


def textbook_draw(logits: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """The top-p cut by a sort, then Gumbel-max with float64 noise over the whole vocabulary."""

    logits = filter_logits(logits.double(), top_p=top_p)
    uniform = torch.rand(logits.shape, dtype=torch.float64, generator=generator)
    return (logits - uniform.clamp_min(torch.finfo(torch.float64).tiny).log().neg().log()).argmax(dim=-1)


def dlm_draw(logits: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    return sample_tokens(logits, top_p=top_p, generator=generator)


SAMPLERS = {"textbook": textbook_draw, "dlm": dlm_draw}


def bfloat16_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * 2.5).bfloat16().float()


def total_variation(top_p: float, draws: int) -> dict[str, float]:
    """Each sampler's total variation from the exact nucleus distribution of one 64-token row."""

    row = bfloat16_logits(1, 64, seed=1)
    exact = filter_logits(row.double(), top_p=top_p).softmax(dim=-1)[0]
    distances = {}
    for name, draw in SAMPLERS.items():
        tokens = draw(row.expand(draws, -1), top_p, torch.Generator().manual_seed(2))
        frequencies = torch.bincount(tokens, minlength=64).double() / draws
        distances[name] = float((frequencies - exact).abs().sum() / 2)
    return distances


def token_draw(
    rows: Annotated[int, typer.Option(help="Positions drawn at once.")] = 128,
    vocab: Annotated[int, typer.Option(help="Vocabulary size.")] = 8192,
    top_p: Annotated[float, typer.Option(help="Nucleus of both draws.")] = 0.9,
    rounds: Annotated[int, typer.Option(min=1, help="Timed draws of each, interleaved.")] = 20,
    draws: Annotated[int, typer.Option(min=1, help="Draws of the distribution check.")] = 200_000,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """dlm's token draw against the textbook sort + Gumbel one: same distribution, CPU time of each."""

    run = harness.start("token-draw", rows=rows, vocab=vocab, top_p=top_p, rounds=rounds, draws=draws)
    torch.set_num_threads(1)
    keep_freed_memory(torch.device("cpu"))  # as dlm's sampling does
    distances = total_variation(top_p, draws)
    logits, generator = bfloat16_logits(rows, vocab, seed=0), torch.Generator().manual_seed(3)
    candidates = {name: functools.partial(draw, logits, top_p, generator) for name, draw in SAMPLERS.items()}
    timings = interleaved(candidates, rounds, progress=harness.progress)
    cpu_ms = {name: [timing.cpu_s * 1e3 for timing in runs] for name, runs in timings.items()}
    figures = {
        "total_variation": distances,
        "cpu_ms": {name: statistics.median(values) for name, values in cpu_ms.items()},
        "textbook_over_dlm": spread(round_ratios(cpu_ms["textbook"], cpu_ms["dlm"])),
    }
    path = run.save(figures, {"cpu_ms": cpu_ms}, results=results)
    typer.echo(f"{rows} rows x {vocab} tokens, top-p {top_p}, one thread, median CPU time of {rounds}:")
    for name in SAMPLERS:
        typer.echo(
            f"{name:>9}: {figures['cpu_ms'][name]:8.2f} ms, total variation from the nucleus {distances[name]:.4f}"
        )
    typer.echo(f"textbook / dlm: {figures['textbook_over_dlm']['median']:.2f}x; wrote {path}")


def _pass_runner(
    model: DiffusionTransformer, tokens: torch.Tensor, options: SamplingOptions, passes: dict[str, int], name: str
) -> Callable[[], None]:
    """One whole sampling run, the same seed each time; records its number of passes."""

    fill = torch.ones(tokens.shape[1], dtype=torch.bool)

    def sample() -> None:
        _, passes[name] = denoise(model, tokens, fill, options, generator=torch.Generator().manual_seed(0))

    return sample


def threshold_cost(
    vocab: Annotated[int, typer.Option(help="Vocabulary of the untrained model.")] = 2048,
    length: Annotated[int, typer.Option(help="Its context: the tokens sampled, one step each.")] = 64,
    samples: Annotated[int, typer.Option(help="Samples drawn at once.")] = 4,
    rounds: Annotated[int, typer.Option(min=1, help="Timed runs of each, interleaved.")] = 10,
    threshold: Annotated[float, typer.Option(help="The threshold sampler's confidence threshold.")] = 0.9,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """Per-pass time of threshold sampling over plain sampling's, on one tiny untrained model."""

    parameters = {"vocab": vocab, "length": length, "samples": samples, "rounds": rounds, "threshold": threshold}
    run = harness.start("threshold-cost", **parameters)
    torch.set_num_threads(1)
    config = ModelConfig(vocab_size=vocab, max_seq_len=length, d_model=64, n_layers=2, n_heads=2, pad_vocab_multiple=64)
    torch.manual_seed(0)
    model = DiffusionTransformer(config).eval()
    tokens = torch.full((samples, length), config.mask_token_id)
    settings = {
        "plain": SamplingOptions(steps=length),
        "plain_confidence": SamplingOptions(steps=length, remasking="confidence"),
        "threshold": SamplingOptions(steps=length, threshold=threshold),
    }
    passes: dict[str, int] = {}
    candidates = {name: _pass_runner(model, tokens, options, passes, name) for name, options in settings.items()}
    with torch.inference_mode():
        timings = interleaved(candidates, rounds, progress=harness.progress)
    per_pass = {name: [t.wall_s * 1e3 / passes[name] for t in runs] for name, runs in timings.items()}
    best = {name: min(values) for name, values in per_pass.items()}
    figures = {
        "per_pass_ms": best,
        "passes": passes,
        "threshold_over_plain": best["threshold"] / best["plain"],
        "threshold_over_plain_confidence": best["threshold"] / best["plain_confidence"],
        "threshold_over_plain_rounds": spread(round_ratios(per_pass["threshold"], per_pass["plain"])),
    }
    path = run.save(figures, {"per_pass_ms": per_pass}, results=results)
    typer.echo("per pass (fastest): " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in best.items()))
    typer.echo(
        f"threshold / plain {figures['threshold_over_plain']:.2f}, "
        f"threshold / plain confidence {figures['threshold_over_plain_confidence']:.2f}; wrote {path}"
    )


def forward_share(
    model: Annotated[Path, typer.Argument(help="The exported model directory (`dlm export`).")],
    length: Annotated[int, typer.Option(help="Tokens generated after an empty prompt.")] = 64,
    samples: Annotated[int, typer.Option(help="Samples drawn at once.")] = 16,
    steps: Annotated[int, typer.Option(help="Denoising steps (passes) for the whole length.")] = 8,
    repeats: Annotated[int, typer.Option(min=1, help="Timed generations (after one untimed).")] = 5,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """The share of one-thread sampling CPU time spent in the model's forward passes."""

    run = harness.start("forward-share", model=str(model), length=length, samples=samples, steps=steps, repeats=repeats)
    torch.set_num_threads(1)  # one thread: this thread's CPU clock counts all the arithmetic
    loaded, tokenizer = dlm.load(model, device="cpu")
    inside = [0.0]
    entered = [0.0]
    loaded.register_forward_pre_hook(lambda module, args: entered.__setitem__(0, time.thread_time()))
    loaded.register_forward_hook(
        lambda module, args, output: inside.__setitem__(0, inside[0] + time.thread_time() - entered[0])
    )

    def generation(seed: int) -> tuple[float, float, int]:
        inside[0] = 0.0
        started = time.thread_time()
        result = dlm.sample(loaded, tokenizer, prompt="", length=length, num_samples=samples, seed=seed, steps=steps)
        return inside[0], time.thread_time() - started, result.forward_passes

    generation(0)  # untimed: the allocator and kernels warm up
    rounds = [generation(1 + index) for index in range(repeats)]
    shares = [forward / total for forward, total, _ in rounds]
    figures = {
        "forward_share": statistics.median(shares),
        "forward_share_rounds": spread(shares),
        "passes": rounds[0][2],
        "cpu_ms_per_pass": statistics.median(1e3 * total / passes for _, total, passes in rounds),
    }
    path = run.save(
        figures, {"forward_cpu_s": [r[0] for r in rounds], "total_cpu_s": [r[1] for r in rounds]}, results=results
    )
    typer.echo(
        f"forward passes: {figures['forward_share']:.0%} of the sampling CPU time ({rounds[0][2]} passes); wrote {path}"
    )
