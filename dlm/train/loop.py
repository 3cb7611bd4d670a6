"""The training loop. It emits the typed events of `dlm.artifacts.events` to a sink and never prints.

The usual parts of a training loop: seeding, device and precision resolution, CUDA backend setup
with optional fused-attention enforcement, AdamW decay groups or bitsandbytes AdamW8bit, stratified
diffusion times across gradient accumulation, warmup + cosine LR, gradient clipping, a GradScaler for
float16, fixed-noise validation, atomic checkpoints with retention, a hard-linked `latest.pt` and a
compact bf16 inference checkpoint; or sharded, optionally asynchronous checkpoints
(`dlm.train.checkpointing`), from which `dlm export` / `eval` / `sample` read the model directly.

Beyond them: every micro-batch's noise comes from a generator seeded by (seed, global micro-batch
index) and the data order is a pure function of (seed, batch index), so a resumed run is
bit-identical to an uninterrupted one and independent of world size; metrics stay on the device
between log steps (no host sync per step); Ctrl-C / SIGTERM finish the step and save; a non-finite
loss stops the run before a bad model can become `latest.pt`; one run per directory (lock file), never
started on top of another run, and every check of a resume (`dlm.artifacts.run_dir`) done before any write.

This module is the entry (`train`: the checks, the run directory's lock, the loggers, the start and
end events); the run itself, step by step, is `dlm.train.trainer.Trainer`'s.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path

from dlm import __version__
from dlm.artifacts.checkpoint import (
    RunLock,
    check_output_dir,
)
from dlm.artifacts.events import (
    EndEvent,
    Sink,
    StartEvent,
    fan_out,
)
from dlm.artifacts.run_dir import (
    MetricsFile,
    check_run_file_kinds,
    check_run_target,
    check_source_kept,
    remove_run_files,
)
from dlm.artifacts.sharded_checkpoint import remove_incomplete_checkpoints
from dlm.config.schema import ExperimentConfig
from dlm.config.shapes import format_parameter_count
from dlm.data.tokenizer import tokenizer_sha256
from dlm.errors import UserError, UserNote
from dlm.runtime.allocator import keep_freed_memory
from dlm.runtime.device import cpu_precision_note, resolve_compile, resolve_device, resolve_training_precision
from dlm.runtime.kernels import configure_cuda_backends, process_settings_restored
from dlm.runtime.threads import configure_cpu_threads, resume_cpu_threads
from dlm.train.distributed import (
    check_parallelism,
    current_context,
)
from dlm.train.init_from import initial_weights
from dlm.train.loggers import check_loggers, open_loggers
from dlm.train.memory import trainable_parameter_count
from dlm.train.preflight import ensure_valid, memory_warning
from dlm.train.step import TrainingStep
from dlm.train.stop import StopSignals
from dlm.train.trainer import Pacer, Trainer, TrainResult


def _checkpoint_bytes(parameters: int) -> int:
    """Bytes one checkpoint needs at worst: fp32 weights + two fp32 Adam moments, written twice (a LoRA
    run's checkpoints hold the adapters alone)."""

    return parameters * 4 * 3 * 2


def train(
    experiment: ExperimentConfig,
    *,
    resume: str | Path | None = None,
    max_run_steps: int | None = None,
    max_run_seconds: float | None = None,
    sink: Sink | None = None,
    overwrite: bool = False,
    allow_data_change: bool = False,
    stop: StopSignals | None = None,
    step_type: type[TrainingStep] = TrainingStep,
    allow_batch_change: bool = False,
    pacer: Pacer | None = None,
) -> TrainResult:
    """Train (or continue) a run and return how it ended. Events go to `sink` and metrics.jsonl.

    A directory that already holds a run is refused unless `resume` is one of its checkpoints or
    `overwrite` asks to delete it; `allow_data_change` accepts a resume onto other packed data, and
    `allow_batch_change` one on a world size that cannot keep the run's global batch.
    Everything is checked before the first write, so a refused call changes nothing. `stop`: signal
    handlers the caller installed for longer than the run (else the run installs its own).
    `step_type`: the objective of each optimizer step (`dlm.distill` trains its students with its own).
    `pacer`: re-fits the schedule as the run goes (`dlm.train.trainer.Pacer`; one process only).
    The process-wide settings a run changes (TF32, the CUDA attention kernels, the CPU's threads) are
    given back when it returns.
    """

    with process_settings_restored():
        return _train(
            experiment,
            resume,
            max_run_steps,
            max_run_seconds,
            sink,
            overwrite,
            allow_data_change,
            stop,
            step_type,
            allow_batch_change,
            pacer,
        )


def _train(
    experiment: ExperimentConfig,
    resume: str | Path | None,
    max_run_steps: int | None,
    max_run_seconds: float | None,
    sink: Sink | None,
    overwrite: bool,
    allow_data_change: bool,
    stop: StopSignals | None,
    step_type: type[TrainingStep],
    allow_batch_change: bool,
    pacer: Pacer | None,
) -> TrainResult:
    if max_run_steps is not None and max_run_steps <= 0:
        raise UserError("--max-run-steps must be positive", fix="pass a number of steps >= 1")
    if experiment.distill is not None and step_type is TrainingStep:
        raise UserError(
            "this config distils a teacher ([distill]), which dlm.train.loop.train does not do",
            fix="run it with `dlm distill --config ...` (or dlm.distill.distill), resume it with `dlm resume`",
        )
    if experiment.rl is not None and step_type is TrainingStep:
        raise UserError(
            "this config trains with rewards ([rl]), which dlm.train.loop.train does not do",
            fix="run it with `dlm rl --config ...` (or dlm.rl.run.rl), resume it with `dlm resume`",
        )
    experiment = experiment.with_absolute_paths()
    config = experiment.training
    world = current_context(experiment)
    if pacer is not None and world.world_size > 1:  # each process would re-fit to its own clock
        raise UserError("a schedule paced by the clock trains in one process", fix="start it without torchrun")
    device = resolve_device(config.device if world.world_size == 1 else world.device_name(config.device))
    precision = resolve_training_precision(config.precision, device)
    configure_cuda_backends(device, config.require_fused_attention)
    threads = configure_cpu_threads(device, world.world_size)  # threads for the free cores, not all of them
    keep_freed_memory(device)  # on the CPU each step reuses the last one's memory: no page faults
    ensure_valid(experiment, device, world.world_size)  # memory included: before any allocation or write
    # A run on a time budget heard this before its calibration (`dlm.train.budget`), which trains steps too.
    if world.is_main and pacer is None and (note := memory_warning(experiment, device)) is not None:
        warnings.warn(note, UserNote, stacklevel=2)
    check_parallelism(config)
    run_dir = config.output_dir
    resume = None if resume is None else Path(resume)
    initial = None  # a resumed run never re-applies init_from; a LoRA run's resume reads its frozen base again
    if config.init_from is not None and (resume is None or config.lora.enabled):
        # Read and checked before the run directory exists: a refused source leaves nothing behind.
        initial = initial_weights(config.init_from, experiment.model, tokenizer_sha256(config.tokenizer))
    if world.is_main:  # only rank 0 logs, so only it needs the loggers' packages
        check_loggers(experiment.logging)
        if resume is None:  # before the directory is touched (its lock)
            check_source_kept(config.init_from, run_dir)
        check_output_dir(run_dir, _checkpoint_bytes(trainable_parameter_count(experiment.model, config)))
    world.barrier()
    lock = RunLock(run_dir) if world.is_main else contextlib.nullcontext()
    signals = StopSignals() if stop is None else contextlib.nullcontext(stop)
    with lock, signals as stop, contextlib.ExitStack() as cleanup:
        if world.is_main:  # under the lock: no other run can start or finish in between
            check_run_file_kinds(run_dir)
            check_run_target(run_dir, resume, overwrite)
        trainer = Trainer(experiment, device, precision, world, fan_out([]), step_type, initial)
        if trainer.checkpointer is not None:  # a save in flight completes before the process ends
            cleanup.callback(trainer.checkpointer.close)
        if resume is not None:
            trainer.load(resume, allow_data_change, initial, allow_batch_change)
            threads = resume_cpu_threads(threads, trainer.recorded_threads)
        elif initial is not None:
            trainer.start_from(initial)
            del initial  # the model holds them now
        end_step = config.max_steps
        if max_run_steps is not None:
            end_step = min(end_step, trainer.counters.step + max_run_steps)
        trainer.check_can_continue(end_step)
        # Every check passed: from here on the run writes.
        if world.is_main:
            if overwrite:
                remove_run_files(run_dir)
            remove_incomplete_checkpoints(run_dir)
            metrics = MetricsFile(run_dir)
            cleanup.callback(metrics.close)
            loggers = open_loggers(run_dir, trainer.experiment, trainer.counters.step)
            for logger in loggers:
                cleanup.callback(logger.close)
            sinks: list[Sink] = [metrics, *loggers]
            trainer.sink = fan_out(sinks + ([sink] if sink is not None else []))
            trainer.write_run_config()  # with the accumulation a resume kept
        trainer.sink(start_event(trainer, resume, None if threads is None else threads.describe()))
        deadline = None if max_run_seconds is None else time.monotonic() + max_run_seconds
        result = trainer.run(end_step, deadline, stop, pacer)
        stop.settle()  # the files are complete: a late signal must not cut the report short
        trainer.sink(
            EndEvent(
                status=result.status,
                step=result.step,
                checkpoint=str(result.checkpoint),
                resume_command=f"dlm resume {run_dir}" if result.status != "complete" else None,
            )
        )
        return result


def start_event(trainer: Trainer, resumed_from: Path | None, cpu_threads: str | None = None) -> StartEvent:
    """The run's first event: what trains, on what, from where, and how much a step takes in."""

    config, world = trainer.config, trainer.world
    tokens_per_step = config.batch_size * config.gradient_accumulation_steps * world.world_size
    tokens_per_step *= trainer.experiment.model.max_seq_len
    return StartEvent(
        run_dir=str(config.output_dir),
        device=str(trainer.device),
        precision=trainer.precision,
        parameters=trainer.model.num_parameters,
        parameters_human=format_parameter_count(trainer.model.num_parameters),
        trainable_parameters=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        optimizer=config.optimizer,
        compile=resolve_compile(config.compile, trainer.device),
        activation_checkpointing=trainer.experiment.model.activation_checkpointing,
        fused_attention_required=config.require_fused_attention,
        world_size=world.world_size,
        parallelism=config.parallelism if world.active else None,
        global_batch=config.batch_size * config.gradient_accumulation_steps * world.world_size,
        tokens_per_step=tokens_per_step,
        training_blocks=trainer.data_size,
        start_step=trainer.counters.step,
        max_steps=config.max_steps,
        resumed_from=None if resumed_from is None else str(resumed_from),
        data_changed=trainer.data_changed,
        dlm_version=__version__,
        cpu_threads=cpu_threads,
        batch_note=trainer.batch_note,
        precision_note=cpu_precision_note(trainer.device, trainer.precision),
        init_from=None if config.init_from is None else str(config.init_from),
    )
