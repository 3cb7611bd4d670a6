"""`dlm train --minutes`: the plan from a (forced) calibration pace fills the budget, options that
contradict the plan are refused, a finished run is reused, and the plan file keeps one name."""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, tiny_experiment, train_tiny_run

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.events import CheckpointEvent, StreamEvent, TrainEvent
from dlm.artifacts.run_dir import BUDGET_PLAN_NAME, RunDir, remove_run_files
from dlm.config.schema import ExperimentConfig
from dlm.errors import UserError
from dlm.train.budget import (
    SCHEDULE_SHARE,
    BudgetedTraining,
    plan_schedule,
    validation_blocks,
    validation_steps,
)
from dlm.train.plan import TrainingPlan

TINY_CONFIG = ROOT / "configs" / "tiny.toml"


@dataclass(frozen=True)
class FakeCalibration:
    step_time_s: float
    warmup_seconds: float
    tokens_per_second: float = 1000.0


def fake_calibrator(seconds_per_step: float, calls: list[int] | None = None) -> Callable[..., FakeCalibration]:
    """A calibration that reports `seconds_per_step` at once (the first step costing twice as much)."""

    def calibrate(experiment: ExperimentConfig, *, steps: int, warmup: int) -> FakeCalibration:
        if calls is not None:
            calls.append(steps)
        return FakeCalibration(seconds_per_step, 2 * seconds_per_step)

    return calibrate


def data_overrides(data_dir: Path, run_dir: Path) -> list[str]:
    names = {"tokenizer": "tokenizer.json", "train_data": "train.bin", "val_data": "val.bin"}
    pairs = [f"training.{field}={data_dir / name}" for field, name in names.items()]
    return [item for pair in [*pairs, f"training.output_dir={run_dir}"] for item in ("--set", pair)]


