"""`gpu-throughput`: dlm's training step against the compiled plain-PyTorch baseline, on one GPU.

Stage core: the bf16 matmul ceiling (the baseline's own measurement, benchmarks/baselines/plain_gpu.py),
then at ~110M (configs/gpt2-small.toml, batch 32) and ~1.3B (configs/1b.toml, batch 8) `dlm bench
--fused-attention` (bf16, one micro-batch per optimizer step, as the baseline) beside the baseline
compiled at both sizes, and a block-diffusion step (B = 16) at 110M; with --probe-quality, first the
step time of each quality variant (the quality part fits its schedule to it). Stage extra: the memory
search first (the largest 1.3B batch with adamw8bit and activation checkpointing within 24 GiB), cuDNN
attention first at both sizes, 1.3B with adamw8bit and checkpointing (eager: its peak bounds the
compiled one), and dlm at 110M compiled as one whole-model graph. MFU is against the measured ceiling
(and the datasheet's, where dlm knows the GPU). dlm's cases run before the baseline's, so a part cut
off by its time limit keeps dlm's figures; the baseline's are on record in the report.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Literal

import typer

from benchmarks.gpu.common import (
    DLM_COMMON,
    QUALITY_DEFAULT,
    QUALITY_VARIANTS,
    ROOT,
    SIZES,
    Records,
    baseline_module,
    error_text,
    free_cuda,
    stamp,
)

ADAMW_1B = ["training.optimizer=adamw", "model.activation_checkpointing=false"]
# (size, case, overrides) of dlm per stage; the plain-PyTorch compiled baseline runs where named.
DLM_CASES: dict[str, list[tuple[str, str, list[str]]]] = {
    "core": [
        ("110M", "dlm-110M", []),
        ("110M", "dlm-110M-block16", ["model.block_size=16"]),
        ("1.3B", "dlm-1.3B-adamw", ADAMW_1B),
    ],
    "extra": [
        ("110M", "dlm-110M-cudnn", ["training.attention_kernel=cudnn"]),
        ("1.3B", "dlm-1.3B-adamw-cudnn", [*ADAMW_1B, "training.attention_kernel=cudnn"]),
        (
            "1.3B",
            "dlm-1.3B-adamw8bit-ckpt-eager",
            ["training.optimizer=adamw8bit", "model.activation_checkpointing=true", "training.compile=false"],
        ),
        ("110M", "dlm-110M-whole-model-graph", ["training.compile_scope=model"]),
    ],
}
BASELINE_SIZES = {"core": ["110M", "1.3B"], "extra": []}
MEMORY_CASE = ("1.3B", "dlm-1.3B-adamw8bit-ckpt-max-batch-24GiB", 24.0)


def baseline_case(baseline: ModuleType, size: str, ceiling: float, records: Records) -> None:
    """The baseline's own `run_case`, compiled (its faster setting), on a model built on the GPU."""

    import torch

    cfg, batch = SIZES[size]["baseline"], SIZES[size]["batch"]
    torch.manual_seed(0)
    try:
        with torch.device("cuda"):
            model = baseline.Baseline(*cfg)
        record = baseline.run_case(f"baseline-{size}", model, model, cfg, batch, True, True)
        del model
        mfu = round(100 * record["model_tflops"] / ceiling, 1)
        records.add({"source": "baseline", "size": size, **record, "mfu_measured_pct": mfu})
    except Exception as exc:  # one failed case must not cost the others
        records.add(
            {"source": "baseline", "size": size, "case": f"baseline-{size}", "compile": True, "error": error_text(exc)}
        )
    free_cuda()


def dlm_case(
    size: str, name: str, overrides: list[str], steps: int, warmup: int, ceiling: float, records: Records
) -> None:
    from dlm.bench.throughput import run_benchmark
    from dlm.config.schema import load_config

    spec = SIZES[size]
    result = None
    try:
        experiment = load_config(ROOT / spec["config"], DLM_COMMON + overrides)
        result = run_benchmark(
            experiment,
            steps=steps,
            warmup=warmup,
            batch_size=spec["batch"],
            fused_attention=True,
            measured_peak=ceiling * 1e12,
        )
    except Exception as exc:  # one failed case must not cost the others
        records.add({"source": "dlm", "size": size, "case": name, "error": error_text(exc)})
    free_cuda()  # after the except block, whose traceback would keep the failed case's tensors alive
    if result is None:
        return
    tflops = result.model_flops_per_second / 1e12
    records.add(
        {
            "source": "dlm",
            "size": size,
            "case": name,
            "params_M": round(result.parameters / 1e6, 1),
            "batch": result.batch_size,
            "seq": result.seq_len,
            "compile": result.compile,
            "optimizer": result.optimizer,
            "activation_checkpointing": result.activation_checkpointing,
            "tokens_per_s": round(result.tokens_per_second),
            "model_tflops": round(tflops, 1),
            "mfu_measured_pct": round(100 * tflops / ceiling, 1),
            "mfu_datasheet_pct": None if result.mfu is None else round(100 * result.mfu, 1),
            "step_ms": round(result.step_time_s * 1e3, 2),
            "spread_pct": round(result.step_time_spread_pct, 1),
            "warmup_s": round(result.warmup_seconds, 1),
            "peak_gib": round(result.peak_allocated_gib or 0.0, 2),
            "reserved_gib": round(result.peak_reserved_gib or 0.0, 2),
            "attention": result.attention_backend,
            "loss": round(result.loss, 4),
        }
    )


