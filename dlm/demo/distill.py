"""`dlm demo --distill-minutes M`: the demo's model distilled into a few-step student, shown beside it.

After the demo's samples, the exported model is distilled (`dlm.distill`, its rounds planned to fill M
minutes) on the demo's packed data into DIR/student-run, exported to DIR/student, and both sample the
same prompt with the same seed: the teacher in its default steps (one a token), the student in its
own. The pair is reported as one `demo_compare` event with the passes and seconds of each. A second
call reuses a finished student; an interrupted distillation continues with `dlm resume DIR/student-run`.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.events import StreamSink
from dlm.artifacts.export import export_model
from dlm.artifacts.export_layout import CONFIG_NAME, read_export_config
from dlm.artifacts.loading import load_model
from dlm.artifacts.run_dir import RunDir, load_run
from dlm.bench.throughput import run_benchmark
from dlm.distill.budget import budgeted_experiment
from dlm.distill.run import distill
from dlm.distill.step import DistillStep
from dlm.sampling.generation import generate
from dlm.train.loop import TrainResult

COMPARE_PROMPT = "ROMEO:"


def distill_stage(
    model_dir: Path, data_dir: Path, output: Path, minutes: float, length: int, emit: StreamSink
) -> dict[str, Any] | None:
    """Distil `model_dir` within `minutes`, export the student and compare it with its teacher; None when
    the distillation stopped before the end (the comparison then waits for the run to finish)."""

    student_dir, run_dir = output / "student", output / "student-run"
    if (student_dir / CONFIG_NAME).is_file() and read_export_config(student_dir).get("distillation"):
        emit({"event": "demo_stage", "stage": "distill", "status": "reused", "path": str(student_dir)})
    else:
        started = time.perf_counter()
        result = _distill(model_dir, data_dir, run_dir, minutes, emit)
        if result.status != "complete":
            emit(
                {
                    "event": "demo_note",
                    "message": f"the distillation stopped at step {result.step}; continue it "
                    f"with: dlm resume {run_dir}",
                }
            )
            return None
        export_model(run_dir, student_dir, overwrite=True)
        emit(
            {
                "event": "demo_stage",
                "stage": "distill",
                "status": "done",
                "path": str(student_dir),
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
    comparison = compare(model_dir, student_dir, length)
    emit({"event": "demo_compare", **comparison})
    return comparison


def _distill(model_dir: Path, data_dir: Path, run_dir: Path, minutes: float, emit: StreamSink) -> Any:
    """Plan and run the distillation, or continue the one an earlier call left in `run_dir`."""

    run = RunDir(run_dir)
    if run.latest.is_file():  # an earlier call's run: finish it (or take it as it is, when complete)
        experiment, source = load_run(run_dir, None, [])
        step = int(load_checkpoint(source)["step"])
        if step >= experiment.training.max_steps:
            return TrainResult("complete", step, source, run_dir)
        emit({"event": "demo_stage", "stage": "distill", "status": "running", "detail": f"continuing from step {step}"})
        return distill(experiment, resume=source, max_run_seconds=minutes * 60, sink=emit)

    emit(
        {
            "event": "demo_stage",
            "stage": "distill",
            "status": "running",
            "detail": f"timing distillation steps to fill {minutes:g} minutes",
        }
    )
    timer = partial(run_benchmark, step_type=DistillStep)
    # The dilated order: on the demo's model 8 passes in it stay within 10% of one token a pass
    # (docs/distill.md), where ancestral 8-pass samples read far worse.
    fields = {"remasking": "dilated"}
    experiment, seconds_left = budgeted_experiment(model_dir, data_dir, run_dir, minutes, timer, fields)
    assert experiment.distill is not None
    steps = experiment.distill.steps_per_round
    emit(
        {
            "event": "demo_note",
            "message": f"distilling {experiment.distill.teacher_steps} -> "
            f"{experiment.distill.student_steps} sampling steps in the dilated order: "
            f"{experiment.distill.rounds} rounds of {steps} steps",
        }
    )
    return distill(experiment, overwrite=True, max_run_seconds=seconds_left, sink=emit)


def compare(teacher_dir: Path, student_dir: Path, length: int, seed: int = 0) -> dict[str, Any]:
    """The teacher (one step a token) and the student (its own steps) on one prompt and seed."""

    sides = {}
    for name, path, steps in (("teacher", teacher_dir, length), ("student", student_dir, None)):
        model, tokenizer = load_model(path)
        result = generate(model, tokenizer, prompt=COMPARE_PROMPT, length=length, steps=steps, seed=seed)
        sides[name] = {
            "text": result.texts[0],
            "steps": result.steps,
            "forward_passes": result.forward_passes,
            "seconds": round(result.seconds, 3),
        }
    return {"prompt": COMPARE_PROMPT, **sides}
