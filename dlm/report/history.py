"""What `dlm report` shows of a run, gathered from its files; the page itself is `dlm.report.page`.

A `RunHistory` holds a run's events (`metrics.jsonl`), its `config.json`, the `dlm eval` reports
saved beside them (any `*.json` whose `format` is an eval report, `eval.json` included) and the
samples the run recorded (`samples.json`). Nothing here needs the plotting extra, so the figures a
chart would draw are testable on their own.

A resumed run appends to `metrics.jsonl`; when it continued from an older checkpoint, the steps
after that checkpoint were trained twice. The history keeps what the run stands on: a start event
at step s drops the earlier events beyond s.

`dlm demo`'s output directory is accepted too: its run is `DIR/run` and its samples `DIR/samples.json`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlm.artifacts.eval_report import EVAL_FORMAT_PREFIX, eval_report_problem
from dlm.artifacts.events import (
    CheckpointEvent,
    EndEvent,
    Event,
    HeldoutEvent,
    RolloutEvent,
    StartEvent,
    TrainEvent,
    ValidationEvent,
    read_events,
)
from dlm.artifacts.run_dir import CONFIG_NAME, METRICS_NAME, RunDir
from dlm.errors import UserError, check_can_create
from dlm.train.loggers import bucket_names

REPORT_NAME = "report.html"
SAMPLES_NAME = "samples.json"  # what `dlm demo` writes beside its run
DEMO_RUN_NAME = "run"  # the run inside a `dlm demo` output directory
# Written into every report's <head>: an existing file that carries it is ours to replace.
GENERATOR_TAG = '<meta name="generator" content="dlm report">'


@dataclass(frozen=True)
class Series:
    """One curve: `values[i]` at `steps[i]`; None where the run recorded no finite number."""

    name: str
    steps: list[int]
    values: list[float | None]


@dataclass(frozen=True)
class EvalResult:
    """One `dlm eval` report found in the run directory."""

    name: str  # its file name
    report: dict[str, Any]

    @property
    def step(self) -> int | None:
        step = self.report.get("context", {}).get("step")
        return step if isinstance(step, int) else None

    def figure(self, key: str) -> float | None:
        value = self.report.get(key)
        if value is None:  # `dlm demo` before 0.9 wrote its unigram level into the context alone
            value = (self.report.get("context") or {}).get(key)
        return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


@dataclass
class RunHistory:
    """Everything the report shows of one run."""

    run_dir: Path
    name: str  # what the page is titled: the directory the user named (a demo's, not its `run`)
    starts: list[StartEvent] = field(default_factory=list)
    train: list[TrainEvent] = field(default_factory=list)
    rollouts: list[RolloutEvent] = field(default_factory=list)  # an RL run's (`dlm rl`)
    heldout: list[HeldoutEvent] = field(default_factory=list)
    validation: list[ValidationEvent] = field(default_factory=list)
    checkpoints: list[CheckpointEvent] = field(default_factory=list)
    end: EndEvent | None = None
    config: dict[str, Any] | None = None
    evals: list[EvalResult] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # files that were there but could not be read

    def train_series(self, name: str) -> Series:
        """A field of the train events (`loss`, `learning_rate`, `grad_norm`, `tokens_per_second` ...)."""

        return Series(
            name, [event.step for event in self.train], [_finite(getattr(event, name)) for event in self.train]
        )

    def validation_series(self, name: str) -> Series:
        events = self.validation
        return Series(name, [event.step for event in events], [_finite(getattr(event, name)) for event in events])

    def rollout_series(self, name: str) -> Series:
        """A field of an RL run's rollout events (`mean_reward`, `accuracy`, `kl`, ...)."""

        events = self.rollouts
        return Series(name, [event.step for event in events], [_finite(getattr(event, name)) for event in events])

    def loss_by_t(self) -> tuple[list[str], list[int], list[list[float | None]]]:
        """(bucket names, steps, rows): rows[b][i] is the loss in noise bucket b at steps[i]."""

        events = [event for event in self.train if event.loss_by_t]
        if not events:
            return [], [], []
        count = len(events[-1].loss_by_t)
        events = [event for event in events if len(event.loss_by_t) == count]
        rows = [[_finite(event.loss_by_t[bucket]) for event in events] for bucket in range(count)]
        return bucket_names(count), [event.step for event in events], rows

    def eval_series(self, key: str, error_key: str) -> tuple[list[int], list[float], list[float]]:
        """(steps, values, standard errors) of an eval figure, for the reports that name their step."""

        points = [(result.step, result.figure(key), result.figure(error_key)) for result in self.evals]
        kept = [(step, value, error or 0.0) for step, value, error in points if step is not None and value is not None]
        return [p[0] for p in kept], [p[1] for p in kept], [p[2] for p in kept]

    def summary(self) -> list[tuple[str, str]]:
        """The headline rows: how the run stands and its latest figures."""

        rows: list[tuple[str, str]] = []
        start = self.starts[-1] if self.starts else None
        last = self.train[-1] if self.train else None
        step = max([0] + [event.step for event in self.train] + [event.step for event in self.checkpoints])
        if start is not None:
            block = start.tokens_per_step // max(start.global_batch, 1)
            rows.append(("model", f"{start.parameters_human} parameters, {start.precision} on {start.device}"))
            rows.append(("optimizer", f"{start.optimizer}, {start.global_batch} blocks of {block} tokens per step"))
            rows.append(("step", f"{step:,} of {start.max_steps:,}"))
        rows.append(("status", self._status()))
        if len(self.starts) > 1:
            rows.append(("resumed", f"{len(self.starts) - 1} time(s)"))
        if last is not None:
            rows.append(("tokens seen", f"{last.tokens_seen:,}"))
            rows.append(("last training loss", _number(last.loss) + f" (step {last.step})"))
        finite = [event for event in self.validation if _finite(event.loss) is not None]
        best = min(finite, key=lambda event: event.loss or 0.0, default=None)
        if best is not None:
            final = self.validation[-1]
            rows.append(("last validation loss", _number(final.loss) + f" (step {final.step})"))
            rows.append(("best validation loss", _number(best.loss) + f" (step {best.step})"))
        if self.rollouts:
            rollout = self.rollouts[-1]
            rows.append(
                (
                    "rollout accuracy",
                    f"{rollout.accuracy:.3f}, mean reward {rollout.mean_reward:.3f} (step {rollout.step})",
                )
            )
        if self.heldout:
            held = self.heldout[-1]
            rows.append(
                (
                    "held-out accuracy",
                    f"{held.accuracy:.3f} ± {held.stderr:.3f} on {held.prompts} prompts (step {held.step})",
                )
            )
        if self.checkpoints:
            rows.append(("last checkpoint", Path(self.checkpoints[-1].path).name))
        return rows

    def _status(self) -> str:
        if self.end is None:
            return "running, or stopped without saying so (no end event)"
        if self.end.resume_command:
            return f"{self.end.status} at step {self.end.step}: continue with {self.end.resume_command}"
        return f"{self.end.status} at step {self.end.step}"