def quality_step_times(steps: int, warmup: int, records: Records) -> None:
    """The step time of each quality variant (compiled, its own batch), for fitting its schedule later."""

    from dlm.bench.throughput import run_benchmark
    from dlm.config.schema import load_config

    for variant in QUALITY_DEFAULT:
        config, overrides = QUALITY_VARIANTS[variant]
        case = f"dlm-shakespeare-14M-{variant}"
        try:
            experiment = load_config(ROOT / config, ["training.device=cuda", *overrides])
            result = run_benchmark(experiment, steps=steps, warmup=warmup)
            record: dict[str, Any] = {
                "source": "dlm",
                "case": case,
                "step_ms": round(result.step_time_s * 1e3, 3),
                "tokens_per_s": round(result.tokens_per_second),
                "compile": result.compile,
                "warmup_s": round(result.warmup_seconds, 1),
                "batch": result.batch_size,
            }
            records.add(record)
        except Exception as exc:
            records.add({"source": "dlm", "case": case, "error": error_text(exc)})
        free_cuda()


def memory_search(records: Records) -> None:
    """`dlm bench --find-max-batch --memory-limit 24` for 1.3B with adamw8bit and checkpointing (eager)."""

    from dlm.bench.throughput import find_max_batch
    from dlm.config.schema import load_config

    size, case, limit = MEMORY_CASE
    overrides = ["training.optimizer=adamw8bit", "model.activation_checkpointing=true", "training.compile=false"]
    try:
        experiment = load_config(ROOT / SIZES[size]["config"], DLM_COMMON + overrides)
        search = find_max_batch(experiment, fused_attention=True, memory_limit_gib=limit, limit=256)
        found = {"memory_limit_gib": limit, "max_batch": search.batch_size, "probes": search.probes}
        records.add({"source": "dlm", "size": size, "case": case, **found})
    except Exception as exc:
        records.add({"source": "dlm", "size": size, "case": case, "error": error_text(exc)})
    free_cuda()


def gpu_throughput(
    out: Annotated[Path, typer.Option(help="The JSON-lines file each figure is appended to.")],
    stage: Annotated[Literal["core", "extra"], typer.Option(help="Which cases (see the module's docstring).")] = "core",
    baseline: Annotated[
        bool, typer.Option(help="Also time the compiled baseline (--no-baseline: its figure is on record).")
    ] = True,
    probe_quality: Annotated[
        bool, typer.Option(help="First time the quality variants' steps (for a later gpu-quality).")
    ] = False,
    steps: Annotated[int, typer.Option(min=1, help="Timed optimizer steps of each dlm case.")] = 10,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed steps before them (compilation).")] = 4,
) -> None:
    """Tokens/s and MFU of dlm's training step beside the compiled plain-PyTorch baseline, on one GPU."""

    records = Records(out, "throughput", stamp())
    plain_gpu = baseline_module("plain_gpu")
    ceiling = plain_gpu.matmul_ceiling()
    records.add({"case": "matmul-ceiling", "matmul_bf16_tflops": round(ceiling, 1)})
    if stage == "core" and probe_quality:  # the quality part fits its schedule to these step times
        quality_step_times(steps, warmup, records)
    if stage == "extra":
        memory_search(records)  # the memory target first: the baseline's 1.3B compile is the slow part
    for size, name, overrides in DLM_CASES[stage]:
        dlm_case(size, name, overrides, steps, warmup, ceiling, records)
    for size in BASELINE_SIZES[stage] if baseline else []:
        baseline_case(plain_gpu, size, ceiling, records)
    typer.echo(f"appended to {out}")
