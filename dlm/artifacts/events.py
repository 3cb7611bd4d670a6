"""The training events: one dataclass per kind, the only definition of what the loop reports.

`dlm.train` builds these and hands them to a `Sink`; the dashboard renders them, the JSON sinks and
the run's `metrics.jsonl` write `to_dict()` of them, and readers of `metrics.jsonl` get them back with
`event_from_dict`. On disk an event is one JSON object whose `"event"` key names its kind, followed by
its fields in declaration order: renaming a field here renames it in every file written from now on.

To add a field, add it to its dataclass (with a default when older `metrics.jsonl` lines lack it).
To add a kind, define a dataclass with its `kinds`, decorate it with `@register_event` and add it to `Event`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar, Literal, TypeVar

EndStatus = Literal["complete", "paused", "interrupted"]

_KINDS: dict[str, type[RunEvent]] = {}
_R = TypeVar("_R", bound="RunEvent")


def register_event(cls: type[_R]) -> type[_R]:
    """Make `event_from_dict` (and so `read_events`) read the kinds of this event class."""

    for kind in cls.kinds:
        _KINDS[kind] = cls
    return cls


@dataclass(frozen=True)
class RunEvent:
    """What every event shares: its kind (the `"event"` key on disk) and its flat JSON form."""

    kinds: ClassVar[tuple[str, ...]] = ()

    @property
    def kind(self) -> str:
        return self.kinds[0]

    def to_dict(self) -> dict[str, Any]:
        # Shallow on purpose: asdict would deep-copy the lists of every train event.
        return {"event": self.kind, **{field.name: getattr(self, field.name) for field in dataclasses.fields(self)}}

    @classmethod
    def _from_fields(cls, kind: str, fields: dict[str, Any]) -> RunEvent:
        return cls(**fields)


@register_event
@dataclass(frozen=True)
class StartEvent(RunEvent):
    """The run's setup, once per `train` call, before the first step."""

    kinds: ClassVar[tuple[str, ...]] = ("start",)
    run_dir: str
    device: str
    precision: str
    parameters: int
    parameters_human: str
    optimizer: str
    compile: bool
    activation_checkpointing: bool
    fused_attention_required: bool
    world_size: int
    parallelism: str | None
    global_batch: int
    tokens_per_step: int
    training_blocks: int
    start_step: int
    max_steps: int
    resumed_from: str | None
    data_changed: bool
    dlm_version: str
    # The CPU thread plan (`dlm.runtime.threads.ThreadPlan.describe`); None off the CPU and in older files.
    cpu_threads: str | None = None
    # How a resume on another number of processes kept (or changed) the global batch; None otherwise.
    batch_note: str | None = None
    # A warning about the precision on this CPU (`dlm.runtime.device.cpu_precision_note`); None when all is well.
    precision_note: str | None = None
    # The trained model whose weights the run started from (`training.init_from`); None otherwise.
    init_from: str | None = None
    # Parameters the optimizer updates: all of them, or a LoRA run's adapters; None in older files.
    trainable_parameters: int | None = None


@register_event
@dataclass(frozen=True)
class TrainEvent(RunEvent):
    """The figures of the steps since the last log step (averaged over them and over the ranks).

    Non-finite numbers are written as null, so a loss read back from disk may be None."""

    kinds: ClassVar[tuple[str, ...]] = ("train",)
    step: int
    max_steps: int
    loss: float | None
    masked_accuracy: float | None
    learning_rate: float
    grad_norm: float | None
    tokens_seen: int
    tokens_per_second: float
    mfu: float | None  # None where the device's peak FLOP/s is unknown
    eta_seconds: float
    loss_by_t: list[float | None]  # the mean loss per noise-time bucket; None for an empty bucket
    # Accelerator memory in GiB (`dlm.runtime.memory.memory_stats`), zeros off CUDA.
    allocated_gib: float = 0.0
    reserved_gib: float = 0.0
    peak_allocated_gib: float = 0.0
    # What these steps train when it is not plain diffusion training, for people: a distillation
    # run's round, its sampling steps and the divergence that `loss` then is. Written only when set,
    # so a diffusion run's lines keep their format.
    phase: str | None = None

    def to_dict(self) -> dict[str, Any]:
        fields = super().to_dict()
        if fields["phase"] is None:
            del fields["phase"]
        return fields


@register_event
@dataclass(frozen=True)
class ValidationEvent(RunEvent):
    """Fixed-noise validation (`dlm.evaluation.evaluate.fixed_noise_validation`) at `step`."""

    kinds: ClassVar[tuple[str, ...]] = ("validation",)
    step: int
    loss: float | None
    masked_accuracy: float | None
    batches: int


@register_event
@dataclass(frozen=True)
class CheckpointEvent(RunEvent):
    """A training checkpoint is complete on disk at `path`."""

    kinds: ClassVar[tuple[str, ...]] = ("checkpoint",)
    step: int
    path: str


