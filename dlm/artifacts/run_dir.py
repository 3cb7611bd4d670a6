"""The run directory: what it holds, and the checks that keep a run from being lost or replaced.

A run directory is self-contained: `config.json`, `metrics.jsonl`, the numbered checkpoints
(`step-N.pt` files or sharded `step-N/` directories), `latest.pt` or the `latest` link,
`inference-latest.pt`, the `.lock` and a budgeted run's `budget-plan.json` all live in it, and a
resumed run writes into the directory it was resumed from, wherever that is now. Every check here
runs before the run writes anything, so a refused command leaves the directory exactly as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.artifacts.checkpoint import INFERENCE_NAME, LATEST_NAME, numbered_checkpoints, step_checkpoint_name
from dlm.artifacts.events import Event, JsonLinesFileSink
from dlm.artifacts.sharded_checkpoint import (
    LATEST_LINK,
    complete_checkpoints,
    incomplete_checkpoints,
    is_sharded_checkpoint,
    latest_sharded,
    sharded_step,
)
from dlm.config.optimizer_registry import optimizer_spec
from dlm.config.schema import ExperimentConfig, TrainingConfig, load_config
from dlm.errors import UserError, UserNote
from dlm.fileio import atomic_write_json, is_within, temporaries

CONFIG_NAME = "config.json"
METRICS_NAME = "metrics.jsonl"
EVAL_NAME = "eval.json"
# A run trained within a wall-clock budget (`dlm.train.budget`) keeps its plan here; runs of
# `dlm demo` before the planner served `dlm train --minutes` too kept it under the older name.
BUDGET_PLAN_NAME = "budget-plan.json"
EARLIER_BUDGET_PLAN_NAMES = ("demo-plan.json",)
# A distillation run (`dlm distill`) keeps the teacher of its current round beside its checkpoints.
TEACHER_SNAPSHOT_GLOB = "teacher-round-*.safetensors"
# The files whose presence means a run already lives here (besides step-*.pt).
RUN_FILE_NAMES = (CONFIG_NAME, METRICS_NAME, LATEST_NAME, INFERENCE_NAME)


@dataclass(frozen=True)
class RunDir:
    """Where each file of a run lives: callers ask for `run.latest`, never spell out `latest.pt`."""

    path: Path

    @property
    def config(self) -> Path:
        return self.path / CONFIG_NAME

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_NAME

    @property
    def latest(self) -> Path:
        return self.path / LATEST_NAME

    @property
    def inference(self) -> Path:
        return self.path / INFERENCE_NAME

    @property
    def eval_report(self) -> Path:
        return self.path / EVAL_NAME

    @property
    def budget_plan(self) -> Path:
        return self.path / BUDGET_PLAN_NAME

    def budget_plan_files(self) -> list[Path]:
        """The plan files present, the current name first, then those of earlier versions."""

        names = (BUDGET_PLAN_NAME, *EARLIER_BUDGET_PLAN_NAMES)
        return [self.path / name for name in names if (self.path / name).exists()]

    def has_checkpoint(self) -> bool:
        """Whether the run saved a checkpoint to continue from (`latest.pt`, or a complete sharded one)."""

        return self.latest.exists() or latest_sharded(self.path) is not None

    def step_checkpoint(self, step: int) -> Path:
        return self.path / step_checkpoint_name(step)

    def teacher_snapshot(self, round_index: int) -> Path:
        """A distillation run's teacher of round `round_index` (the student as the round began)."""

        return self.path / TEACHER_SNAPSHOT_GLOB.replace("*", f"{round_index:02d}")

    def teacher_snapshots(self) -> dict[int, Path]:
        """The teacher snapshots present, by round."""

        prefix, suffix = TEACHER_SNAPSHOT_GLOB.split("*")
        found = {}
        for path in self.path.glob(TEACHER_SNAPSHOT_GLOB):
            number = path.name[len(prefix) : -len(suffix)]
            if number.isdigit():
                found[int(number)] = path
        return dict(sorted(found.items()))

    def checkpoint_steps(self) -> list[int]:
        """The steps of every checkpoint a resume could start from, single-file or sharded."""

        return sorted({step for step, _ in self.checkpoints()} | {step for step, _ in complete_checkpoints(self.path)})

    def checkpoints(self) -> list[tuple[int, Path]]:
        """`(step, path)` of the numbered checkpoints, oldest first."""

        return numbered_checkpoints(self.path)

    @property
    def latest_link(self) -> Path:
        """`latest`: the link to the newest complete sharded (`step-N/`) checkpoint."""

        return self.path / LATEST_LINK

    def latest_checkpoint(self) -> Path:
        """The newest of `latest.pt` and the sharded `latest` (a run may switch formats on resume);
        `latest.pt` when neither exists, so that errors name the usual file."""

        sharded = latest_sharded(self.path)
        if sharded is None:
            return self.latest
        if not self.latest.is_file():
            return self.latest_link
        single = next((step for step, path in self.checkpoints() if path.samefile(self.latest)), -1)
        return self.latest_link if (sharded_step(sharded) or 0) > single else self.latest

    def resume_checkpoint(self, name: Path | None = None) -> Path:
        """The checkpoint a resume starts from: the latest, or the one named, which must be in this run."""

        if name is None:
            return self.latest_checkpoint()
        chosen = self.path / name if name.parent == Path(".") else name
        if chosen.resolve().parent != self.path.resolve():
            raise UserError(
                "--checkpoint must be a checkpoint of this run, in its directory",
                path=name,
                fix=f"pass a file name from {self.path}, e.g. --checkpoint {step_checkpoint_name(20)}",
            )
        return chosen


