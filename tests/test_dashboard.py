"""Events and their sinks: the typed events of a real run reach the dashboard, the JSON sinks and
metrics.jsonl unchanged; the rich dashboard renders what a person needs; JSON lines stay valid JSON."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import tiny_experiment
from rich.console import Console

from dlm.artifacts.events import (
    CheckpointEvent,
    EndEvent,
    Event,
    JsonLinesFileSink,
    JsonLinesSink,
    StartEvent,
    TrainEvent,
    ValidationEvent,
    event_from_dict,
    fan_out,
    read_events,
    to_json_line,
)
from dlm.cli.dashboard import SPARK_CHARACTERS, Budget, TrainingDashboard, sparkline
from dlm.train.loop import train

# Lines in the format metrics.jsonl has always had: reading them into the types must keep working.
EXISTING_LINES = (
    '{"event": "validation", "step": 40, "loss": 3.5, "masked_accuracy": 0.25, "batches": 2}',
    '{"event": "checkpoint", "step": 40, "path": "runs/x/step-00000040.pt"}',
    '{"event": "paused", "step": 40, "checkpoint": "runs/x/step-00000040.pt", "resume_command": "dlm resume runs/x"}',
    '{"event": "train", "step": 40, "max_steps": 100, "loss": null, "masked_accuracy": 0.125, "learning_rate": 0.0003, '
    '"grad_norm": 0.5, "tokens_seen": 20480, "tokens_per_second": 12345.0, "mfu": null, "eta_seconds": 65.2, '
    '"loss_by_t": [1.0, 2.0, null, 4.0], "allocated_gib": 0.0, "reserved_gib": 0.0, "peak_allocated_gib": 0.0}',
)


@dataclass
class RealRun:
    run_dir: Path
    events: list[Event]


@pytest.fixture(scope="module")
def real_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> RealRun:
    """The events a tiny two-step run emitted, validated and saved at step 2."""

    run_dir = tmp_path_factory.mktemp("events") / "run"
    events: list[Event] = []
    overrides = (
        "training.max_steps=2",
        "training.warmup_steps=1",
        "training.log_interval=1",
        "training.eval_interval=2",
        "training.save_interval=2",
    )
    train(tiny_experiment(tiny_data_dir, run_dir, *overrides), sink=events.append)
    return RealRun(run_dir, events)


def one(events: list[Event], kind: type[Event]) -> Event:
    return next(event for event in events if isinstance(event, kind))


def test_a_real_run_emits_every_kind_in_order(real_run: RealRun) -> None:
    kinds = [type(event) for event in real_run.events]
    assert kinds == [StartEvent, TrainEvent, TrainEvent, ValidationEvent, CheckpointEvent, EndEvent]
    end = real_run.events[-1]
    assert isinstance(end, EndEvent) and end.status == "complete" and end.resume_command is None
    assert end.to_dict()["event"] == "complete" and "status" not in end.to_dict()


def test_metrics_jsonl_holds_the_same_events_and_reads_back_into_them(real_run: RealRun) -> None:
    path = real_run.run_dir / "metrics.jsonl"
    assert list(read_events(path)) == real_run.events
    # Each line is exactly what the JSON sink writes for the typed event: one format on disk.
    lines = path.read_text().splitlines()
    assert lines == [to_json_line(event.to_dict()) for event in real_run.events]
    assert json.loads(lines[0])["event"] == "start" and list(json.loads(lines[1]))[:3] == ["event", "step", "max_steps"]


def test_lines_of_the_existing_format_read_into_the_types_and_write_back_identically(tmp_path: Path) -> None:
    for line in EXISTING_LINES:
        event = event_from_dict(json.loads(line))
        assert json.loads(to_json_line(event.to_dict())) == json.loads(line)
        assert to_json_line(event.to_dict()) == to_json_line(json.loads(line))  # same key order too
    paused = event_from_dict(json.loads(EXISTING_LINES[2]))
    assert isinstance(paused, EndEvent) and paused.status == "paused"
    # A line cut by a crash and lines of other kinds are skipped; the rest still read.
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join([*EXISTING_LINES, '{"event": "demo_note", "message": "x"}', '{"event": "trai']) + "\n")
    assert [type(event) for event in read_events(path)] == [ValidationEvent, CheckpointEvent, EndEvent, TrainEvent]
    # A resumed run appends after a last line cut short (no newline): its events start a line of their own.
    cut = tmp_path / "cut.jsonl"
    cut.write_text(EXISTING_LINES[0] + "\n" + EXISTING_LINES[1][:20])
    sink = JsonLinesFileSink(cut)
    sink(json.loads(EXISTING_LINES[2]))
    sink.close()
    assert [type(event) for event in read_events(cut)] == [ValidationEvent, EndEvent]
    assert cut.read_text().splitlines()[1] == EXISTING_LINES[1][:20]  # the fragment kept, apart


def test_unknown_kinds_and_changed_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="not a training event"):
        event_from_dict({"event": "demo_note", "message": "x"})
    with pytest.raises(ValueError, match="validation"):
        event_from_dict({"event": "validation", "step": 1, "loss": 1.0})  # masked_accuracy and batches missing
    with pytest.raises(ValueError, match="checkpoint"):
        event_from_dict({"event": "checkpoint", "step": 1, "path": "x", "size": 3})


def test_sparkline_scales_between_lowest_and_highest() -> None:
    assert sparkline([1.0, 2.0, 3.0]) == "▁▅█"
    assert sparkline([float("nan")]) == ""
    assert len(sparkline(range(100), width=10)) == 10


def test_json_lines_turn_non_finite_numbers_into_null(real_run: RealRun) -> None:
    trained = dataclasses.replace(one(real_run.events, TrainEvent), loss=float("nan"), loss_by_t=[float("inf"), 1.0])
    stream = io.StringIO()
    JsonLinesSink(stream)(trained)
    line = json.loads(stream.getvalue())
    assert line["loss"] is None and line["loss_by_t"] == [None, 1.0]
    assert event_from_dict(line) == dataclasses.replace(trained, loss=None, loss_by_t=[None, 1.0])


def test_json_sinks_write_one_object_per_event(real_run: RealRun, tmp_path: Path) -> None:
    stream = io.StringIO()
    file_sink = JsonLinesFileSink(tmp_path / "metrics.jsonl")
    sink = fan_out([JsonLinesSink(stream), file_sink])
    for event in real_run.events:
        sink(event)
    file_sink.close()
    expected = (real_run.run_dir / "metrics.jsonl").read_text()
    assert stream.getvalue() == (tmp_path / "metrics.jsonl").read_text() == expected
    # The demo's own stage events are plain dicts on the same stream.
    JsonLinesSink(stream)({"event": "demo_note", "message": "hello"})
    assert json.loads(stream.getvalue().splitlines()[-1]) == {"event": "demo_note", "message": "hello"}


def render(events: list[Event], title: str = "dlm train", accuracy: str = "masked acc") -> str:
    output = io.StringIO()
    console = Console(file=output, force_terminal=True, width=160, color_system=None)
    with TrainingDashboard(console, title=title, accuracy=accuracy) as dashboard:
        for event in events:
            dashboard(event)
    return output.getvalue()


def test_dashboard_shows_progress_metrics_validation_and_checkpoint(real_run: RealRun) -> None:
    events = list(real_run.events)
    start = one(events, StartEvent)
    assert isinstance(start, StartEvent)
    # The figures to look for, put into the real events (so no field can be missing or extra).
    figures = {
        TrainEvent: {
            "loss": 4.25,
            "tokens_per_second": 12345.0,
            "mfu": None,
            "eta_seconds": 65.2,
            "loss_by_t": [1.0, 2.0, None, 4.0] + [5.0] * 6,
        },
        ValidationEvent: {"loss": 3.5, "masked_accuracy": 0.25},
        EndEvent: {"status": "paused"},
    }
    events = [dataclasses.replace(event, **figures.get(type(event), {})) for event in events]  # type: ignore[arg-type]
    text = render(events)
    expected = (
        "step 2/2",
        "4.2500",
        "12,345",
        "n/a",
        "validation @ 2: loss 3.5000",
        "step-00000002.pt",
        "paused",
        "0.2-0.3: -",
        "eta 0:01:05",
    )
    for shown in (start.run_dir, start.parameters_human, *expected):
        assert shown in text, shown


def test_the_dashboard_is_titled_by_its_workflow(real_run: RealRun) -> None:
    assert "dlm train" in render(list(real_run.events))
    distilling = render(list(real_run.events), title="dlm distill", accuracy="agreement")
    assert "dlm distill" in distilling and "dlm train" not in distilling
    # A distillation's training figure is the agreement with its teacher's target; validation's is accuracy.
    assert "agreement" in distilling and "masked acc" in distilling.split("agreement", 1)[1]


def test_dashboard_and_json_sink_show_the_memory_of_a_real_run(real_run: RealRun) -> None:
    events = list(real_run.events)
    last_train = max(index for index, event in enumerate(events) if isinstance(event, TrainEvent))
    # A CPU run reports zero accelerator memory; give its last train event the figures a GPU run would have.
    events[last_train] = dataclasses.replace(
        events[last_train],  # type: ignore[type-var]
        allocated_gib=1.25,
        reserved_gib=2.0,
        peak_allocated_gib=1.75,
    )
    stream = io.StringIO()
    text = render(events)
    for event in events:
        JsonLinesSink(stream)(event)
    assert "mem GiB (peak)" in text and "1.25 (1.75)" in text
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[last_train]["allocated_gib"] == 1.25 and lines[last_train]["peak_allocated_gib"] == 1.75
    # The run's own metrics.jsonl carries the same figures under the same names.
    metrics = list(read_events(real_run.run_dir / "metrics.jsonl"))
    assert [type(event) for event in metrics] == [type(event) for event in real_run.events]
    assert all(event.peak_allocated_gib == 0.0 for event in metrics if isinstance(event, TrainEvent))


# ------------------------------------------------------------------------------ truthful progress


class FakeClock:
    """Seconds that advance only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def frame(dashboard: TrainingDashboard, width: int = 80) -> str:
    output = io.StringIO()
    Console(file=output, force_terminal=True, width=width, color_system=None).print(dashboard.render())
    return output.getvalue()