def _finite(value: float | int | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def find_run(path: Path) -> tuple[Path, Path]:
    """(the run directory, where its samples would be): `path` itself, or the run of a demo directory."""

    if not (path / METRICS_NAME).is_file() and (path / DEMO_RUN_NAME / METRICS_NAME).is_file():
        return path / DEMO_RUN_NAME, path / SAMPLES_NAME
    if not (path / METRICS_NAME).is_file():
        raise UserError(
            f"not a dlm run directory: no {METRICS_NAME}",
            path=path,
            fix="pass the training.output_dir of a `dlm train` run, or a `dlm demo` output directory",
        )
    beside = path.parent / SAMPLES_NAME  # the run of a demo directory, named itself: its demo's samples
    if not (path / SAMPLES_NAME).is_file() and path.name == DEMO_RUN_NAME and beside.is_file():
        return path, beside
    return path, path / SAMPLES_NAME


def current_events(events: list[Event]) -> list[Event]:
    """The events the run stands on: a start at step s drops the earlier events beyond s."""

    kept: list[Event] = []
    for event in events:
        if isinstance(event, StartEvent):
            kept = [old for old in kept if getattr(old, "step", -1) <= event.start_step]
        kept.append(event)
    return kept


def _read_json(path: Path, what: str, notes: list[str]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        notes.append(f"{path.name}: cannot read {what}: {exc}")
        return None


def _eval_reports(run_dir: Path, notes: list[str]) -> list[EvalResult]:
    results = []
    for path in sorted(run_dir.glob("*.json")):
        if path.name == CONFIG_NAME or not path.is_file():
            continue
        data = _read_json(path, "a JSON file", notes)
        if not (isinstance(data, dict) and str(data.get("format", "")).startswith(EVAL_FORMAT_PREFIX)):
            continue
        if (problem := eval_report_problem(data)) is not None:
            notes.append(f"{path.name}: a damaged eval report ({problem}); left out")
            continue
        results.append(EvalResult(path.name, data))
    return sorted(results, key=lambda result: (result.step is None, result.step or 0, result.name))


def _samples(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    data = _read_json(path, "the samples", notes)
    if not isinstance(data, list) or not all(isinstance(item, dict) and "text" in item for item in data):
        if data is not None:
            notes.append(f"{path.name}: not a list of samples with a text each; left out")
        return []
    return data


def gather_run(path: str | Path) -> RunHistory:
    """The history of the run in `path` (a run directory or a `dlm demo` output directory)."""

    run_dir, samples_path = find_run(Path(path))
    history = RunHistory(run_dir, Path(path).resolve().name)
    try:
        events = list(read_events(RunDir(run_dir).metrics))
    except OSError as exc:
        raise UserError(f"cannot read {METRICS_NAME}: {exc.strerror or exc}", path=run_dir) from None
    for event in current_events(events):
        if isinstance(event, StartEvent):
            history.starts.append(event)
        elif isinstance(event, TrainEvent):
            history.train.append(event)
        elif isinstance(event, ValidationEvent):
            history.validation.append(event)
        elif isinstance(event, CheckpointEvent):
            history.checkpoints.append(event)
        elif isinstance(event, RolloutEvent):
            history.rollouts.append(event)
        elif isinstance(event, HeldoutEvent):
            history.heldout.append(event)
        else:
            history.end = event
    if RunDir(run_dir).config.is_file():
        config = _read_json(RunDir(run_dir).config, "the config", history.notes)
        history.config = config if isinstance(config, dict) else None
    history.evals = _eval_reports(run_dir, history.notes)
    history.samples = _samples(samples_path, history.notes)
    return history


def config_rows(config: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """`(section.key, value)` of a config, nested tables flattened, values spelled as JSON."""

    rows: list[tuple[str, str]] = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += config_rows(value, f"{name}.")
        else:
            rows.append((name, json.dumps(value, ensure_ascii=False)))
    return rows


def default_output(path: str | Path) -> Path:
    return Path(path) / REPORT_NAME


def is_our_report(path: Path) -> bool:
    """Whether `path` is a report `dlm report` wrote (its head carries `GENERATOR_TAG`)."""

    try:
        with path.open("rb") as handle:
            return GENERATOR_TAG.encode() in handle.read(4096)
    except OSError:
        return False


def check_report_output(output: Path, overwrite: bool) -> None:
    """An earlier report is replaced; any other file only with `overwrite`; a directory never."""

    check_can_create(output, "--output")
    if output.is_dir():
        raise UserError("--output is a directory", path=output, fix="name a file, e.g. report.html")
    if not output.parent.is_dir():
        raise UserError("the directory of --output does not exist", path=output, fix="create it first")
    if output.exists() and not overwrite and not is_our_report(output):
        raise UserError(
            "output exists and is not a report dlm wrote",
            path=output,
            fix="pass --overwrite to replace it, or pick another",
        )