@register_event
@dataclass(frozen=True)
class EndEvent(RunEvent):
    """How the `train` call ended; on disk its status is the event's kind."""

    kinds: ClassVar[tuple[str, ...]] = ("complete", "paused", "interrupted")
    status: EndStatus
    step: int
    checkpoint: str
    resume_command: str | None  # None once the run is complete

    @property
    def kind(self) -> str:
        return self.status

    def to_dict(self) -> dict[str, Any]:
        fields = super().to_dict()
        del fields["status"]  # it is the "event" key already
        return fields

    @classmethod
    def _from_fields(cls, kind: str, fields: dict[str, Any]) -> RunEvent:
        return cls(status=kind, **fields)  # type: ignore[arg-type]  # kind is one of `kinds`


@register_event
@dataclass(frozen=True)
class RolloutEvent(RunEvent):
    """An RL run's rollouts since the last log step (`dlm rl`), averaged over the steps and the ranks."""

    kinds: ClassVar[tuple[str, ...]] = ("rollout",)
    step: int
    mean_reward: float
    accuracy: float  # the share of rollouts whose first reward is positive
    reward_std: float  # within groups, averaged: the signal GRPO learns from
    flat_groups: float  # the share of groups whose rewards were all equal (no gradient)
    kl: float  # the mean KL estimate to the reference (0 without one)
    clip_fraction: float  # the share of scored tokens whose ratio the clip held
    rollout_seconds: float  # per step: sampling and rewards
    update_seconds: float  # per step: scoring, backward and optimizer steps
    sample: str  # one rollout of the last step, prompt and reply, for people
    # The variance of a row's likelihood estimate across its independent samples (rl.estimator_samples
    # of 2 or more; None with one): the noise the estimator adds to each ratio.
    estimator_variance: float | None = None


@register_event
@dataclass(frozen=True)
class HeldoutEvent(RunEvent):
    """Accuracy on the held-out prompts (`[rl] heldout`), one greedy-free sample per prompt at `step`."""

    kinds: ClassVar[tuple[str, ...]] = ("heldout",)
    step: int
    accuracy: float
    stderr: float
    mean_reward: float
    prompts: int


Event = StartEvent | TrainEvent | ValidationEvent | CheckpointEvent | EndEvent | RolloutEvent | HeldoutEvent
Sink = Callable[[Event], None]
# `dlm demo` reports its own stages as plain dicts, on one stream with the training events it passes on.
StreamEvent = Event | dict[str, Any]
StreamSink = Callable[[StreamEvent], None]


def event_from_dict(data: Mapping[str, Any]) -> Event:
    """The event a `to_dict()` (or a `metrics.jsonl` line) describes; ValueError for anything else."""

    fields = dict(data)
    kind = fields.pop("event", None)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"not a training event: {kind!r}")
    try:
        event = cls._from_fields(kind, fields)
    except TypeError as exc:  # a missing or unknown field
        raise ValueError(f"a {kind} event with other fields: {exc}") from None
    return event  # type: ignore[return-value]  # every registered class is a member of Event


def to_json_line(data: Mapping[str, Any]) -> str:
    """One compact JSON object; non-finite floats become null so every line stays valid JSON."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [clean(item) for item in value]
        return value

    return json.dumps(clean(data), default=str, allow_nan=False)


def read_events(path: Path) -> Iterator[Event]:
    """The events of a `metrics.jsonl`, skipping a line a crash cut short and lines of other kinds."""

    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            data = json.loads(line)
            yield event_from_dict(data if isinstance(data, dict) else {})
        except ValueError:  # JSONDecodeError included
            continue


def fan_out(sinks: list[Sink]) -> Sink:
    """A sink that forwards each event to several sinks."""

    def forward(event: Event) -> None:
        for target in sinks:
            target(event)

    return forward


# The JSON sinks. They also write the plain-dict events of `dlm demo`'s stages, which share the demo's
# stream with the training events it passes on. Tests pass `list.append` as a sink.
def _json_line(event: RunEvent | Mapping[str, Any]) -> str:
    return to_json_line(event.to_dict() if isinstance(event, RunEvent) else event)


class JsonLinesSink:
    """One JSON object per event on a stream (stdout when not a TTY, or with --json)."""

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream or sys.stdout

    def __call__(self, event: RunEvent | Mapping[str, Any]) -> None:
        self.stream.write(_json_line(event) + "\n")
        self.stream.flush()


def _ends_mid_line(path: Path) -> bool:
    """Whether the file at `path` holds text after its last newline."""

    try:
        with path.open("rb") as handle:
            if handle.seek(0, os.SEEK_END) == 0:
                return False
            handle.seek(-1, os.SEEK_END)
            return handle.read(1) != b"\n"
    except FileNotFoundError:
        return False


class JsonLinesFileSink:
    """Appends every event to a file (the run's metrics.jsonl), flushed per line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        cut_short = _ends_mid_line(path)
        self.handle = path.open("a", encoding="utf-8")
        if cut_short:  # a last line a crash or a full disk cut short stays apart (unreadable), not glued on
            self.handle.write("\n")

    def __call__(self, event: RunEvent | Mapping[str, Any]) -> None:
        self.handle.write(_json_line(event) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()
