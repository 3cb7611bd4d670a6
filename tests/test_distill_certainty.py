"""Certainty forcing (`dlm distill --method certainty`): the objective, a round that makes the student
sure where it is right, exact resume, the config's rules, and what the student records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import test_distill
import torch
from helpers import assert_same_weights, train_losses
from test_distill import _batches, _experiment, _step

from dlm.artifacts.events import Event
from dlm.artifacts.export import export_model
from dlm.diffusion.distillation import allowed_log_probs, certainty_forcing_loss
from dlm.distill.run import distill
from dlm.distill.step import DistillStep
from dlm.errors import UserError
from dlm.train.step import LogWindow

teacher = pytest.fixture(scope="module")(test_distill.teacher.__wrapped__)
CERTAINTY = {"method": "certainty", "rounds": 1, "steps_per_round": 8}


def test_the_loss_is_cross_entropy_plus_entropy_where_the_student_is_right() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.7, 0.2, 0.1], [0.5, 0.5, 0.0]], dtype=torch.float64)
    log_student = probs.clamp_min(1e-300).log()
    targets = torch.tensor([0, 1, 1])
    entropy = -sum(p * math.log(p) for p in (0.7, 0.2, 0.1))
    loss = certainty_forcing_loss(log_student, targets, weight=0.5)
    # Row 0 is right (argmax 0): cross-entropy and half its entropy; row 1 is wrong: the cross-entropy
    # alone; row 2 ties, argmax takes token 0, so target 1 is "wrong" there too.
    expected = [-math.log(0.7) + 0.5 * entropy, -math.log(0.2), -math.log(0.5)]
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(certainty_forcing_loss(log_student, targets, 0.0), -log_student[[0, 1, 2], targets])
    # Forbidden tokens (allowed_log_probs' finite floor) add nothing to the entropy: no 0 x -inf.
    floored = allowed_log_probs(torch.tensor([[2.0, 0.0, 5.0]]), torch.tensor([2]))
    assert torch.isfinite(certainty_forcing_loss(floored, torch.tensor([0]), 1.0)).all()


def _sureness(step: DistillStep, clean: torch.Tensor) -> tuple[float, float]:
    """The student's mean entropy where it is right, and its cross-entropy, on a fixed batch and mask."""

    with torch.no_grad():
        result = step.certainty_at(clean, torch.linspace(0.1, 1.0, clean.shape[0]), torch.Generator().manual_seed(3))
    right = result.log_student.argmax(dim=-1) == result.targets
    entropy = -(result.log_student.exp() * result.log_student).sum(dim=-1)
    cross_entropy = -result.log_student.gather(-1, result.targets[:, None]).squeeze(-1)
    return float(entropy[right].mean()), float(cross_entropy.mean())


def _sureness_after(teacher: Path, data: Path, run: Path, weight: float) -> tuple[float, float]:
    """`_sureness` on a fixed batch after 30 certainty-forcing steps with entropy weight `weight`."""

    experiment = _experiment(
        teacher,
        data,
        run,
        "training.learning_rate=1e-2",
        "training.warmup_steps=1",
        **(CERTAINTY | {"steps_per_round": 30, "certainty_weight": weight}),
    )
    step = _step(experiment)
    step.prepare()
    batches, window = _batches(data, 8), LogWindow(step.device)
    for _ in range(30):
        step.optimizer_step(batches, window)
    return _sureness(step, next(_batches(data, 16)))


def test_the_entropy_term_makes_the_student_sure_where_it_is_right(
    teacher: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    """Against plain fine-tuning on the same batches (weight 0), the entropy term lowers the student's
    entropy where it predicts the data's token, at little cost in cross-entropy."""

    plain_entropy, plain_cross_entropy = _sureness_after(teacher, tiny_data_dir, tmp_path / "plain", 0.0)
    entropy, cross_entropy = _sureness_after(teacher, tiny_data_dir, tmp_path / "forced", 4.0)
    assert entropy < 0.9 * plain_entropy, (plain_entropy, entropy)
    assert cross_entropy < 1.1 * plain_cross_entropy, (plain_cross_entropy, cross_entropy)


def test_certainty_forcing_resumes_bit_identically_and_records_its_method(
    teacher: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    settings = ("training.save_interval=2", "training.eval_interval=100")
    straight_events: list[Event] = []
    straight = distill(
        _experiment(teacher, tiny_data_dir, tmp_path / "straight", *settings, **CERTAINTY), sink=straight_events.append
    )
    split = _experiment(teacher, tiny_data_dir, tmp_path / "split", *settings, **CERTAINTY)
    first: list[Event] = []
    paused = distill(split, max_run_steps=6, sink=first.append)
    assert paused.status == "paused" and paused.step == 6
    second: list[Event] = []
    resumed = distill(split, resume=paused.checkpoint, sink=second.append)
    assert resumed.status == "complete" and resumed.step == straight.step == 8
    assert_same_weights(straight.checkpoint, resumed.checkpoint)
    assert train_losses(first) + train_losses(second) == train_losses(straight_events)
    phases = {event.phase for event in straight_events if getattr(event, "phase", None)}
    assert phases == {
        "certainty forcing for threshold decoding; loss is the cross-entropy to the data plus 1 x "
        "the entropy where the student is right"
    }

    model = export_model(tmp_path / "straight", tmp_path / "student", dtype="float32")
    record = json.loads((model / "config.json").read_text())["distillation"]
    # The student samples in its teacher's steps: certainty forcing is for --threshold, not fewer steps.
    assert record["method"] == "certainty" and record["steps"] == record["teacher_steps"] == 16
    assert record["certainty_weight"] == 1.0 and record["rounds_done"] == 1
    assert "trained by certainty forcing (entropy weight 1.0) for sampling with `--threshold`" in (
        (model / "README.md").read_text()
    )


def test_certainty_forcing_trains_one_round(teacher: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="certainty forcing trains one round, not 3"):
        _experiment(teacher, tiny_data_dir, tmp_path / "run", **(CERTAINTY | {"rounds": 3}))
    with pytest.raises(UserError, match="method: Input should be 'sdtt' or 'certainty'"):
        _experiment(teacher, tiny_data_dir, tmp_path / "run", method="sharpen")
    # Steps that would not halve are no objection: certainty forcing keeps the teacher's steps.
    assert _experiment(teacher, tiny_data_dir, tmp_path / "run", **(CERTAINTY | {"teacher_steps": 7})).distill