def run_files(directory: Path) -> list[Path]:
    """The files of a run in `directory`: what `dlm train` would overwrite."""

    named = [directory / name for name in RUN_FILE_NAMES if (directory / name).exists()]
    sharded = [path for _, path in complete_checkpoints(directory)] + incomplete_checkpoints(directory)
    link = [directory / LATEST_LINK] if (directory / LATEST_LINK).is_symlink() else []
    teachers = list(RunDir(directory).teacher_snapshots().values())
    return named + [path for _, path in numbered_checkpoints(directory)] + sharded + link + teachers


def check_run_file_kinds(directory: Path) -> None:
    """Refuse a run file that is a directory (or another non-file): every write to it would fail."""

    for name in (*RUN_FILE_NAMES, EVAL_NAME):
        path = directory / name
        if (path.exists() or path.is_symlink()) and not path.is_file():
            raise UserError(
                f"{name} is not a regular file, but the run keeps its {name} there",
                path=path,
                fix="move it out of the way, or choose another training.output_dir",
            )


def check_run_target(directory: Path, resume: Path | None, overwrite: bool) -> None:
    """A new run never lands on top of an existing one, unless the user asked for that.

    Continuing from a checkpoint of the same directory is a resume; starting over needs
    `overwrite`; continuing from another run's checkpoint into a directory that holds a run would
    mix two runs and is refused.
    """

    if overwrite and resume is not None:
        raise UserError(
            "--overwrite starts a new run and cannot be combined with resuming one",
            fix="drop --overwrite to continue the run, or drop --resume to start over",
        )
    existing = run_files(directory)
    if overwrite or not existing:
        return
    names = ", ".join(sorted({path.name for path in existing}))
    if resume is None:
        has_checkpoint = RunDir(directory).has_checkpoint()
        fix = f"continue it with: dlm resume {directory}; or" if has_checkpoint else "it saved no checkpoint:"
        raise UserError(
            f"already holds a run ({names}); training here would overwrite it",
            path=directory,
            fix=f"{fix} pass --overwrite to delete it and start over, or choose another training.output_dir",
        )
    source = Path(resume)
    run = source.parent if is_sharded_checkpoint(source) or not source.is_dir() else source
    if run.resolve() != directory.resolve():
        raise UserError(
            f"already holds a run ({names}); continuing {resume} here would mix two runs",
            path=directory,
            fix=f"choose an empty training.output_dir, or continue the run that is there: dlm resume {directory}",
        )


def check_source_kept(source: Path | None, directory: Path) -> None:
    """Refuse to start a run over `directory` when starting over would delete `source`, the model it
    starts from: the directory itself (an export or a run there), or one of the run's files there (a
    checkpoint). A model elsewhere in the directory (`RUN/model/`) is not the run's, and stays."""

    if source is None:
        return
    doomed = run_files(directory) if directory.is_dir() else []
    if Path(source).resolve() == directory.resolve() or any(is_within(source, path) for path in doomed):
        raise UserError(
            f"the run would start from {source}, which starting over in {directory} deletes",
            path=directory,
            fix="choose another output directory for the new run (dlm distill --output, training.output_dir)",
        )


def remove_run_files(directory: Path) -> None:
    """Delete the files of the run in `directory` (called under its lock, after every check).

    Only the files dlm writes go: anything else in the directory is left alone. `metrics.jsonl`
    goes last, so an interrupted removal still shows a run there and is refused again, not mixed.
    """

    doomed = [path for path in run_files(directory) if path.name != METRICS_NAME]
    # The budget plan goes too: left behind, it would pass the next run off as a budgeted one.
    doomed += [directory / EVAL_NAME, *RunDir(directory).budget_plan_files(), *temporaries(directory)]
    doomed.append(directory / METRICS_NAME)
    try:
        for path in doomed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    except OSError as exc:
        raise UserError(f"cannot delete the old run: {exc.strerror or exc}", path=exc.filename or directory) from None


def load_run(
    directory: Path, checkpoint: Path | None = None, overrides: Sequence[str] = ()
) -> tuple[ExperimentConfig, Path]:
    """What `dlm resume` continues: the run's config.json with `overrides`, and its checkpoint.

    The config keeps the directory the run was started in; the run continues where it is now, so
    `training.output_dir` becomes `directory` (and cannot be overridden).
    """

    run = RunDir(directory)
    source = run.resume_checkpoint(checkpoint)
    for needed in (run.config, source):
        if not needed.exists():
            raise UserError(
                "not a dlm run directory: missing " + needed.name,
                path=directory,
                fix="pass the output_dir of an earlier `dlm train`",
            )
    if any(item.replace(" ", "").startswith("training.output_dir=") for item in overrides):
        raise UserError(
            "dlm resume continues the run in RUN_DIR; training.output_dir cannot be set",
            fix="copy the run directory to where it should continue and resume the copy",
        )
    experiment = load_config(run.config, list(overrides))
    here = experiment.training.model_copy(update={"output_dir": directory.absolute()})
    return experiment.model_copy(update={"training": here}), source


