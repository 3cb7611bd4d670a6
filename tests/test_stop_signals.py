"""Signals: the first asks for a safe stop, a second stops at once but never inside a checkpoint
write; the exit code is 130 after SIGINT and 143 after SIGTERM, with no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.fileio import temporaries
from dlm.train.stop import SignalStop, StopSignals

ROOT = Path(__file__).resolve().parents[1]


def _deliver(number: int) -> None:
    os.kill(os.getpid(), number)
    time.sleep(0.01)  # the handler runs in the main thread at the next bytecode boundary


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_waits_for_the_write_then_stops_with_the_first_ones_code(number: int) -> None:
    before = signal.getsignal(number)
    with StopSignals() as stop:
        _deliver(number)
        assert stop.signal_number == number and stop.exit_code == 128 + number
        with stop.writing():
            _deliver(number)  # held back: the write goes on
            written = True
        assert written
        with pytest.raises(SignalStop) as info:
            _deliver(number)
    assert info.value.exit_code == 128 + number
    assert signal.getsignal(number) is before  # the handlers are put back


def test_the_first_signal_decides_the_exit_code() -> None:
    with StopSignals() as stop, pytest.raises(SignalStop) as info:
        _deliver(signal.SIGTERM)
        _deliver(signal.SIGINT)
    assert stop.signal_number == signal.SIGTERM and info.value.exit_code == 143


def tiny_train_command(data_dir: Path, run_dir: Path, *settings: str) -> list[str]:
    args = ["train", "--config", str(ROOT / "configs" / "tiny.toml"), "--json"]
    for item in (
        f"training.tokenizer={data_dir / 'tokenizer.json'}",
        f"training.train_data={data_dir / 'train.bin'}",
        "training.val_data=none",
        f"training.output_dir={run_dir}",
        "training.max_steps=100000",
        "training.warmup_steps=1",
        "training.log_interval=1",
        *settings,
    ):
        args += ["--set", item]
    return args


# Runs the CLI with torch.save patched to receive two signals just as a checkpoint write begins.
SIGNALS_DURING_SAVE = """
import os, sys, torch
number = int(sys.argv[1])
real_save = torch.save
def save(obj, handle):
    if "optimizer" in obj:  # the training checkpoint, inside dlm's write
        os.kill(os.getpid(), number)
        os.kill(os.getpid(), number)
    real_save(obj, handle)
torch.save = save
from dlm.cli import main
main(sys.argv[2:])
"""


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_two_signals_during_a_checkpoint_write_leave_it_whole(tiny_data_dir: Path, tmp_path: Path, number: int) -> None:
    run_dir = tmp_path / "run"
    command = tiny_train_command(tiny_data_dir, run_dir, "training.save_interval=2")
    result = subprocess.run(
        [sys.executable, "-c", SIGNALS_DURING_SAVE, str(int(number)), *command],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert result.returncode == 128 + number, result.stderr
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"continue with: dlm resume {run_dir}"]
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "event": "interrupted",
        "step": 2,
        "checkpoint": str(run_dir / "step-00000002.pt"),
        "resume_command": f"dlm resume {run_dir}",
    }
    assert load_checkpoint(run_dir / "latest.pt")["step"] == 2
    assert not temporaries(run_dir)


# Runs the CLI with two signals as the trainer is built: before the run has saved anything.
SIGNALS_BEFORE_ANY_SAVE = """
import os, sys
from dlm.train import trainer
real_init = trainer.Trainer.__init__
def init(self, *args, **kwargs):
    os.kill(os.getpid(), int(sys.argv[1]))
    os.kill(os.getpid(), int(sys.argv[1]))
    real_init(self, *args, **kwargs)
trainer.Trainer.__init__ = init
from dlm.cli import main
main(sys.argv[2:])
"""


def test_two_signals_before_the_first_save_do_not_point_to_a_resume(tiny_data_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = tiny_train_command(tiny_data_dir, run_dir)
    number = int(signal.SIGINT)
    result = subprocess.run(
        [sys.executable, "-c", SIGNALS_BEFORE_ANY_SAVE, str(number), *command],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert result.returncode == 128 + number, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no checkpoint was saved yet: start the run again" in lines[0], result.stderr
    assert "dlm resume" not in result.stderr


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM])
def test_two_signals_20_ms_apart_exit_with_the_signals_code(tiny_data_dir: Path, tmp_path: Path, number: int) -> None:
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "dlm", *tiny_train_command(tiny_data_dir, run_dir, "training.save_interval=1")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert process.stdout is not None
    for line in process.stdout:  # under way, saving after every step
        if json.loads(line)["event"] == "train":
            break
    process.send_signal(number)
    time.sleep(0.02)
    process.send_signal(number)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + number, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr and "Aborted" not in stderr
    # Stopped safely (the second signal came during the final save) or at once: either way said so.
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and f"dlm resume {run_dir}" in lines[0], stderr
    assert load_checkpoint(run_dir / "latest.pt")["step"] >= 1
    assert not temporaries(run_dir)
