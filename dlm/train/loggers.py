"""Experiment trackers: TensorBoard and Weights & Biases as sinks of the training events.

`dlm.train` hands every event to `metrics.jsonl`, to the caller's sink (the dashboard) and, on rank 0,
to each logger that `[logging]` switches on. A logger sees the same typed events as the other sinks
and turns them into scalars with `event_scalars`, so every tracker names a figure the same way
(`train/loss`, `val/loss`, `train/loss_by_t/0.0-0.1` ...). Nothing here imports a tracker's package
until its logger is switched on: a run without `[logging]` imports neither.

To add a logger: subclass `Logger`, give it a `name` (also the folder it writes in the run directory)
and the `Requirement` naming its package and dlm extra, decorate it with `@register_logger`, and add a
boolean field of the same name to `dlm.config.schema.LoggingConfig`.
"""

from __future__ import annotations

import itertools
import json
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from dlm.artifacts.events import CheckpointEvent, EndEvent, Event, TrainEvent, ValidationEvent
from dlm.config.schema import ExperimentConfig, LoggingConfig
from dlm.extras import Requirement, require
from dlm.registry import Registry

_L = TypeVar("_L", bound="type[Logger]")


def bucket_names(count: int) -> list[str]:
    """`0.0-0.1`, `0.1-0.2` ... for `count` equal noise-time buckets (the `loss_by_t` of a train event)."""

    digits = max(1, math.ceil(math.log10(count))) if count > 1 else 1
    edges = [f"{index / count:.{digits}f}" for index in range(count + 1)]
    return [f"{low}-{high}" for low, high in itertools.pairwise(edges)]


def event_scalars(event: Event) -> dict[str, float]:
    """The scalars an event contributes, by tag; every logger uses these names.

    Figures an event does not have (None: a non-finite loss, an empty bucket, an unknown MFU) are left
    out rather than logged as a number a chart would draw."""

    values: dict[str, float | int | None]
    if isinstance(event, TrainEvent):
        values = {
            "train/loss": event.loss,
            "train/masked_accuracy": event.masked_accuracy,
            "train/learning_rate": event.learning_rate,
            "train/grad_norm": event.grad_norm,
            "train/tokens_per_second": event.tokens_per_second,
            "train/tokens_seen": event.tokens_seen,
            "train/mfu": event.mfu,
        }
        names = bucket_names(len(event.loss_by_t))
        values.update({f"train/loss_by_t/{name}": loss for name, loss in zip(names, event.loss_by_t, strict=True)})
        if event.reserved_gib:  # zeros off CUDA say nothing about memory
            values.update(
                {
                    "memory/allocated_gib": event.allocated_gib,
                    "memory/reserved_gib": event.reserved_gib,
                    "memory/peak_allocated_gib": event.peak_allocated_gib,
                }
            )
    elif isinstance(event, ValidationEvent):
        values = {"val/loss": event.loss, "val/masked_accuracy": event.masked_accuracy}
    else:
        return {}
    return {tag: float(value) for tag, value in values.items() if value is not None and math.isfinite(value)}


def run_name(run_dir: Path, settings: LoggingConfig) -> str:
    return settings.run_name or run_dir.name


class Logger(ABC):
    """A sink that records the events' scalars in a tracker; opened on rank 0 only, once per `train` call."""

    name: ClassVar[str]  # its [logging] switch, and the folder it writes in the run directory
    requirement: ClassVar[Requirement]

    def __init__(self, run_dir: Path, experiment: ExperimentConfig, start_step: int) -> None:
        self.directory = run_dir / self.name

    def __call__(self, event: Event) -> None:
        scalars = event_scalars(event)
        if scalars and isinstance(event, TrainEvent | ValidationEvent):  # the events that have scalars
            self.log(event.step, scalars)
        if isinstance(event, CheckpointEvent | EndEvent):  # what is on disk matches the checkpoint
            self.flush()

    @abstractmethod
    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record `scalars` at optimizer step `step`."""

    @abstractmethod
    def flush(self) -> None:
        """Write what is buffered to disk."""

    @abstractmethod
    def close(self) -> None:
        """Finish the tracker's run; called once, also when training fails."""


_LOGGERS: Registry[type[Logger]] = Registry("logger")


def register_logger(cls: _L, replace: bool = False) -> _L:
    """Make `[logging] NAME = true` open this logger (NAME must be a field of `LoggingConfig`)."""

    if cls.name not in LoggingConfig.model_fields:
        raise ValueError(
            f"logger {cls.name!r} has no switch: add `{cls.name}: bool` to dlm.config.schema.LoggingConfig"
        )
    _LOGGERS.add(cls.name, cls, replace=replace)
    return cls


def unregister_logger(name: str) -> None:
    _LOGGERS.remove(name)


def logger_names() -> tuple[str, ...]:
    return _LOGGERS.names()


def enabled_loggers(settings: LoggingConfig) -> list[type[Logger]]:
    return [cls for name, cls in _LOGGERS.items() if getattr(settings, name) is True]


def check_loggers(settings: LoggingConfig) -> None:
    """Before the run writes anything: one `UserError` naming the extra of a missing package."""

    for cls in enabled_loggers(settings):
        require(cls.requirement)


def open_loggers(run_dir: Path, experiment: ExperimentConfig, start_step: int) -> list[Logger]:
    """The loggers `[logging]` switches on, writing under `run_dir` from `start_step` on."""

    return [cls(run_dir, experiment, start_step) for cls in enabled_loggers(experiment.logging)]


def _config_markdown(experiment: ExperimentConfig) -> str:
    # TensorBoard renders text summaries as Markdown: indented lines keep the JSON a code block.
    text = json.dumps(experiment.to_dict(), indent=2)
    return "\n".join("    " + line for line in text.splitlines())


@register_logger
class TensorBoardLogger(Logger):
    """Event files in RUN/tensorboard: the scalars, and the config as a text summary."""

    name = "tensorboard"
    requirement = Requirement("tensorboard", "tensorboard", "[logging] tensorboard = true")

    def __init__(self, run_dir: Path, experiment: ExperimentConfig, start_step: int) -> None:
        super().__init__(run_dir, experiment, start_step)
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides what earlier files logged after the checkpoint this run starts from: a
        # resume from an older checkpoint, or an overwritten run, does not leave two curves on one chart.
        self.writer = SummaryWriter(log_dir=str(self.directory), purge_step=start_step + 1)
        self.writer.add_text("config", _config_markdown(experiment), global_step=start_step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@register_logger
class WandbLogger(Logger):
    """A Weights & Biases run with its files in RUN/wandb, offline unless `wandb_mode = "online"`.

    Each `train` call (a resume included) is one W&B run, grouped under the run's name."""

    name = "wandb"
    requirement = Requirement("wandb", "wandb", "[logging] wandb = true")

    def __init__(self, run_dir: Path, experiment: ExperimentConfig, start_step: int) -> None:
        super().__init__(run_dir, experiment, start_step)
        import wandb

        settings = experiment.logging
        name = run_name(run_dir, settings)
        # console="off": W&B would otherwise wrap stdout and stderr, which the dashboard draws on.
        options: dict[str, Any] = {"console": "off", "silent": True}
        self.run = wandb.init(
            project=settings.wandb_project,
            name=name,
            group=name,
            dir=str(run_dir),
            mode=settings.wandb_mode,
            config=experiment.to_dict(),
            settings=wandb.Settings(**options),
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def flush(self) -> None:
        pass  # W&B's own service process writes each record as it arrives; it offers no flush

    def close(self) -> None:
        self.run.finish()