def budget_events(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [event for event in events if event["event"] == kind]


# ---------------------------------------------------------------------------------------- planning


def test_the_plan_fills_the_budget_at_the_calibrated_pace(tiny_data_dir: Path, tmp_path: Path) -> None:
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run")
    events: list[StreamEvent] = []
    calls: list[int] = []
    training = BudgetedTraining(experiment, 10, calibrate=fake_calibrator(0.25, calls), emit=events.append)
    plan = training.calibrate()
    assert calls == [3] and plan.seconds_per_step == 0.25 and plan.rate_source == "calibration"
    # Ten minutes at 0.25 s per step: the steps, their validations and the first step's start-up
    # fill SCHEDULE_SHARE of what calibration left, and waste none of it.
    usable = (600 - plan.calibration_seconds - 0.25) * SCHEDULE_SHARE
    validations = plan.max_steps / plan.eval_interval
    cost = validation_steps(experiment, validation_blocks(experiment)) * 0.25
    assert validation_blocks(experiment) > 0 and cost > 0
    assert plan.max_steps * 0.25 + validations * cost <= usable
    assert plan.max_steps * 0.25 + validations * cost >= 0.99 * usable
    assert plan.max_steps > 2000 and plan.warmup_steps == round(plan.max_steps * 5 / 60)  # tiny.toml's warmup share
    assert (plan.eval_interval, plan.save_interval) == (20, 20)  # the config's, fewer than the plan needs
    done = [event for event in events if isinstance(event, dict) and event["status"] == "done"]
    assert done == [
        {
            "event": "budget_stage",
            "stage": "calibrate",
            "status": "done",
            "seconds": done[0]["seconds"],
            "tokens_per_second": 1000.0,
            **asdict(plan),
        }
    ]
    assert not (tmp_path / "run").exists()  # the plan is saved when training starts, not before


def test_a_slower_pace_plans_fewer_steps_in_the_same_budget(tiny_data_dir: Path, tmp_path: Path) -> None:
    """What makes one config right on a fast and a slow CPU: the steps follow the measured pace."""

    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run")
    fast, slow = (
        BudgetedTraining(experiment, 10, calibrate=fake_calibrator(pace), emit=lambda event: None).calibrate()
        for pace in (0.2, 0.8)
    )
    assert slow.max_steps < fast.max_steps / 3.5 and slow.max_steps * 0.8 < 600 * SCHEDULE_SHARE


def test_a_budget_too_short_is_refused_with_the_minutes_needed(tiny_data_dir: Path, tmp_path: Path) -> None:
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run")
    training = BudgetedTraining(experiment, 0.1, calibrate=fake_calibrator(5.0), emit=lambda event: None)
    with pytest.raises(UserError, match=r"--minutes 0.1 leaves time for 0 training steps of 5.00 s") as refused:
        training.run()
    assert "pass --minutes 2 or more" in str(refused.value)  # (5 s start-up + 20 steps) / 0.9
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------- the plan file


def test_a_demo_plan_of_an_earlier_version_is_read_and_moved_to_the_neutral_name(tmp_path: Path) -> None:
    plan = TrainingPlan(60.0, 0.5, "calibration", 1.5, 100, 10, 25, 25, 1, trained_seconds=1.5)
    legacy = asdict(plan) | {"format": "dlm-demo-plan-v1"}
    (tmp_path / "demo-plan.json").write_text(json.dumps(legacy))
    assert TrainingPlan.load(tmp_path) == plan
    plan.save(tmp_path)
    assert [path.name for path in RunDir(tmp_path).budget_plan_files()] == [BUDGET_PLAN_NAME]
    assert json.loads((tmp_path / BUDGET_PLAN_NAME).read_text())["format"] == "dlm-budget-plan-v1"
    (tmp_path / BUDGET_PLAN_NAME).write_text('{"format": "other"}')
    with pytest.raises(UserError, match="unreadable training plan"):
        TrainingPlan.load(tmp_path)


def test_removing_a_run_removes_its_plan(tmp_path: Path) -> None:
    """Left behind by `--overwrite`, a plan would pass the next run off as a budgeted one."""

    for name in ("config.json", "metrics.jsonl", BUDGET_PLAN_NAME, "demo-plan.json", "notes.txt"):
        (tmp_path / name).write_text("{}")
    remove_run_files(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------------------------------- CLI


def test_options_that_contradict_the_plan_are_refused(
    tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    base = ("train", "--config", TINY_CONFIG, *data_overrides(tiny_data_dir, tmp_path / "run"), "--minutes", "1")
    run_cli(*base, "--resume", tmp_path / "run" / "latest.pt").assert_refused("--resume does not apply with --minutes")
    cli = run_cli(*base, "--max-run-steps", "5", "--max-run-minutes", "1")
    cli.assert_refused("--max-run-steps, --max-run-minutes do not apply with --minutes", "drop")
    run_cli(*base, "--nproc", "2").assert_refused("--nproc does not apply with --minutes")
    cli = run_cli(*base, "--set", "training.max_steps=5")
    cli.assert_refused("--set training.max_steps does not apply with --minutes", "drop --minutes")
    run_cli(*base[:-1], "0").assert_refused("--minutes must be a positive number")
    assert not (tmp_path / "run").exists()


@pytest.fixture
def planned_run(tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[int]]:
    """A 4-step run with the plan of 4 steps that trained it, and the calls a calibration would make."""

    run_dir = train_tiny_run(tiny_data_dir, tmp_path / "run")
    TrainingPlan(60.0, 0.5, "measured", 1.0, 4, 1, 4, 4, 1, trained_seconds=20.0).save(run_dir)
    calls: list[int] = []
    monkeypatch.setattr("dlm.bench.throughput.run_benchmark", fake_calibrator(0.5, calls))
    return run_dir, calls


def test_a_budget_in_the_config_plans_as_minutes_does_and_its_conflicts_name_the_fix(
    tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., Any], planned_run: tuple[Path, list[int]]
) -> None:
    run_dir, calls = planned_run
    base = ("train", "--config", TINY_CONFIG, *data_overrides(tiny_data_dir, run_dir))
    budget = ("--set", "training.budget_minutes=1")
    cli = run_cli(*base, *budget, "--json")  # no --minutes: the config's budget plans (here: reuses) the run
    assert cli.exit_code == 0, cli.stderr
    events = [json.loads(line) for line in cli.stdout.splitlines()]
    assert [(event["stage"], event["status"]) for event in events] == [("calibrate", "reused"), ("train", "reused")]
    source = f"training.budget_minutes = 1 in {TINY_CONFIG}"
    cli = run_cli(*base, *budget, "--set", "training.max_steps=8")
    cli.assert_refused(
        f"--set training.max_steps does not apply with {source}",
        "add --set training.budget_minutes=0 to train a fixed number of steps",
    )
    cli = run_cli(*base, *budget, "--max-run-steps", "5")
    cli.assert_refused(f"--max-run-steps does not apply with {source}", "add --set training.budget_minutes=0")
    with pytest.MonkeyPatch.context() as torchrun:
        torchrun.setenv("WORLD_SIZE", "2")
        cli = run_cli(*base, *budget)
        cli.assert_refused(f"{source} trains in one process", "add --set training.budget_minutes=0")
    # budget_minutes = 0 (the default) trains max_steps as given; --minutes overrides the config's budget
    fixed = ("train", "--config", TINY_CONFIG, *data_overrides(tiny_data_dir, tmp_path / "fixed"))
    cli = run_cli(*fixed, "--set", "training.budget_minutes=0", "--set", "training.max_steps=8", "--max-run-steps", "1")
    assert cli.exit_code == 0, cli.stderr
    assert json.loads((tmp_path / "fixed" / "config.json").read_text())["training"]["max_steps"] == 8
    cli = run_cli(*base, "--set", "training.budget_minutes=0", "--minutes", "1", "--max-run-steps", "5")
    cli.assert_refused("--max-run-steps does not apply with --minutes", "drop --max-run-steps")
    assert calls == []


def test_a_run_that_no_budget_planned_is_refused(
    tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = train_tiny_run(tiny_data_dir, tmp_path / "run")
    before = sorted(path.name for path in run_dir.iterdir())
    monkeypatch.setattr("dlm.bench.throughput.run_benchmark", fake_calibrator(0.1))
    cli = run_cli("train", "--config", TINY_CONFIG, *data_overrides(tiny_data_dir, run_dir), "--minutes", "1")
    cli.assert_refused(
        "holds a training run that --minutes did not plan (trained to step 4)",
        str(run_dir),
        "or pass --overwrite to start over",
    )
    assert sorted(path.name for path in run_dir.iterdir()) == before


def test_a_finished_plan_is_reused_and_a_smaller_budget_changes_nothing(
    tiny_data_dir: Path, run_cli: Callable[..., Any], planned_run: tuple[Path, list[int]]
) -> None:
    run_dir, calls = planned_run
    before = {path.name: path.stat().st_mtime_ns for path in run_dir.iterdir()}
    base = ("train", "--config", TINY_CONFIG, *data_overrides(tiny_data_dir, run_dir), "--json", "--minutes")
    for minutes in ("1", "0.5"):
        cli = run_cli(*base, minutes)
        assert cli.exit_code == 0, cli.stderr
        events = [json.loads(line) for line in cli.stdout.splitlines()]
        assert [(event["stage"], event["status"]) for event in events] == [("calibrate", "reused"), ("train", "reused")]
        assert events[-1]["step"] == 4 and events[-1]["max_steps"] == 4
    assert calls == [] and {path.name: path.stat().st_mtime_ns for path in run_dir.iterdir()} == before


def test_a_run_stopped_where_no_step_fit_its_budget_is_reused(
    tiny_data_dir: Path, run_cli: Callable[..., Any], planned_run: tuple[Path, list[int]]
) -> None:
    """Short of its planned steps, but no time was left for another one at the pace it kept: done for
    its budget, not an interrupted run to carry on."""

    run_dir, calls = planned_run
    TrainingPlan(60.0, 0.5, "measured", 1.0, 8, 1, 4, 4, 1, trained_seconds=59.5).save(run_dir)
    before = {path.name: path.stat().st_mtime_ns for path in run_dir.iterdir()}
    command = ("train", "--config", TINY_CONFIG, *data_overrides(tiny_data_dir, run_dir), "--json", "--minutes", "1")
    cli = run_cli(*command)
    assert cli.exit_code == 0, cli.stderr
    events = [json.loads(line) for line in cli.stdout.splitlines()]
    assert [(event["stage"], event["status"]) for event in events] == [("calibrate", "reused"), ("train", "reused")]
    assert (events[-1]["step"], events[-1]["max_steps"]) == (4, 8)
    assert calls == [] and {path.name: path.stat().st_mtime_ns for path in run_dir.iterdir()} == before


@pytest.mark.slow
def test_a_budgeted_run_trains_to_its_plan_and_a_rerun_reuses_it(
    tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    # A forced pace of 0.3 s per step: a handful of steps in the 6 s budget, re-planned from the
    # pace the tiny model really keeps; whatever that is, the run ends by the deadline.
    monkeypatch.setattr("dlm.bench.throughput.run_benchmark", fake_calibrator(0.3))
    command = ("train", "--config", TINY_CONFIG, *data_overrides(tiny_data_dir, run_dir), "--minutes", "0.1", "--json")
    cli = run_cli(*command)
    assert cli.exit_code == 0, cli.stderr
    events = [json.loads(line) for line in cli.stdout.splitlines()]
    calibrated = budget_events(events, "budget_stage")[1]
    assert calibrated["stage"] == "calibrate" and calibrated["status"] == "done"
    experiment = tiny_experiment(tiny_data_dir, run_dir)
    expected = plan_schedule(
        budget_seconds=6.0,
        spent_seconds=calibrated["calibration_seconds"] + 0.3,
        seconds_per_step=0.3,
        base=experiment,
        validation_steps=validation_steps(experiment, validation_blocks(experiment)),
    )
    assert isinstance(expected, dict) and calibrated["max_steps"] == expected["max_steps"]
    trained = budget_events(events, "budget_stage")[-1]
    assert (trained["stage"], trained["status"]) == ("train", "done") and trained["outcome"] in ("complete", "paused")
    plan = TrainingPlan.load(run_dir)
    assert plan is not None and plan.budget_seconds == 6.0 and trained["max_steps"] == plan.max_steps
    # One `train` call, its schedule re-fitted to the tiny model's real pace as it trained.
    assert len(budget_events(events, "start")) == 1 and budget_events(events, "budget_replan")
    run_config = json.loads((run_dir / "config.json").read_text())["training"]
    assert (run_config["max_steps"], run_config["warmup_steps"]) == (plan.max_steps, plan.warmup_steps)
    latest = (run_dir / "latest.pt").stat().st_mtime_ns
    # The same --minutes again: the finished run is reused, nothing is trained or written.
    cli = run_cli(*command)
    assert cli.exit_code == 0, cli.stderr
    again = [json.loads(line) for line in cli.stdout.splitlines()]
    assert [(event["stage"], event["status"]) for event in again] == [("calibrate", "reused"), ("train", "reused")]
    assert again[-1]["step"] == trained["step"] and (run_dir / "latest.pt").stat().st_mtime_ns == latest


def test_a_replanned_run_never_raises_its_learning_rate_after_warmup(
    tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Calibrated far slower than the tiny model trains: every re-plan extends max_steps a lot, which
    # with a plain cosine would throw the learning rate back up the curve.
    monkeypatch.setattr("dlm.bench.throughput.run_benchmark", fake_calibrator(0.5))
    run_dir = tmp_path / "run"
    command = ("train", "--config", TINY_CONFIG, *data_overrides(tiny_data_dir, run_dir), "--minutes", "0.1", "--json")
    cli = run_cli(*command)
    assert cli.exit_code == 0, cli.stderr
    events = [json.loads(line) for line in cli.stdout.splitlines()]
    replans = budget_events(events, "budget_replan")
    assert any(r["max_steps"] > r["previous_max_steps"] for r in replans)
    plan = TrainingPlan.load(run_dir)
    assert plan is not None and plan.decay_anchor_step == replans[-1]["step"] and 0 < plan.decay_anchor_progress < 1
    rates = [(event["step"], event["learning_rate"]) for event in budget_events(events, "train")]
    decaying = [rate for step, rate in rates if step > plan.warmup_steps]
    assert len(decaying) > 3 and all(later <= earlier for earlier, later in itertools.pairwise(decaying))


@pytest.mark.slow
def test_a_late_slowdown_is_caught_on_the_clock_and_the_schedule_still_reaches_its_floor(
    tiny_data_dir: Path, tmp_path: Path
) -> None:
    """The machine gets busy two thirds of the way: from then on every step takes several times as long.
    A schedule re-fitted only at fixed steps would run into the deadline mid-decay; re-fitted on the
    clock, it shrinks in time and ends complete, on the floor, within the budget."""

    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run")
    events: list[StreamEvent] = []
    saved: list[tuple[int, int]] = []  # (checkpoint step, the max_steps of the plan saved with it)
    fields = ("max_steps", "warmup_steps", "decay_anchor_step", "decay_anchor_progress")
    started = time.perf_counter()

    def busy_machine(event: StreamEvent) -> None:
        events.append(event)
        if isinstance(event, TrainEvent) and time.perf_counter() - started > 8.0:
            time.sleep(0.08)
        if isinstance(event, CheckpointEvent):
            plan = TrainingPlan.load(tmp_path / "run")
            assert plan is not None
            saved.append((event.step, plan.max_steps))
            # The plan and config.json saved with a checkpoint hold the schedule it trained with.
            trained_with = load_checkpoint(Path(event.path))["config"]["training"]
            on_disk = json.loads((tmp_path / "run" / "config.json").read_text())["training"]
            assert {name: getattr(plan, name) for name in fields} == {name: trained_with[name] for name in fields}
            assert {name: on_disk[name] for name in fields} == {name: trained_with[name] for name in fields}

    # 12 s, 4 of them after the slowdown: room for several re-fits, so that a slower or busy machine,
    # whose steps also vary by themselves, still ends complete (at 9 s it ended paused once in a while).
    training = BudgetedTraining(experiment, 0.2, calibrate=fake_calibrator(0.02), emit=busy_machine)
    plan, step, result = training.run()
    # Complete: the deadline (the budget) never had to stop it.
    assert result is not None and result.status == "complete" and step == plan.max_steps
    shrunk = [e for e in budget_events([e for e in events if isinstance(e, dict)], "budget_replan")]
    assert any(e["max_steps"] < e["previous_max_steps"] for e in shrunk)
    last = [event for event in events if isinstance(event, TrainEvent)][-1]
    assert last.step == plan.max_steps
    assert last.learning_rate == pytest.approx(experiment.training.min_learning_rate)
    # Each checkpoint's plan is one its step lies within; the last is the plan the run ended on.
    assert saved and all(step <= max_steps for step, max_steps in saved) and saved[-1] == (step, plan.max_steps)


def test_an_anchored_cosine_keeps_its_rate_at_the_anchor_and_ends_on_the_floor() -> None:
    from dlm.config.schema import TrainingConfig
    from dlm.train.optimizer import learning_rate

    plain = TrainingConfig(max_steps=100, warmup_steps=10, learning_rate=1e-3, min_learning_rate=1e-4)
    before = learning_rate(60, plain)
    for end in (61, 62, 80, 300):  # a re-fit after step 60 to these ends, the shortest leaving one step
        anchored = plain.model_copy(
            update={"max_steps": end, "decay_anchor_step": 60, "decay_anchor_progress": (60 - 10) / 89}
        )
        rates = [learning_rate(step, anchored) for step in range(60, end)]
        assert rates[0] == pytest.approx(before) or end == 61
        assert rates[-1] == pytest.approx(1e-4, abs=1e-12)
        assert all(later <= earlier for earlier, later in itertools.pairwise(rates))


def test_the_terminal_view_shows_the_plan_and_its_replans() -> None:
    import io

    from rich.console import Console

    from dlm.cli.budget_view import BudgetView

    output = io.StringIO()
    view = BudgetView(Console(file=output, width=80, force_terminal=True, color_system=None))
    plan = TrainingPlan(600.0, 0.25, "calibration", 2.0, 2000, 166, 20, 20, 20, trained_seconds=2.0)
    view({"event": "budget_stage", "stage": "calibrate", "status": "running", "detail": "timing 3 training steps"})
    view({"event": "budget_stage", "stage": "calibrate", "status": "done", "seconds": 2.0, **asdict(plan)})
    view({"event": "budget_stage", "stage": "train", "status": "running", **asdict(plan)})
    assert view.dashboard is not None
    view(
        {"event": "budget_replan", "step": 1000, "seconds_per_step": 0.3, "previous_max_steps": 2000, "max_steps": 1800}
    )
    panel = io.StringIO()
    Console(file=panel, width=80, force_terminal=True, color_system=None).print(view.dashboard.render())
    # Re-fits that move the end less than 5% from the last announced one update the panel quietly.
    for step, end in ((1100, 1790), (1200, 1760), (1300, 1700)):
        refit = {"step": step, "seconds_per_step": 0.3, "previous_max_steps": 1800, "max_steps": end}
        view({"event": "budget_replan", **refit})
    view({"event": "budget_stage", "stage": "train", "status": "done", "outcome": "complete", "step": 1700})
    view.close()
    text = output.getvalue()
    announced = re.findall(r"step (\d+): [^\n]* the schedule now", text)
    assert announced == ["1000", "1300"]
    assert "calibrating: timing 3 training steps" in text
    assert "plan: 2000 steps at 0.25 s per step (calibration), warmup 166" in text.replace("\n", " ")
    assert "step 1000: 0.3 s per step, the schedule now ends at step 1800 (was 2000)" in text.replace("\n", " ")
    assert "plan: step 1800 at 0.3 s per step, re-planned 1x" in panel.getvalue()


@pytest.mark.slow
def test_the_same_budget_again_finishes_an_interrupted_run(tiny_data_dir: Path, tmp_path: Path) -> None:
    import signal

    from dlm.artifacts.events import CheckpointEvent, EndEvent, StartEvent
    from dlm.train.stop import StopSignals

    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run")
    first: list[StreamEvent] = []
    with StopSignals() as stop:

        def ctrl_c_at_the_first_checkpoint(event: StreamEvent) -> None:
            first.append(event)
            if isinstance(event, CheckpointEvent):
                stop.signal_number = signal.SIGINT  # as the handler records Ctrl-C

        training = BudgetedTraining(
            experiment, 0.1, calibrate=fake_calibrator(0.3), stop=stop, emit=ctrl_c_at_the_first_checkpoint
        )
        plan, step, result = training.run()
    assert result is not None and result.status == "interrupted" and step < plan.max_steps
    saved = TrainingPlan.load(tmp_path / "run")
    assert saved is not None and saved.max_steps == plan.max_steps and saved.trained_seconds < 6.0
    calls: list[int] = []
    again: list[StreamEvent] = []
    training = BudgetedTraining(experiment, 0.1, calibrate=fake_calibrator(0.3, calls), emit=again.append)
    plan, final, result = training.run()
    assert calls == []  # the plan is reused, not calibrated again
    start = next(event for event in again if isinstance(event, StartEvent))
    assert start.start_step == step and start.resumed_from is not None
    assert result is not None and result.status in ("complete", "paused") and final > step
    assert [event.step for event in again if isinstance(event, EndEvent)][-1] == final


def test_a_budgeted_run_warns_of_memory_before_its_calibration_once(
    tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calibration trains full steps before the loop's own check: a run whose activations may not fit the
    free memory hears it first (a note, before `calibrate`), and once."""

    from dlm.train import memory
    from dlm.train.memory import AvailableMemory, estimate_training_memory

    run_dir = tmp_path / "run"
    state = estimate_training_memory(tiny_experiment(tiny_data_dir, run_dir), "float32").model_state
    monkeypatch.setattr(memory, "available_memory", lambda device: AvailableMemory(state, "of RAM available"))
    monkeypatch.setattr("dlm.bench.throughput.run_benchmark", fake_calibrator(0.3))
    command = ("train", "--config", TINY_CONFIG, *data_overrides(tiny_data_dir, run_dir), "--minutes", "0.05", "--json")
    cli = run_cli(*command)
    assert cli.exit_code == 0, cli.stderr
    events = [json.loads(line) for line in cli.stdout.splitlines()]
    kinds = [event["event"] for event in events]
    (note,) = budget_events(events, "budget_note")
    assert note["message"].startswith("memory: needs ~") and "the activations may not fit" in note["message"]
    assert kinds.index("budget_note") < kinds.index("budget_stage")  # before the calibration's first step
    assert "warning: memory" not in cli.stderr  # the loop does not say it again