def percentages(text: str) -> list[float]:
    return [float(found) for found in re.findall(r"(\d+\.\d)%", text)]


def test_sparkline_keeps_the_trend_visible_beside_a_spike() -> None:
    trend = [6.0 - 3.0 * index / 39 for index in range(40)]
    line = sparkline([*trend[:20], 40.0, *trend[20:]])
    assert line[20] == "█"  # the spike tops its column
    levels = [SPARK_CHARACTERS.index(character) for character in line[:20] + line[21:]]
    assert levels == sorted(levels, reverse=True) and len(set(levels)) >= 6  # the decline, not a flat floor
    assert levels[0] >= 6 and levels[-1] == 0


def test_percentage_never_goes_back_when_a_second_call_raises_max_steps(real_run: RealRun) -> None:
    # Two `train` calls: the second planned further (73.1% of the first plan would read 70.3% of the new one).
    start = one(real_run.events, StartEvent)
    trained = [event for event in real_run.events if isinstance(event, TrainEvent)]
    assert isinstance(start, StartEvent)
    second = [
        dataclasses.replace(start, start_step=2, max_steps=3),
        *(dataclasses.replace(event, step=2 + index, max_steps=3) for index, event in enumerate(trained[:1])),
    ]
    clock = FakeClock()
    dashboard = TrainingDashboard(Console(file=io.StringIO()), clock=clock)
    shown, clocks = [], []
    for event in [*real_run.events, *second]:
        clock.now += 7.0
        dashboard(event)
        shown += percentages(frame(dashboard))
        clocks += re.findall(r"% +(\d:\d\d:\d\d)", frame(dashboard))
    assert shown == sorted(shown) and shown[-1] == 100.0
    # The clock runs from the dashboard's opening across both calls: 7 s per event, never reset.
    assert clocks == [f"0:00:{7 * count:02d}" for count in range(1, len(real_run.events) + len(second) + 1)]


