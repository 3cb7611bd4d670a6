"""One run's trainer on one process: its model, optimizer, data, counters and checkpoints.

`Trainer` is what `dlm.train.loop.train` builds once everything is checked: it loads a checkpoint
(or initial weights) exactly, runs optimizer steps (`dlm.train.step.TrainingStep`, or a workflow's
own step type), logs, validates with fixed noise, saves atomically with retention, and stops on a
signal, a budget or a non-finite loss. The loop module owns what comes before it (devices, locks,
checks, loggers) and the run's start and end events.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from dlm import __version__
from dlm.artifacts.checkpoint import (
    TRAINING_FORMAT,
    load_checkpoint,
    save_inference_checkpoint,
    save_training_checkpoint,
)
from dlm.artifacts.events import (
    CheckpointEvent,
    EndStatus,
    Sink,
    TrainEvent,
    ValidationEvent,
)
from dlm.artifacts.run_dir import (
    RunDir,
    check_resumable,
    check_same_data,
    metadata_sha256,
    write_config,
)
from dlm.artifacts.sharded_checkpoint import is_sharded_checkpoint
from dlm.config.optimizer_registry import optimizer_spec
from dlm.config.schema import ExperimentConfig, TrainingConfig
from dlm.data.dataset import DeterministicBatchSampler, load_packed_dataset
from dlm.data.tokenizer import tokenizer_sha256
from dlm.errors import UserError
from dlm.evaluation.evaluate import fixed_noise_validation
from dlm.model.lora import adapter_state, load_base_and_adapters
from dlm.runtime.flops import peak_flops
from dlm.runtime.memory import memory_stats
from dlm.runtime.rng import capture_rng_state, restore_rng_state
from dlm.train.checkpointing import inference_weights, load_trainer, report_saves, save_trainer, sharded_checkpointer
from dlm.train.distributed import (
    DistributedContext,
    check_world_size,
    full_model_state,
    full_optimizer_state,
    full_tensors,
    kept_accumulation,
    load_full_state,
    shard_like,
)
from dlm.train.init_from import checked_lora_base, load_initial_weights, lora_base_record
from dlm.train.optimizer import ModelEMA, check_state_layout, configured_hyperparameters_kept, learning_rate
from dlm.train.step import LogWindow, OwnData, RunCounters, TrainingStep
from dlm.train.stop import StopSignals


@dataclass
class TrainResult:
    """How a call to `train` ended."""

    status: EndStatus
    step: int
    checkpoint: Path
    run_dir: Path
    exit_code: int = 0


# Re-fits the schedule while the run trains (`dlm.train.budget`'s time budget): called after each
# step with the steps done; returns the training fields to change (max_steps, warmup_steps and the
# decay anchor), or None to go on as planned.
Pacer = Callable[[int], Mapping[str, Any] | None]


class NonFiniteLossError(UserError):
    """The loss or gradient norm became NaN / inf; the last good checkpoint is kept."""


class Trainer:
    """Owns the model, optimizer, data and counters of one run on one process."""

    def __init__(
        self,
        experiment: ExperimentConfig,
        device: torch.device,
        precision: str,
        world: DistributedContext,
        sink: Sink,
        step_type: type[TrainingStep] = TrainingStep,
        initial: dict[str, Tensor] | None = None,
    ):
        self.experiment, self.config = experiment, experiment.training
        self.device, self.precision, self.world, self.sink = device, precision, world, sink
        self.stop = StopSignals()  # replaced by the run's own, whose handlers are installed
        self.step = step_type(experiment, device, precision, world, initial)
        self.model, self.optimizer = self.step.model, self.step.optimizer
        own = self.step.own_data()
        self.train_dataset, self.val_dataset = None, None
        if own is None:
            train = load_packed_dataset(self.config.train_data, experiment.model.max_seq_len)
            if self.config.val_data is not None:
                self.val_dataset = load_packed_dataset(self.config.val_data, experiment.model.max_seq_len)
            self.train_dataset = train
            # What identifies the data; a resume onto other data is refused unless asked for.
            own = OwnData(
                {
                    "train": metadata_sha256(train.metadata),
                    "val": None if self.val_dataset is None else metadata_sha256(self.val_dataset.metadata),
                },
                len(train),
            )
        self.data_sha256, self.data_size = own.sha256, own.size
        self.data_generator = torch.Generator().manual_seed(self.config.seed)
        self.tokenizer_sha256 = tokenizer_sha256(self.config.tokenizer)
        self.data_changed = False
        self.flops_per_token = self.model.flops_per_token(experiment.model.max_seq_len)
        self.peak_flops = peak_flops(device, precision)
        self.checkpoint_path: Path | None = None
        # None for single-file checkpoints. Built on every rank at this point: it may create a group.
        self.checkpointer = sharded_checkpointer(self.config, world)
        self.lora_base: dict[str, str] | None = None  # a LoRA run's frozen base: its path and weights' sha256
        self.recorded_threads: int | None = None  # the CPU threads of the checkpoint resumed from
        self.batch_note: str | None = None  # how a resume on another world size kept (or changed) the batch
        self._config_on_disk: ExperimentConfig | None = None  # what config.json holds (`write_run_config`)
        self._saved_configs: dict[int, ExperimentConfig] = {}  # the config of each save not yet announced

    @property
    def counters(self) -> RunCounters:
        return self.step.counters

    # ----------------------------------------------------------------------------- state
    def load(
        self,
        path: Path,
        allow_data_change: bool = False,
        base: dict[str, Tensor] | None = None,
        allow_batch_change: bool = False,
    ) -> None:
        """Restore everything a checkpoint holds; refuse one that does not belong to this config.
        A LoRA run's checkpoint holds the adapters alone: `base` is its base model's weights, read again.
        On another number of processes the run keeps its global batch (`keep_global_batch`)."""

        if path.is_dir() and not is_sharded_checkpoint(path):
            path = RunDir(path).latest_checkpoint()
        if is_sharded_checkpoint(path):
            load_trainer(self, path, allow_data_change, allow_batch_change)
            self.checkpoint_path = path.resolve()
            return
        checkpoint = load_checkpoint(path, expected_format=TRAINING_FORMAT)
        check_resumable(checkpoint, self.experiment, self.tokenizer_sha256, path, warn=self.world.is_main)
        self.data_changed = check_same_data(checkpoint, self.data_sha256, path, allow_data_change)
        check_world_size(checkpoint, self.world.world_size, path)
        self.keep_global_batch(checkpoint, path, allow_batch_change)
        # Every rank reads the file; under FSDP each keeps only its shard of the full state.
        check_state_layout(self.optimizer, checkpoint["optimizer"], path)
        # Whatever the optimizer, the config's hyperparameters win over the checkpoint's (a changed
        # beta or decay takes effect); the schedule sets the learning rate before every step.
        resumable = optimizer_spec(self.config.optimizer).resumable_hyperparameters
        with configured_hyperparameters_kept(self.optimizer, resumable):
            if self.config.lora.enabled:
                self._load_adapters(checkpoint, base, path)
            else:
                load_full_state(self.model, self.optimizer, checkpoint["model"], checkpoint["optimizer"])
        self.step.scaler.load_state_dict(checkpoint.get("scaler") or {})
        ema = self.step.ema
        if ema is not None and checkpoint.get("ema") is not None:
            shadow = shard_like(checkpoint["ema"]["shadow"], dict(zip(ema.names, ema.shadow, strict=True)))
            ema.load_state_dict({**checkpoint["ema"], "shadow": shadow})
        self.data_generator.set_state(checkpoint["data_generator_state"])
        restore_rng_state(checkpoint["rng_state"])
        self.step.counters = RunCounters(
            step=int(checkpoint["step"]),
            tokens_seen=int(checkpoint["tokens_seen"]),
            micro_batches_seen=int(checkpoint["micro_batches_seen"]),
        )
        self.recorded_threads = checkpoint.get("cpu_threads")
        self.checkpoint_path = Path(path)

    def keep_global_batch(self, record: dict[str, Any], path: Path, allow_change: bool) -> None:
        """Take the gradient accumulation that keeps the checkpoint's global batch on this world size
        (`kept_accumulation`); the checkpoints and config.json written from here on record it."""

        accumulation, self.batch_note = kept_accumulation(
            record,
            self.config.batch_size,
            self.config.gradient_accumulation_steps,
            self.world.world_size,
            path,
            allow_change,
        )
        if accumulation != self.config.gradient_accumulation_steps:
            self.adopt(self.config.model_copy(update={"gradient_accumulation_steps": accumulation}))

    def adopt(self, training: TrainingConfig) -> None:
        """Train on with `training` (a kept batch, a re-fitted schedule): the step reads it, and the
        checkpoints and config.json written from here on record it."""

        self.experiment = self.experiment.model_copy(update={"training": training})
        self.config = self.step.config = training
        self.step.experiment = self.experiment

    def reschedule(self, fields: Mapping[str, Any]) -> None:
        """A pacer's new schedule; config.json follows when the next checkpoint is complete, so that it
        always describes a checkpoint on disk (`announce_checkpoint`)."""

        self.adopt(self.config.model_copy(update=dict(fields)))

    def write_run_config(self, experiment: ExperimentConfig | None = None) -> None:
        """Rank 0: config.json, the settings a `dlm resume` continues with (by default the current ones)."""

        experiment = self.experiment if experiment is None else experiment
        if self.world.is_main and experiment is not self._config_on_disk:
            write_config(self.config.output_dir, experiment)
            self._config_on_disk = experiment

    def announce_checkpoint(self, step: int, path: Path) -> None:
        """Rank 0, once the checkpoint of `step` is complete: config.json as that checkpoint trained,
        then its event (a time budget's plan follows it)."""

        self.write_run_config(self._saved_configs.pop(step, self.experiment))
        self.sink(CheckpointEvent(step=step, path=str(path)))

    def _load_adapters(self, checkpoint: dict[str, Any], base: dict[str, Tensor] | None, path: Path) -> None:
        """The base weights, refused unless they are the ones the run began with; then the checkpoint's
        adapters and optimizer state (a LoRA run: one process or DDP, never sharded)."""

        self.lora_base = checked_lora_base(checkpoint.get("lora_base"), base, path)
        assert base is not None
        load_base_and_adapters(self.model, base, checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])

    def start_from(self, weights: dict[str, Tensor]) -> None:
        """Take a trained model's weights (`training.init_from`, read and checked by
        `dlm.train.init_from.initial_weights`); everything else starts afresh. A LoRA run freezes
        them under its adapters and records their sha256, which a resume checks."""

        if self.config.lora.enabled:
            load_base_and_adapters(self.model, weights)
            assert self.config.init_from is not None  # a config rule of [training.lora]
            self.lora_base = lora_base_record(self.config.init_from, weights)
        else:
            load_initial_weights(self.model, weights)
        if self.step.ema is not None:  # the average starts from the loaded weights, not the random ones
            self.step.ema = ModelEMA(self.model, self.step.ema.decay)

    def record(self) -> dict[str, Any]:
        """The plain values of a checkpoint, whatever its format."""

        return {
            "dlm_version": __version__,
            "step": self.counters.step,
            "tokens_seen": self.counters.tokens_seen,
            "micro_batches_seen": self.counters.micro_batches_seen,
            "world_size": self.world.world_size,
            # A CPU run's intra-op threads: a resume reuses them (`resume_cpu_threads`), since they shape the sums.
            "cpu_threads": torch.get_num_threads() if self.device.type == "cpu" else None,
            "config": self.experiment.to_dict(),
            "tokenizer_sha256": self.tokenizer_sha256,
            "data_sha256": self.data_sha256,
        }

    def state(self) -> dict[str, Any]:
        """The checkpoint payload, in single-process layout whatever the parallelism. Under FSDP
        a collective: every rank gathers, only rank 0 gets the tensors (the others, empty dicts)."""

        ema = self.step.ema
        ema_state = None
        if ema is not None:
            ema_state = ema.state_dict()
            ema_state["shadow"] = full_tensors(ema_state["shadow"])
        return {
            "format": TRAINING_FORMAT,
            **self.record(),
            "rng_state": capture_rng_state(self.device),
            "data_generator_state": self.data_generator.get_state(),
            "model": adapter_state(self.model) if self.config.lora.enabled else full_model_state(self.model),
            "lora_base": self.lora_base,
            "optimizer": full_optimizer_state(self.model, self.optimizer),
            "scaler": self.step.scaler.state_dict(),
            "ema": ema_state,
        }

    def save(self) -> Path:
        """Every rank calls this (gathering sharded state is a collective); only rank 0 writes."""

        with self.stop.writing():  # a second Ctrl-C waits until the files are complete (or staged)
            if self.world.is_main:
                self._saved_configs[self.counters.step] = self.experiment
            return self._save() if self.checkpointer is None else save_trainer(self, self.checkpointer)

    def _save(self) -> Path:
        config, step = self.config, self.counters.step
        state = self.state()
        path = RunDir(config.output_dir).step_checkpoint(step)  # what every rank reports; rank 0 writes it
        if self.world.is_main:
            path = save_training_checkpoint(config.output_dir, state, step, config.keep_last_checkpoints)
            if config.save_inference_checkpoint:
                metadata = {
                    "step": step,
                    "tokens_seen": self.counters.tokens_seen,
                    "config": self.experiment.to_dict(),
                    "tokenizer_sha256": self.tokenizer_sha256,
                    "weights": "live" if state["ema"] is None else "ema",
                    "lora_base": state["lora_base"],
                }
                save_inference_checkpoint(config.output_dir, inference_weights(state), metadata)
            self.announce_checkpoint(step, path)
        # No rank returns before the files exist: a result must never name a missing checkpoint.
        self.world.barrier()
        self.checkpoint_path = path
        return path

    # ----------------------------------------------------------------------------- data
    def train_batches(self) -> Iterator[Tensor]:
        world = self.world
        if self.train_dataset is None:  # the step makes its own batches
            return iter(())
        # check_world_size made sure the consumed micro-batches split evenly over the ranks.
        sampler = DeterministicBatchSampler(
            len(self.train_dataset),
            self.config.batch_size,
            seed=self.config.seed,
            start_batch=self.counters.micro_batches_seen // world.world_size,
            rank=world.rank,
            world_size=world.world_size,
        )
        loader = DataLoader(
            cast(Dataset[Tensor], self.train_dataset),  # a map-style dataset by its methods
            batch_sampler=sampler,
            num_workers=self.config.num_workers,
            pin_memory=self.device.type == "cuda",
            generator=self.data_generator,
        )
        return iter(loader)

    @property
    def validates(self) -> bool:
        return self.val_dataset is not None or self.step.validates_itself()

    def validate(self) -> dict[str, float]:
        if self.val_dataset is None:  # the step's own check (an RL run's held-out prompts)
            event = self.step.validation_event()
            self.sink(event)
            return {}
        # Its own generator: a DataLoader otherwise draws a seed from the global RNG.
        loader = DataLoader(
            cast(Dataset[Tensor], self.val_dataset),
            batch_size=self.config.batch_size,
            shuffle=False,
            generator=torch.Generator().manual_seed(0),
        )
        eps, batches = self.experiment.diffusion.mask_eps, self.config.eval_batches
        metrics = fixed_noise_validation(
            self.model, loader, self.device, self.precision, eps, batches, schedule=self.step.schedule
        )
        self.sink(ValidationEvent(step=self.counters.step, **metrics))
        return metrics

    def raise_if_diverged(self, window: LogWindow) -> None:
        # Agreed over ranks (a collective), so that every rank stops, or none does.
        bad_step = self.world.first_flag(window.first_bad_step)
        if bad_step >= 0:
            kept = self.checkpoint_path or "none was written yet"
            raise NonFiniteLossError(
                f"the loss or gradient norm became non-finite at step {bad_step}; training stopped and "
                f"the last good checkpoint is kept: {kept}",
                fix="lower training.learning_rate, raise warmup_steps or use bfloat16 instead of float16",
            )

    def log(self, window: LogWindow) -> None:
        self.raise_if_diverged(window)
        elapsed = max(time.perf_counter() - window.started, 1e-9)
        tokens_per_second = window.tokens / elapsed
        steps_left = self.config.max_steps - self.counters.step
        # Loss, accuracy and buckets of all ranks, as one process running every micro-batch would
        # report them; the gradient norm is already global (computed after the reduction).
        loss, accuracy, bucket_loss, bucket_count = self.world.sum_over_ranks(
            [window.loss, window.accuracy, window.bucket_loss, window.bucket_count]
        )
        counts = bucket_count.tolist()
        sums = bucket_loss.tolist()
        buckets = [total / count if count else None for total, count in zip(sums, counts, strict=True)]
        event = TrainEvent(
            step=self.counters.step,
            max_steps=self.config.max_steps,
            loss=float(loss) / (window.steps * self.world.world_size),
            masked_accuracy=float(accuracy) / (window.steps * self.world.world_size),
            learning_rate=learning_rate(self.counters.step - 1, self.config),
            grad_norm=float(window.grad_norm) / window.steps,
            tokens_seen=self.counters.tokens_seen,
            tokens_per_second=tokens_per_second,
            mfu=(
                self.flops_per_token * tokens_per_second / (self.peak_flops * self.world.world_size)
                if self.peak_flops
                else None
            ),
            eta_seconds=steps_left * elapsed / window.steps,
            loss_by_t=buckets,
            **memory_stats(self.device),
            phase=self.step.phase(),
        )
        self.sink(event)
        for extra in self.step.log_events():
            self.sink(extra)
        window.reset()

    # ----------------------------------------------------------------------------- run
    def check_can_continue(self, end_step: int) -> None:
        if self.counters.step < end_step:
            return
        fix = "raise training.max_steps to continue training"
        if self.experiment.distill is not None:  # its steps are its rounds': a further round is a new run
            output = self.config.output_dir
            fix = (
                f"export the student (dlm export {output} --output DIR), or distil it further in a new run, from "
                f"the {self.experiment.distill.steps_after(self.counters.step)} steps it samples in: "
                f"dlm distill {output} --data DATA --output NEW"
            )
        raise UserError(
            f"the checkpoint is already at step {self.counters.step} of max_steps {self.config.max_steps}", fix=fix
        )

    def run(self, end_step: int, deadline: float | None, stop: StopSignals, pacer: Pacer | None = None) -> TrainResult:
        """Train to `end_step` (max_steps, or fewer for a run limited to some steps), stopping early on
        a signal or at `deadline`. A `pacer` may move max_steps while the run trains."""

        limited = end_step < self.config.max_steps  # a limit that outlasts a re-fitted schedule
        self.check_can_continue(end_step)
        self.stop = stop
        self.step.prepare()
        batches = self.train_batches()
        window = LogWindow(self.device)
        status: EndStatus = "complete"
        while self.counters.step < end_step:
            self.step.optimizer_step(batches, window)
            step, config = self.counters.step, self.config
            if step % config.log_interval == 0 or step == end_step:
                self.log(window)
            if self.validates and step % config.eval_interval == 0:
                self.validate()
            if step % config.save_interval == 0:
                self.raise_if_diverged(window)
                self.save()
            # Decided together: a rank that stopped alone would leave the others in a collective.
            signalled, out_of_time, save_failed = self.world.any_rank(
                [
                    stop.signal_number is not None,
                    deadline is not None and time.monotonic() >= deadline,
                    self.checkpointer is not None and self.checkpointer.failed_here(),
                ]
            )
            if save_failed:
                assert self.checkpointer is not None
                self.checkpointer.stop_after_failure()
            report_saves(self, block=False)
            if signalled:
                status = "interrupted"
                break
            if out_of_time and step < end_step:
                status = "paused"
                break
            fields = None if pacer is None or step >= end_step else pacer(step)
            if fields:
                self.reschedule(fields)
                end_step = min(end_step, self.config.max_steps) if limited else self.config.max_steps
        if status == "complete" and self.counters.step < self.config.max_steps:
            status = "paused"
        self.raise_if_diverged(window)
        if window.steps:
            self.log(window)
        if self.checkpoint_path is None or self.counters.step % self.config.save_interval:
            self.save()
        report_saves(self, block=True)  # the result names a complete checkpoint
        assert self.checkpoint_path is not None
        return TrainResult(
            status=status,
            step=self.counters.step,
            checkpoint=self.checkpoint_path,
            run_dir=self.config.output_dir,
            exit_code=stop.exit_code if status == "interrupted" else 0,
        )