# ---------------------------------------------------------------------------------------------
# What a resumed run must agree with
# ---------------------------------------------------------------------------------------------


def metadata_sha256(metadata: dict[str, Any]) -> str:
    """What identifies a packed split: the sha256 of its metadata (blocks, tokens, sources ...)."""

    return hashlib.sha256(json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_resumable(
    checkpoint: dict[str, Any], experiment: ExperimentConfig, tokenizer_hash: str, path: Path, warn: bool = True
) -> None:
    """Refuse to continue a run with a different model, optimizer or tokenizer (reference rules), or
    with another `init_from` than it started from where only the start reads it. With `warn`, a changed
    seed is a `UserNote`: it is allowed (a way past a loss spike), but the run no longer repeats."""

    saved = ExperimentConfig.from_dict(checkpoint["config"], source=path)
    if saved.model != experiment.model:
        changed = sorted(
            name
            for name in type(saved.model).model_fields
            if getattr(saved.model, name) != getattr(experiment.model, name)
        )
        raise UserError(
            f"the model config differs from the checkpoint's in {', '.join(changed)}",
            path=path,
            fix="resume with the run's own config.json, or start a new run in another output_dir",
        )
    now, then = experiment.training, saved.training
    for name in ("optimizer", "lora", *optimizer_spec(now.optimizer).state_settings):
        if getattr(now, name) != getattr(then, name):
            raise UserError(
                f"training.{name} is {getattr(now, name)!r} but the checkpoint used {getattr(then, name)!r}",
                path=path,
                fix="keep the optimizer settings of the run you resume",
            )
    _check_init_from(now, then, path)
    if warn and now.seed != then.seed:
        warnings.warn(
            f"training.seed is {now.seed} but the run was trained with {then.seed}: from this step on its "
            "masking noise, times and data order follow the new seed, and it no longer resumes bit for bit",
            UserNote,
            stacklevel=2,
        )
    if checkpoint.get("tokenizer_sha256") != tokenizer_hash:
        raise UserError(
            "the checkpoint was trained with a different tokenizer file",
            path=path,
            fix=f"use the tokenizer the run was trained with ({then.tokenizer})",
        )


def _check_init_from(now: TrainingConfig, then: TrainingConfig, path: Path) -> None:
    """A resumed run's weights come from its checkpoint: `init_from` is read at its start only, except by a
    LoRA run, which reads its frozen base there again (and checks it by hash)."""

    def where(source: Path | None) -> Path | None:
        return None if source is None else source.expanduser().resolve()

    if now.lora.enabled or where(now.init_from) == where(then.init_from):
        return
    raise UserError(
        f"training.init_from is {now.init_from} but the run started from {then.init_from}: a resumed run's "
        "weights come from its checkpoint",
        path=path,
        fix="resume without changing training.init_from, or start a new run from it with `dlm train`",
    )


def check_same_data(checkpoint: dict[str, Any], data: dict[str, str | None], path: Path, allow_change: bool) -> bool:
    """Refuse packed data other than the run's unless `allow_change`; True when the data changed.

    Checkpoints saved before the data was recorded carry no `data_sha256` and are not checked.
    """

    recorded = checkpoint.get("data_sha256")
    if not isinstance(recorded, dict):
        return False
    changed = [split for split in ("train", "val") if recorded.get(split) != data.get(split)]
    if not changed or allow_change:
        return bool(changed)
    split = changed[0]
    raise UserError(
        f"the {split} data is not the data this run was trained on: its metadata sha256 is "
        f"{str(data.get(split))[:12]}, the checkpoint recorded {str(recorded.get(split))[:12]}",
        path=path,
        fix=f"point training.{split}_data at the run's data, or pass --allow-data-change to continue on the new data",
    )


# ---------------------------------------------------------------------------------------------
# Writing the run's files
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _reported(what: str, path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise UserError(
            f"cannot write {what}: {exc.strerror or exc}", path=path, fix="free some disk space or fix its permissions"
        ) from None


def write_config(run_dir: Path, experiment: ExperimentConfig) -> None:
    """config.json, replaced atomically (the settings a `dlm resume` continues with)."""

    path = RunDir(run_dir).config
    with _reported(CONFIG_NAME, path):
        atomic_write_json(path, experiment.to_dict())


class MetricsFile:
    """The run's metrics.jsonl sink; a failed write is a `UserError`, not a traceback."""

    def __init__(self, run_dir: Path) -> None:
        self.path = RunDir(run_dir).metrics
        with _reported(METRICS_NAME, self.path):
            self._sink = JsonLinesFileSink(self.path)

    def __call__(self, event: Event) -> None:
        with _reported(METRICS_NAME, self.path):
            self._sink(event)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the events are flushed line by line already
            self._sink.close()