def test_a_budgeted_run_in_two_calls_shows_one_clock_no_pause_and_the_thread_plan(real_run: RealRun) -> None:
    call = [event for event in real_run.events if not isinstance(event, EndEvent)]
    paused = dataclasses.replace(real_run.events[-1], status="paused")
    clock = FakeClock()
    budget = Budget(seconds=600.0, spent_seconds=30.0, seconds_per_step=0.5)
    dashboard = TrainingDashboard(Console(file=io.StringIO()), budget=budget, clock=clock)
    frames = []
    for event in [*call, paused, *call, paused]:
        clock.now += 15.0
        dashboard(event)
        frames.append(frame(dashboard))
    shown = [percentages(text)[0] for text in frames]
    assert shown == sorted(shown) and shown[-1] == pytest.approx(100 * (30 + 15 * len(frames)) / 600, abs=0.05)
    assert all("paused" not in text for text in frames)  # a pause between calls is not the run's end
    assert "0:03:30 of 0:10:00" in frames[-1]  # the budget spent before plus 12 events x 15 s
    dashboard.finish("paused")
    assert "status paused" in frame(dashboard, width=200)
    start = one(real_run.events, StartEvent)
    assert isinstance(start, StartEvent) and start.cpu_threads is not None and "thread" in start.cpu_threads
    assert f"cpu threads: {start.cpu_threads}" in frames[-1]


