"""`dlm bench`: time the real training step on synthetic tokens.

What is timed is `TrainingStep.optimizer_step` (the very step `dlm train` runs: corruption, forward,
ELBO loss, backward, clipping, optimizer), with the config's model, precision, optimizer, compile
and accumulation settings. Tokens are random (never the mask id), so no tokenizer or data file is
needed. After `warmup` untimed steps (compilation, allocator and kernel-selection warmup), each of
`steps` steps is timed with CUDA events (or `perf_counter` on the CPU); tokens/s comes from the
median step time, which one slow step (a recompile, another process) cannot move.

Model FLOP/s use `model.flops_per_token` (6N + attention scores), the count of the plain-PyTorch
baselines (docs/benchmarks.md, "Training step: dlm against plain PyTorch"), so activation
checkpointing's recomputation is not counted as useful work. A block model's step is a forward and
backward over 2L tokens (noisy and clean copies), and its count says so: twice the matmuls, four
times the attention; `attention_backend` names the kernel of that masked pass. MFU is reported only
for devices in `dlm.runtime.flops`' peak table, else None ("n/a").
The results and what the CLI shows of them live in `dlm.bench.results`.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict

import torch

from dlm.bench.measure import interleaved
from dlm.bench.results import BatchSearch, BenchReport, BenchResult
from dlm.bench.setup import (
    attention_backend,
    bench_config,
    compare_settings,
    device_name,
    measure_matmul_peak,
    parse_compare,
    peak_rss_gib,
    release_memory,
    require_fused_attention,
    reset_peak_rss,
    set_memory_limit,
)
from dlm.config.schema import ExperimentConfig, ModelConfig, with_overrides
from dlm.errors import UserError
from dlm.fileio import GIB
from dlm.runtime.allocator import keep_freed_memory
from dlm.runtime.device import resolve_compile, resolve_device, resolve_training_precision, synchronize
from dlm.runtime.flops import peak_flops
from dlm.runtime.kernels import attention_kernel_context, configure_cuda_backends
from dlm.runtime.memory import is_out_of_memory
from dlm.train.distributed import DistributedContext
from dlm.train.memory import estimate_checkpoints, estimate_training_memory
from dlm.train.step import LogWindow, TrainingStep

MAX_BATCH_LIMIT = 1 << 16  # the batch finder never probes beyond this many sequences
Progress = Callable[[str], None]


class BenchOutOfMemoryError(UserError):
    """The configuration does not fit in the device memory (or in --memory-limit)."""


# ---- Timing ------------------------------------------------------------------------------------


def synthetic_batches(model: ModelConfig, batch_size: int, device: torch.device, seed: int) -> Iterator[torch.Tensor]:
    """The same batch of uniform random tokens, forever; the mask id never appears as a clean token."""

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.vocab_size - 1, (batch_size, model.max_seq_len), generator=generator)
    tokens += tokens >= model.mask_token_id  # skip over the mask id: uniform over the other ids
    tokens = tokens.to(device)
    while True:
        yield tokens


def timed_steps(step: TrainingStep, batches: Iterator[torch.Tensor], window: LogWindow, steps: int) -> list[float]:
    """Seconds of each of `steps` optimizer steps (device time on CUDA, wall time elsewhere)."""

    device = step.device
    if device.type == "cuda":
        # Events on the stream measure device time including any gap the host leaves between
        # kernels, without a host synchronisation per step that would itself slow the step.
        with torch.cuda.device(device):
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)
            ]
            for start, end in events:
                start.record()
                step.optimizer_step(batches, window)
                end.record()
            torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1000.0 for start, end in events]
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step.optimizer_step(batches, window)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return times


def interleaved_cpu_step_seconds(
    experiments: dict[str, tuple[ExperimentConfig, str]], rounds: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Seconds of each named (experiment, precision)'s training step on the CPU, on synthetic tokens.

    Each is warmed up for `warmup` steps, then they take turns step by step for `rounds` rounds, the
    order rotating every round, so all see the same load from other work at nearly the same moment:
    ratios of their medians hold on a shared machine where absolute times do not.
    """

    cpu = torch.device("cpu")
    keep_freed_memory(cpu)  # as training on the CPU does
    runs = {}
    for name, (experiment, precision) in experiments.items():
        step = TrainingStep(experiment, cpu, precision, DistributedContext())
        step.prepare()
        batches = synthetic_batches(experiment.model, experiment.training.batch_size, cpu, experiment.training.seed)
        window = LogWindow(cpu)
        for _ in range(warmup):
            step.optimizer_step(batches, window)
        runs[name] = (step, batches, window)
    steps = {
        name: functools.partial(step.optimizer_step, batches, window) for name, (step, batches, window) in runs.items()
    }
    timings = interleaved(
        steps,
        rounds,
        warmup=0,  # done above, per step
    )
    return {name: [timing.wall_s for timing in runs_timings] for name, runs_timings in timings.items()}


