"""TensorBoard and W&B loggers: the scalars they record equal metrics.jsonl's, the config is recorded,
a missing package is one `error:` line before anything is written, and no `[logging]` imports neither.

The tests that need the packages are marked `logger_extras` and skip cleanly without them.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import ROOT, tiny_experiment

from dlm.artifacts.events import Event, TrainEvent, ValidationEvent, read_events
from dlm.extras import Requirement
from dlm.train.loggers import Logger, bucket_names, event_scalars, register_logger
from dlm.train.loop import train

SHORT_RUN = ("training.max_steps=10", "training.log_interval=5", "training.eval_interval=5")


def train_event(**changes: Any) -> TrainEvent:
    fields: dict[str, Any] = dict(
        step=5,
        max_steps=10,
        loss=2.5,
        masked_accuracy=0.25,
        learning_rate=1e-3,
        grad_norm=0.75,
        tokens_seen=640,
        tokens_per_second=1e4,
        mfu=None,
        eta_seconds=1.0,
        loss_by_t=[1.0, None, *map(float, range(3, 11))],
    )
    return TrainEvent(**{**fields, **changes})


def test_event_scalars_names_every_figure_once_and_drops_missing_ones() -> None:
    scalars = event_scalars(train_event(grad_norm=float("nan")))
    assert scalars["train/loss"] == 2.5 and scalars["train/learning_rate"] == 1e-3
    assert scalars["train/tokens_per_second"] == 1e4 and scalars["train/tokens_seen"] == 640.0
    assert scalars["train/loss_by_t/0.0-0.1"] == 1.0 and scalars["train/loss_by_t/0.9-1.0"] == 10.0
    # None (unknown MFU, an empty bucket) and non-finite numbers are not charted; no memory off CUDA.
    assert "train/mfu" not in scalars and "train/loss_by_t/0.1-0.2" not in scalars
    assert "train/grad_norm" not in scalars and not any(tag.startswith("memory/") for tag in scalars)
    assert event_scalars(train_event(reserved_gib=2.0))["memory/reserved_gib"] == 2.0
    validation = ValidationEvent(step=5, loss=2.0, masked_accuracy=0.5, batches=2)
    assert event_scalars(validation) == {"val/loss": 2.0, "val/masked_accuracy": 0.5}
    assert bucket_names(4) == ["0.0-0.2", "0.2-0.5", "0.5-0.8", "0.8-1.0"]
    assert bucket_names(20)[:2] == ["0.00-0.05", "0.05-0.10"]


def test_a_logger_needs_a_switch_in_the_config() -> None:
    class Nowhere(Logger):
        name = "nowhere"
        requirement = Requirement("json", "none", "nothing")

    with pytest.raises(ValueError, match="LoggingConfig"):
        register_logger(Nowhere)


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_a_missing_package_is_one_error_before_anything_is_written(
    package: str, tiny_data_dir: Path, tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # `import package` now fails as if not installed
    run_dir = tmp_path / "run"
    settings = [*tiny_settings(tiny_data_dir, run_dir), f"logging.{package}=true"]
    result = run_cli("train", "--config", ROOT / "configs" / "tiny.toml", *[a for s in settings for a in ("--set", s)])
    result.assert_refused(f"[logging] {package} = true needs {package}", f"pip install 'dlm[{package}]'")
    assert not run_dir.exists()


def test_without_logging_neither_package_is_imported(tiny_data_dir: Path, tmp_path: Path) -> None:
    script = f"""
import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
from pathlib import Path
from helpers import tiny_experiment
from dlm.train.loop import train
experiment = tiny_experiment(Path({str(tiny_data_dir)!r}), Path({str(tmp_path / "run")!r}), *{SHORT_RUN!r})
train(experiment)
print(sorted(name for name in sys.modules if name.split(".")[0] in ("tensorboard", "wandb")
             or name.startswith("torch.utils.tensorboard")))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert sorted(path.name for path in (tmp_path / "run").iterdir() if path.is_dir()) == []


def tiny_settings(data: Path, run_dir: Path) -> list[str]:
    return [
        f"training.tokenizer={data / 'tokenizer.json'}",
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}",
        f"training.output_dir={run_dir}",
    ]


def expected_scalars(run_dir: Path) -> dict[int, dict[str, float]]:
    """Step -> tag -> value, from metrics.jsonl through the mapping every logger shares."""

    expected: dict[int, dict[str, float]] = {}
    events: list[Event] = list(read_events(run_dir / "metrics.jsonl"))
    for event in events:
        if isinstance(event, TrainEvent | ValidationEvent):
            expected.setdefault(event.step, {}).update(event_scalars(event))
    assert sorted(expected) == [5, 10]
    for step in expected:  # the names the docs promise, at every log step
        assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_second"} <= set(
            expected[step]
        )
        assert {"val/loss", "train/loss_by_t/0.9-1.0"} <= set(expected[step])
    return expected


@pytest.mark.logger_extras
@pytest.mark.parametrize("resumed", [False, True])
def test_tensorboard_scalars_equal_metrics_jsonl(tiny_data_dir: Path, tmp_path: Path, resumed: bool) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    experiment = tiny_experiment(
        tiny_data_dir, run_dir, *SHORT_RUN, "training.save_interval=5", "logging.tensorboard=true"
    )
    train(experiment)
    if resumed:  # step 10 again, from the step-5 checkpoint: TensorBoard must show the second step 10 only
        train(experiment, resume=run_dir / "step-00000005.pt")
    expected = expected_scalars(run_dir)  # the later of two lines for one step wins
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {tag for values in expected.values() for tag in values}
    for tag in tags:
        logged = [(scalar.step, scalar.value) for scalar in events.Scalars(tag)]
        # TensorBoard keeps float32: each value is metrics.jsonl's, rounded to float32 and nothing else.
        assert logged == [(step, float(np.float32(values[tag]))) for step, values in expected.items() if tag in values]
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config) == json.loads((run_dir / "config.json").read_text())


def wandb_records(path: Path) -> Iterator[bytes]:
    """The records of a `.wandb` file: a 7-byte header, then LevelDB-log records in 32 KiB blocks."""

    data, block, position, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or kind == 0:  # the rest of the block is padding
            position += left
            continue
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full, first / middle, last
        if kind in (1, 4):
            yield pending


def finished_records(path: Path, record_type: Any) -> list[Any]:
    """The records of a finished W&B run file. W&B's service process writes it after `finish()`
    returns, so the file is read until it ends with the run's exit record."""

    deadline = time.monotonic() + 60
    while True:
        records = []
        for data in wandb_records(path):
            records.append(record_type())
            records[-1].ParseFromString(data)
        if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


@pytest.mark.logger_extras
def test_wandb_offline_history_equals_metrics_jsonl(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[wandb]')")
    from wandb.proto import wandb_internal_pb2

    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing outside tmp_path
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline must be dlm's default, not the environment's
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "run"
    experiment = tiny_experiment(tiny_data_dir, run_dir, *SHORT_RUN, "logging.wandb=true", "logging.run_name=tiny")
    train(experiment)
    expected = expected_scalars(run_dir)
    [offline] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history: dict[int, dict[str, float]] = {}
    config: dict[str, Any] = {}
    for record in finished_records(offline, wandb_internal_pb2.Record):
        if record.WhichOneof("record_type") == "run":
            assert record.run.display_name == "tiny" and record.run.project == "dlm"
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(
                {tag: value for tag, value in items.items() if not tag.startswith("_")}
            )
    assert history == expected
    saved = json.loads((run_dir / "config.json").read_text())
    assert {section: config[section] for section in saved} == saved