def test_the_dashboard_says_when_the_machine_runs_slower_than_planned(real_run: RealRun) -> None:
    start = one(real_run.events, StartEvent)
    trained = one(real_run.events, TrainEvent)
    assert isinstance(start, StartEvent) and isinstance(trained, TrainEvent)
    dashboard = TrainingDashboard(Console(file=io.StringIO()), budget=Budget(600.0, 0.0, seconds_per_step=0.1))
    dashboard(start)
    dashboard(dataclasses.replace(trained, tokens_per_second=4.0 * start.tokens_per_step))
    assert "machine busier than planned: 4 steps/s against 10" in frame(dashboard)
    dashboard.replan(0.3)  # re-planned at the pace it keeps: 4 steps/s is more than planned now
    assert "busier" not in frame(dashboard)
    dashboard(dataclasses.replace(trained, tokens_per_second=8.0 * start.tokens_per_step))
    assert "busier" not in frame(dashboard)


def test_a_start_line_without_the_thread_plan_still_reads(real_run: RealRun) -> None:
    line = json.loads((real_run.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    del line["cpu_threads"]
    event = event_from_dict(line)
    assert isinstance(event, StartEvent) and event.cpu_threads is None


def test_bfloat16_on_a_cpu_that_emulates_it_is_said_at_the_start(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlm.runtime import device

    monkeypatch.setattr(device, "cpu_has_native_bfloat16", lambda: False)
    events: list[Event] = []
    overrides = (
        "training.max_steps=1",
        "training.warmup_steps=0",
        "training.precision=bfloat16",
        "training.device=cpu",
    )
    train(tiny_experiment(tiny_data_dir, tmp_path / "run", *overrides), sink=events.append)
    start = one(events, StartEvent)
    assert isinstance(start, StartEvent) and start.precision == "bfloat16"
    assert start.precision_note is not None and "--set training.precision=float32" in start.precision_note
    dashboard = TrainingDashboard(Console(file=io.StringIO()))
    dashboard(start)
    assert "AVX512-BF16" in frame(dashboard, width=200)