def _spread_pct(times: list[float], median: float) -> float:
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return 100.0 * (q3 - q1) / median


def _run_steps(
    experiment: ExperimentConfig,
    device: torch.device,
    precision: str,
    steps: int,
    warmup: int,
    step_type: type[TrainingStep] = TrainingStep,
) -> tuple[TrainingStep, list[float], float, float]:
    """Build the training step, run `warmup` then `steps` timed steps: (step, times, warmup s, mean loss)."""

    release_memory(device)
    reset_peak_rss()
    keep_freed_memory(device)  # as training does: the steps timed are the steps it will run
    # Build the weights directly on the device: a 1B model initialised on the CPU takes seconds.
    with device:
        step = step_type(experiment, device, precision, DistributedContext())
    step.prepare()
    batches = synthetic_batches(experiment.model, experiment.training.batch_size, device, experiment.training.seed)
    window = LogWindow(device)
    started = time.perf_counter()
    for _ in range(warmup):
        step.optimizer_step(batches, window)
    synchronize(device)
    warmup_seconds = time.perf_counter() - started
    window.reset()
    times = timed_steps(step, batches, window, steps)
    return step, times, warmup_seconds, float(window.loss) / window.steps


def _measure(
    experiment: ExperimentConfig,
    device: torch.device,
    precision: str,
    backend: str,
    steps: int,
    warmup: int,
    settings: dict[str, str],
    measured_peak: float | None,
    step_type: type[TrainingStep] = TrainingStep,
) -> BenchResult:
    config, model_config = experiment.training, experiment.model
    step, times, warmup_seconds, loss = _run_steps(experiment, device, precision, steps, warmup, step_type)
    median = statistics.median(times)
    tokens_per_second = config.batch_size * config.gradient_accumulation_steps * model_config.max_seq_len / median
    flops_per_token = step.model.flops_per_token(model_config.max_seq_len)
    model_flops = flops_per_token * tokens_per_second
    peak = peak_flops(device, precision)
    cuda = device.type == "cuda"
    return BenchResult(
        settings=settings,
        device=str(device),
        device_name=device_name(device),
        precision=precision,
        torch_version=torch.__version__,
        attention_backend=backend,
        compile=resolve_compile(config.compile, device),
        optimizer=config.optimizer,
        activation_checkpointing=model_config.activation_checkpointing,
        parameters=step.model.num_parameters,
        batch_size=config.batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        seq_len=model_config.max_seq_len,
        steps=steps,
        warmup=warmup,
        warmup_seconds=warmup_seconds,
        step_time_s=median,
        step_time_min_s=min(times),
        step_time_max_s=max(times),
        step_time_spread_pct=_spread_pct(times, median),
        tokens_per_second=tokens_per_second,
        flops_per_token=flops_per_token,
        model_flops_per_second=model_flops,
        peak_flops_per_second=peak,
        mfu=None if peak is None else model_flops / peak,
        measured_peak_flops_per_second=measured_peak,
        mfu_measured=None if measured_peak is None else model_flops / measured_peak,
        peak_allocated_gib=torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
        peak_reserved_gib=torch.cuda.max_memory_reserved(device) / GIB if cuda else None,
        peak_rss_gib=None if cuda else peak_rss_gib(),
        loss=loss,
        trainable_parameters=sum(p.numel() for p in step.model.parameters() if p.requires_grad),
        memory_estimate_gib=estimate_training_memory(experiment, precision).total / GIB,
    )


