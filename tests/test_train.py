"""Training loop: loss goes down, resume is exact, stops are safe, checkpoints are ours."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_same_weights, tiny_experiment, train_losses

from dlm.artifacts.checkpoint import RunLock, load_checkpoint, numbered_checkpoints
from dlm.artifacts.checksum import with_checksum
from dlm.artifacts.events import Event, ValidationEvent
from dlm.errors import UserError
from dlm.train.loop import train
from dlm.train.trainer import NonFiniteLossError

ROOT = Path(__file__).resolve().parents[1]


def test_loss_decreases_and_run_dir_is_complete(tiny_data_dir: Path, tmp_path: Path) -> None:
    events: list[Event] = []
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run", "training.max_steps=60", "training.log_interval=10")
    result = train(experiment, sink=events.append)
    assert result.status == "complete" and result.step == 60 and result.exit_code == 0
    losses = train_losses(events)
    assert len(losses) == 6
    # Uniform guessing costs log V = 6.24 nats; the tiny model learns at least the unigram statistics.
    assert losses[-1] < losses[0] - 0.4 and losses[-1] < math.log(512) - 0.8, losses
    run = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl", "latest.pt", "inference-latest.pt", "step-00000060.pt"):
        assert (run / name).exists(), name
    assert sorted(p.name for p in run.glob("step-*.pt")) == ["step-00000040.pt", "step-00000060.pt"]
    assert os.path.samefile(run / "latest.pt", run / "step-00000060.pt")
    saved = json.loads((run / "config.json").read_text())
    assert saved["training"]["max_steps"] == 60 and Path(saved["training"]["output_dir"]).is_absolute()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [line["event"] for line in lines]
    assert kinds[0] == "start" and kinds[-1] == "complete" and "validation" in kinds
    train_event = next(line for line in lines if line["event"] == "train")
    assert len(train_event["loss_by_t"]) == 10 and train_event["tokens_per_second"] > 0
    inference = load_checkpoint(run / "inference-latest.pt")
    assert all(t.dtype == torch.bfloat16 for t in inference["model"].values() if t.is_floating_point())


@pytest.mark.parametrize("accumulation,workers", [(1, 0), (2, 1)])
def test_resume_is_bit_identical(tiny_data_dir: Path, tmp_path: Path, accumulation: int, workers: int) -> None:
    settings = (
        "training.max_steps=12",
        "training.log_interval=2",
        "training.save_interval=100",
        "training.warmup_steps=3",
        f"training.gradient_accumulation_steps={accumulation}",
        f"training.num_workers={workers}",
        "training.eval_interval=4",
    )
    straight_events: list[Event] = []
    straight = train(tiny_experiment(tiny_data_dir, tmp_path / "straight", *settings), sink=straight_events.append)

    first_events: list[Event] = []
    split = tiny_experiment(tiny_data_dir, tmp_path / "split", *settings)
    paused = train(split, max_run_steps=6, sink=first_events.append)
    assert paused.status == "paused" and paused.step == 6
    second_events: list[Event] = []
    resumed = train(split, resume=paused.checkpoint, sink=second_events.append)
    assert resumed.status == "complete" and resumed.step == 12

    assert_same_weights(straight.checkpoint, resumed.checkpoint)
    assert train_losses(first_events) + train_losses(second_events) == train_losses(straight_events)
    validations = [e.loss for e in straight_events if isinstance(e, ValidationEvent)]
    resumed_validations = [e.loss for e in first_events + second_events if isinstance(e, ValidationEvent)]
    assert validations == resumed_validations


def test_resume_refuses_a_changed_model_optimizer_or_tokenizer(
    tiny_data_dir: Path, tmp_path: Path, tiny_tokenizer_path: Path
) -> None:
    base = tiny_experiment(tiny_data_dir, tmp_path / "run", "training.max_steps=10")
    result = train(base, max_run_steps=2, sink=lambda event: None)
    changed_model = tiny_experiment(tiny_data_dir, tmp_path / "run", "training.max_steps=10", "model.n_layers=3")
    with pytest.raises(UserError, match="n_layers"):
        train(changed_model, resume=result.checkpoint)
    changed_optimizer = tiny_experiment(
        tiny_data_dir, tmp_path / "run", "training.max_steps=10", "training.optimizer=adamw8bit"
    )
    with pytest.raises(UserError, match=r"training\.optimizer"):
        train(changed_optimizer, resume=result.checkpoint)

    other_tokenizer = tmp_path / "tokenizer.json"
    other_tokenizer.write_text(tiny_tokenizer_path.read_text() + "\n")
    checkpoint = load_checkpoint(result.checkpoint)
    checkpoint["tokenizer_sha256"] = "0" * 64
    forged = tmp_path / "run" / "forged.pt"  # a checkpoint of this run (another's would be refused as such)
    torch.save(with_checksum(checkpoint), forged)  # a valid checksum: only the tokenizer differs
    with pytest.raises(UserError, match="different tokenizer"):
        train(base, resume=forged)


class Payload:
    """Any class: unpickling it would run code from the file, so it must be refused."""


def test_unsafe_checkpoint_is_refused(tiny_data_dir: Path, tmp_path: Path) -> None:
    evil = tmp_path / "evil.pt"
    torch.save({"format": "dlm-checkpoint-v1", "model": Payload()}, evil)
    with pytest.raises(UserError, match=r"evil\.pt"):
        train(tiny_experiment(tiny_data_dir, tmp_path / "run"), resume=evil)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dlm.train.step as train_module

    real = train_module.diffusion_cross_entropy
    calls = {"count": 0}

    def poisoned(*args, **kwargs):
        output = real(*args, **kwargs)
        calls["count"] += 1
        if calls["count"] > 7:  # step 8 onwards diverges
            output = dataclasses.replace(output, loss=output.loss * float("nan"))
        return output

    monkeypatch.setattr(train_module, "diffusion_cross_entropy", poisoned)
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run", "training.save_interval=5", "training.log_interval=4")
    with pytest.raises(NonFiniteLossError, match="step 8"):
        train(experiment, sink=lambda event: None)
    latest = load_checkpoint(tmp_path / "run" / "latest.pt")
    assert latest["step"] == 5
    assert all(torch.isfinite(t).all() for t in latest["model"].values())


def test_a_second_run_on_the_same_directory_is_refused(tiny_data_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with RunLock(run_dir), pytest.raises(UserError, match="another dlm run"):
        train(tiny_experiment(tiny_data_dir, run_dir), sink=lambda event: None)


@pytest.mark.bitsandbytes
def test_adamw8bit_and_ema_train_on_cpu(tiny_data_dir: Path, tmp_path: Path) -> None:
    experiment = tiny_experiment(
        tiny_data_dir,
        tmp_path / "run",
        "training.optimizer=adamw8bit",
        "training.optimizer_min_8bit_size=1024",
        "training.max_steps=8",
        "training.ema_decay=0.9",
    )
    events: list[Event] = []
    result = train(experiment, sink=events.append)
    assert result.status == "complete"
    checkpoint = load_checkpoint(result.checkpoint)
    assert checkpoint["ema"] is not None
    resumed = train(
        experiment.model_copy(update={"training": experiment.training.model_copy(update={"max_steps": 10})}),
        resume=result.checkpoint,
        sink=events.append,
    )
    assert resumed.step == 10


def test_validation_leaves_global_rng_untouched(tiny_data_dir: Path, tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from dlm.data.dataset import load_packed_dataset
    from dlm.evaluation.evaluate import fixed_noise_validation
    from dlm.model.transformer import DiffusionTransformer

    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run")
    model = DiffusionTransformer(experiment.model)
    dataset = load_packed_dataset(tiny_data_dir / "val.bin", experiment.model.max_seq_len)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    batches = list(DataLoader(dataset, batch_size=4))
    assert torch.equal(before, torch.get_rng_state()) is False  # a DataLoader draws from the global RNG...
    torch.set_rng_state(before)
    first = fixed_noise_validation(model, batches, torch.device("cpu"), "float32", 1e-3, 2)
    assert torch.equal(before, torch.get_rng_state())  # ...the validation itself does not
    again = fixed_noise_validation(model, batches, torch.device("cpu"), "float32", 1e-3, 2)
    assert first == again and first["batches"] == 2


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dlm", *args]


def test_sigint_saves_a_resumable_checkpoint(tiny_data_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        "--set",
        f"training.tokenizer={tiny_data_dir / 'tokenizer.json'}",
        "--set",
        f"training.train_data={tiny_data_dir / 'train.bin'}",
        "--set",
        f"training.val_data={tiny_data_dir / 'val.bin'}",
        "--set",
        f"training.output_dir={run_dir}",
        "--set",
        "training.max_steps=100000",
        "--set",
        "training.warmup_steps=1",
        "--set",
        "training.save_interval=100000",
        "--set",
        "training.log_interval=1",
    ]
    process = subprocess.Popen(
        _cli("train", "--config", str(ROOT / "configs" / "tiny.toml"), *overrides, "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    for line in process.stdout:  # wait until training is really under way
        if json.loads(line)["event"] == "train":
            break
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    events = [json.loads(line) for line in stdout.splitlines()]
    assert events[-1]["event"] == "interrupted"
    assert "dlm resume" in stderr and "Traceback" not in stderr
    step = load_checkpoint(run_dir / "latest.pt")["step"]
    assert step == events[-1]["step"] > 0

    resumed = subprocess.run(
        _cli("resume", str(run_dir), "--max-run-steps", "2", "--json"), capture_output=True, text=True, timeout=120
    )
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[-1])["step"] == step + 2


def test_kill_during_training_leaves_a_loadable_latest(tiny_data_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        _cli(
            "train",
            "--config",
            str(ROOT / "configs" / "tiny.toml"),
            "--set",
            f"training.tokenizer={tiny_data_dir / 'tokenizer.json'}",
            "--set",
            f"training.train_data={tiny_data_dir / 'train.bin'}",
            "--set",
            "training.val_data=none",
            "--set",
            f"training.output_dir={run_dir}",
            "--set",
            "training.max_steps=100000",
            "--set",
            "training.save_interval=1",
            "--json",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # A save writes step-N.pt, then relinks latest.pt; saves run one after another. So once any
    # file past step 3 exists, latest.pt is at step 3 or later (step-00000003.pt alone is not enough).
    deadline = time.monotonic() + 300
    while max((step for step, _ in numbered_checkpoints(run_dir)), default=0) <= 3:
        assert process.poll() is None, f"training exited with code {process.returncode}"
        assert time.monotonic() < deadline, "no checkpoint past step 3 within 300 s"
        time.sleep(0.05)
    process.kill()  # SIGKILL, most likely in the middle of a save (one per step)
    process.wait()
    assert load_checkpoint(run_dir / "latest.pt")["step"] >= 3
