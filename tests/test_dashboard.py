"""Event sinks: the rich dashboard renders what a person needs; JSON lines stay valid JSON."""

from __future__ import annotations

import io
import json
from pathlib import Path

from helpers import tiny_experiment
from rich.console import Console

from dlm.dashboard import JsonLinesFileSink, JsonLinesSink, TrainingDashboard, fan_out, sparkline, to_json_line
from dlm.train import train

START = {
    "event": "start", "run_dir": "runs/x", "device": "cpu", "precision": "float32", "parameters": 1234,
    "parameters_human": "1.2K", "tokens_per_step": 512, "start_step": 0, "max_steps": 100,
}
TRAIN = {
    "event": "train", "step": 40, "max_steps": 100, "loss": 4.25, "masked_accuracy": 0.125,
    "learning_rate": 3e-4, "grad_norm": 0.5, "tokens_per_second": 12345.0, "mfu": None,
    "eta_seconds": 65.2, "loss_by_t": [1.0, 2.0, None, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0],
}


def test_sparkline_scales_between_lowest_and_highest() -> None:
    assert sparkline([1.0, 2.0, 3.0]) == "▁▅█"
    assert sparkline([float("nan")]) == ""
    assert len(sparkline(range(100), width=10)) == 10


def test_json_lines_turn_non_finite_numbers_into_null() -> None:
    line = to_json_line({"event": "train", "loss": float("nan"), "nested": [float("inf"), 1.0]})
    assert json.loads(line) == {"event": "train", "loss": None, "nested": [None, 1.0]}


def test_json_sinks_write_one_object_per_event(tmp_path: Path) -> None:
    stream = io.StringIO()
    file_sink = JsonLinesFileSink(tmp_path / "metrics.jsonl")
    sink = fan_out([JsonLinesSink(stream), file_sink])
    sink(START)
    sink(TRAIN)
    file_sink.close()
    for text in (stream.getvalue(), (tmp_path / "metrics.jsonl").read_text()):
        events = [json.loads(line) for line in text.splitlines()]
        assert [event["event"] for event in events] == ["start", "train"]


def test_dashboard_shows_progress_metrics_validation_and_checkpoint() -> None:
    output = io.StringIO()
    console = Console(file=output, force_terminal=True, width=160, color_system=None)
    with TrainingDashboard(console) as dashboard:
        for event in (START, TRAIN, {"event": "validation", "step": 40, "loss": 3.5, "masked_accuracy": 0.25},
                      {"event": "checkpoint", "step": 40, "path": "runs/x/step-00000040.pt"},
                      {"event": "paused", "step": 40}):
            dashboard(event)
    text = output.getvalue()
    for expected in ("runs/x", "1.2K", "step 40/100", "4.2500", "12,345", "n/a", "validation @ 40: loss 3.5000",
                     "step-00000040.pt", "paused", "0.2-0.3: -", "eta 0:01:05"):
        assert expected in text, expected


def test_dashboard_and_json_sink_show_the_memory_of_a_real_run(tiny_data_dir: Path, tmp_path: Path) -> None:
    events: list[dict] = []
    overrides = ("training.max_steps=2", "training.warmup_steps=1", "training.log_interval=1",
                 "training.eval_interval=2", "training.save_interval=2")
    train(tiny_experiment(tiny_data_dir, tmp_path / "run", *overrides), sink=events.append)
    last_train = max(index for index, event in enumerate(events) if event["event"] == "train")
    # A CPU run reports zero accelerator memory; give its last train event the figures a GPU run
    # would have, under the names the run itself used (no key may be added).
    gpu_event = {**events[last_train], "allocated_gib": 1.25, "reserved_gib": 2.0, "peak_allocated_gib": 1.75}
    assert gpu_event.keys() == events[last_train].keys()
    events[last_train] = gpu_event

    output, stream = io.StringIO(), io.StringIO()
    json_sink = JsonLinesSink(stream)
    with TrainingDashboard(Console(file=output, force_terminal=True, width=160, color_system=None)) as dashboard:
        for event in events:
            dashboard(event)
            json_sink(event)
    assert "mem GiB (peak)" in output.getvalue() and "1.25 (1.75)" in output.getvalue()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["event"] for line in lines] == [event["event"] for event in events]
    assert lines[last_train]["allocated_gib"] == 1.25 and lines[last_train]["peak_allocated_gib"] == 1.75
    # The run's own metrics.jsonl carries the same figures under the same names.
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all({"allocated_gib", "peak_allocated_gib"} <= line.keys() for line in metrics if line["event"] == "train")