def run_benchmark(
    experiment: ExperimentConfig,
    *,
    steps: int,
    warmup: int,
    batch_size: int | None = None,
    fused_attention: bool = False,
    device: str | None = None,
    memory_limit_gib: float | None = None,
    settings: dict[str, str] | None = None,
    measured_peak: float | None = None,
    step_type: type[TrainingStep] = TrainingStep,
) -> BenchResult:
    """Time `steps` optimizer steps of `experiment` after `warmup` untimed ones.

    `measured_peak` (FLOP/s, from `measure_matmul_peak`) adds an MFU against that ceiling. `step_type`
    times another objective's step (`dlm.distill.step.DistillStep` for `dlm distill --minutes`).
    """

    if steps < 1 or warmup < 0:
        raise UserError(
            f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}",
            fix="for example --steps 20 --warmup 5",
        )
    experiment = bench_config(experiment, batch_size, device)
    config = experiment.training
    torch_device = resolve_device(config.device)
    precision = resolve_training_precision(config.precision, torch_device)
    require = fused_attention or config.require_fused_attention
    if require and torch_device.type != "cuda":
        require_fused_attention(experiment.model, torch_device, precision)  # raises the CPU / MPS message
    configure_cuda_backends(torch_device, require)
    with attention_kernel_context(torch_device, config.attention_kernel):  # as the step will run it
        if require:
            backend = require_fused_attention(experiment.model, torch_device, precision)
        else:
            backend = attention_backend(experiment.model, torch_device, precision)
    set_memory_limit(torch_device, memory_limit_gib)
    failure = None
    try:
        return _measure(
            experiment,
            torch_device,
            precision,
            backend,
            steps,
            warmup,
            dict(settings or {}),
            measured_peak,
            step_type,
        )
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        failure = str(exc).splitlines()[0][:200]
    finally:
        if memory_limit_gib is not None:
            set_memory_limit(torch_device, None)
    # Outside the except block: the exception's frames (and the tensors they hold) are gone now.
    release_memory(torch_device)
    limit = f"the {memory_limit_gib} GiB limit" if memory_limit_gib is not None else "device memory"
    raise BenchOutOfMemoryError(
        f"batch size {config.batch_size} does not fit in {limit} ({failure})",
        fix="lower --batch-size, enable model.activation_checkpointing or training.optimizer=adamw8bit, "
        "or use --find-max-batch",
    )


# ---- Largest batch, comparisons ----------------------------------------------------------------


def search_max_batch(fits: Callable[[int], bool], start: int = 1, limit: int = MAX_BATCH_LIMIT) -> BatchSearch:
    """Largest b in [1, limit] with fits(b), for a monotone `fits`: doubling from `start`, then bisection.

    Each probe is expensive (a model build and two steps), so the search asks about each size at most
    once and needs about 2 log2(answer / start) probes.
    """

    if not 1 <= start <= limit:
        raise ValueError(f"start {start} is not in [1, {limit}]")
    probes: list[tuple[int, bool]] = []

    def probe(size: int) -> bool:
        result = fits(size)
        probes.append((size, result))
        return result

    good, size = 0, start  # invariant: `good` fits (0 = nothing yet); below, `bad` does not
    while probe(size):
        good = size
        if size == limit:
            return BatchSearch(good, probes)
        size = min(2 * size, limit)
    bad = size
    while bad - good > 1:
        middle = (good + bad) // 2
        if probe(middle):
            good = middle
        else:
            bad = middle
    return BatchSearch(good, probes)


def find_max_batch(
    experiment: ExperimentConfig,
    *,
    fused_attention: bool = False,
    device: str | None = None,
    memory_limit_gib: float | None = None,
    limit: int = MAX_BATCH_LIMIT,
    progress: Progress | None = None,
) -> BatchSearch:
    """The largest micro-batch whose full training step fits (within `memory_limit_gib` if given)."""

    torch_device = resolve_device(bench_config(experiment, None, device).training.device)
    if torch_device.type != "cuda":
        raise UserError(
            f"--find-max-batch needs a CUDA device, the device is {torch_device}",
            fix="run on a GPU; on the CPU running out of memory ends the process instead of raising an error",
        )

    def fits(batch_size: int) -> bool:
        if progress is not None:
            progress(f"trying batch size {batch_size}")
        try:
            run_benchmark(
                experiment,
                steps=1,
                warmup=1,
                batch_size=batch_size,
                fused_attention=fused_attention,
                device=device,
                memory_limit_gib=memory_limit_gib,
            )
        except BenchOutOfMemoryError:
            return False
        return True

    start = min(experiment.training.batch_size, limit)
    search = search_max_batch(fits, start=start, limit=limit)
    return BatchSearch(search.batch_size, search.probes, memory_limit_gib)


def benchmark(
    experiment: ExperimentConfig,
    *,
    steps: int,
    warmup: int,
    batch_size: int | None = None,
    fused_attention: bool = False,
    device: str | None = None,
    find_batch: bool = False,
    memory_limit_gib: float | None = None,
    compare: list[str] | None = None,
    measure_peak: bool = False,
    progress: Progress | None = None,
) -> BenchReport:
    """Everything `dlm bench` does: optional batch search, then one row per --compare combination.

    A combination that runs out of memory becomes a failure entry; the others still run, so one
    table shows where the limit lies. With --find-max-batch the rows use the batch size found.
    With `measure_peak` a large matmul is timed first and every row also gets an MFU against it.
    """

    combinations = compare_settings(parse_compare(compare or []))
    report = BenchReport(checkpoints=[asdict(estimate) for estimate in estimate_checkpoints(experiment, 1)])
    measured_peak = None
    if measure_peak:
        if progress is not None:
            progress("timing a large matmul (the measured ceiling)")
        config = bench_config(experiment, batch_size, device).training
        torch_device = resolve_device(config.device)
        measured_peak = measure_matmul_peak(torch_device, resolve_training_precision(config.precision, torch_device))
    if find_batch:
        report.batch_search = find_max_batch(
            experiment,
            fused_attention=fused_attention,
            device=device,
            memory_limit_gib=memory_limit_gib,
            progress=progress,
        )
        if report.batch_search.batch_size == 0:
            raise BenchOutOfMemoryError(
                "not even a batch of one sequence fits",
                fix="enable activation checkpointing, use adamw8bit or a smaller model",
            )
        batch_size = report.batch_search.batch_size
    for settings in combinations:
        label = ", ".join(f"{key}={value}" for key, value in settings.items()) or "config"
        if progress is not None:
            progress(f"benchmarking {label}")
        row_experiment = with_overrides(experiment, [f"{k}={v}" for k, v in settings.items()], "--compare")
        # An explicit --compare batch_size wins over --batch-size / the batch finder.
        row_batch = None if "training.batch_size" in settings else batch_size
        try:
            report.rows.append(
                run_benchmark(
                    row_experiment,
                    steps=steps,
                    warmup=warmup,
                    batch_size=row_batch,
                    fused_attention=fused_attention,
                    device=device,
                    memory_limit_gib=memory_limit_gib,
                    settings=settings,
                    measured_peak=measured_peak,
                )
            )
        except BenchOutOfMemoryError as exc:
            if len(combinations) == 1:
                raise
            report.failures.append({**settings, "error": str(exc)})
    return report
