"""The optimizer registry: a toy optimizer added from outside the library trains and resumes exactly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tiny_experiment, train_losses
from torch import nn

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.events import Event, StartEvent
from dlm.artifacts.run_dir import check_resumable
from dlm.config.optimizer_registry import OptimizerSpec, register_optimizer, registered_optimizers, unregister_optimizer
from dlm.config.schema import ExperimentConfig, TrainingConfig, load_config
from dlm.errors import UserError
from dlm.train.distributed import check_parallelism
from dlm.train.loop import train
from dlm.train.optimizer import build_optimizer, check_state_layout

ROOT = Path(__file__).resolve().parents[1]
STEPS = (
    "training.max_steps=8",
    "training.warmup_steps=2",
    "training.log_interval=2",
    "training.save_interval=100",
    "training.eval_interval=100",
)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023): the sign of an interpolated momentum, decoupled weight decay."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                state = self.state[parameter]
                if not state:
                    state["exp_avg"] = torch.zeros_like(parameter)
                momentum, grad = state["exp_avg"], parameter.grad
                parameter.mul_(1 - group["lr"] * group["weight_decay"])
                update = momentum.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
                parameter.add_(update, alpha=-group["lr"])
                momentum.mul_(beta2).add_(grad, alpha=1 - beta2)


def build_lion(
    model: nn.Module, groups: list[dict[str, Any]], training: TrainingConfig, device: torch.device
) -> torch.optim.Optimizer:
    # Lion wants a smaller step than AdamW: its updates are +-1 per element.
    return Lion(groups, lr=training.learning_rate / 3, betas=(training.adam_beta1, training.adam_beta2))


def lion_spec(**changes: Any) -> OptimizerSpec:
    fields: dict[str, Any] = {
        "name": "toy-lion",
        "build": build_lion,
        "description": "Lion, written in a test",
        "resumable_hyperparameters": ("weight_decay", "betas"),
    }
    return OptimizerSpec(**{**fields, **changes})


@pytest.fixture
def toy_lion() -> Iterator[OptimizerSpec]:
    spec = register_optimizer(lion_spec())
    yield spec
    unregister_optimizer(spec.name)


def test_a_registered_toy_optimizer_trains_and_resumes_bit_identically(
    toy_lion: OptimizerSpec, tiny_data_dir: Path, tmp_path: Path
) -> None:
    straight_events: list[Event] = []
    straight_config = tiny_experiment(tiny_data_dir, tmp_path / "straight", "training.optimizer=toy-lion", *STEPS)
    straight = train(straight_config, sink=straight_events.append)
    assert next(e for e in straight_events if isinstance(e, StartEvent)).optimizer == "toy-lion"

    split = tiny_experiment(tiny_data_dir, tmp_path / "split", "training.optimizer=toy-lion", *STEPS)
    first_events: list[Event] = []
    paused = train(split, max_run_steps=4, sink=first_events.append)
    second_events: list[Event] = []
    resumed = train(split, resume=paused.checkpoint, sink=second_events.append)
    assert resumed.status == "complete" and resumed.step == 8

    expected, actual = load_checkpoint(straight.checkpoint), load_checkpoint(resumed.checkpoint)
    for name, tensor in expected["model"].items():
        assert torch.equal(tensor, actual["model"][name]), name
    assert train_losses(first_events) + train_losses(second_events) == train_losses(straight_events)
    losses = train_losses(straight_events)
    assert losses[-1] < losses[0], losses
    # The state really is Lion's: one momentum per parameter, no Adam moments, restored exactly.
    state = actual["optimizer"]["state"]
    assert all(set(entry) == {"exp_avg"} for entry in state.values())
    for index, entry in expected["optimizer"]["state"].items():
        assert torch.equal(entry["exp_avg"], state[index]["exp_avg"])


@pytest.mark.parametrize("optimizer", ["adamw", "toy-lion"])
def test_resume_takes_hyperparameters_from_the_current_config(
    optimizer: str, toy_lion: OptimizerSpec, tiny_data_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    paused = train(tiny_experiment(tiny_data_dir, run, f"training.optimizer={optimizer}", *STEPS), max_run_steps=1)
    changed = ("training.adam_beta2=0.9", "training.weight_decay=0.02")
    resumed = train(
        tiny_experiment(tiny_data_dir, run, f"training.optimizer={optimizer}", *STEPS, *changed),
        resume=paused.checkpoint,
        max_run_steps=1,
    )
    before = load_checkpoint(paused.checkpoint)["optimizer"]["param_groups"]
    after = load_checkpoint(resumed.checkpoint)["optimizer"]["param_groups"]
    assert [group["weight_decay"] for group in before] == [0.1, 0.0]
    assert [group["weight_decay"] for group in after] == [0.02, 0.0]
    assert all(tuple(group["betas"]) == (0.9, 0.9) for group in after)
    # The learning rate is the schedule's: half the peak in the first warmup step, the peak in the second.
    assert [group["lr"] for group in after] == [2 * before[0]["lr"]] * 2


def test_a_changed_parameter_group_layout_is_refused_on_resume(
    toy_lion: OptimizerSpec, tiny_data_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    experiment = tiny_experiment(tiny_data_dir, run, "training.optimizer=toy-lion", *STEPS)
    paused = train(experiment, max_run_steps=1)

    def one_group(model: nn.Module, groups: list[dict[str, Any]], training: TrainingConfig, device: torch.device):
        return Lion(model.parameters(), lr=training.learning_rate, betas=(0.9, 0.99))

    register_optimizer(lion_spec(build=one_group), replace=True)
    with pytest.raises(UserError, match=r"parameter groups of sizes \[\d+, \d+\].*now has \[\d+\]"):
        train(experiment, resume=paused.checkpoint)


def test_check_state_layout_compares_groups_by_position() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    # Groups: [linear weight], [linear bias, norm weight, norm bias].
    optimizer = build_optimizer(model, TrainingConfig(), torch.device("cpu"))
    check_state_layout(optimizer, optimizer.state_dict(), "latest.pt")
    swapped = {"state": {}, "param_groups": [{"params": [0, 1, 2]}, {"params": [3]}]}
    with pytest.raises(UserError, match=r"sizes \[3, 1\], the optimizer built now has \[1, 3\]"):
        check_state_layout(optimizer, swapped, "latest.pt")


def test_the_config_accepts_exactly_the_registered_names() -> None:
    assert registered_optimizers()[:2] == ("adamw", "adamw8bit")
    tiny = ROOT / "configs" / "tiny.toml"
    with pytest.raises(UserError, match=r"training\.optimizer: 'toy-lion' is not a registered.*adamw, adamw8bit"):
        load_config(tiny, ["training.optimizer=toy-lion"])
    register_optimizer(lion_spec())
    try:
        assert load_config(tiny, ["training.optimizer=toy-lion"]).training.optimizer == "toy-lion"
        with pytest.raises(ValueError, match="already registered"):
            register_optimizer(lion_spec())
    finally:
        unregister_optimizer("toy-lion")
    with pytest.raises(UserError, match="not a registered"):
        load_config(tiny, ["training.optimizer=toy-lion"])


def test_settings_that_shape_the_state_must_match_on_resume() -> None:
    saved = ExperimentConfig(training=TrainingConfig(optimizer="adamw8bit"))
    checkpoint = {"config": saved.to_dict(), "tokenizer_sha256": "0" * 64}
    changed = ExperimentConfig(training=TrainingConfig(optimizer="adamw8bit", optimizer_min_8bit_size=1))
    with pytest.raises(UserError, match=r"training\.optimizer_min_8bit_size is 1 but the checkpoint used 4096"):
        check_resumable(checkpoint, changed, "0" * 64, Path("latest.pt"))
    # adamw keeps no 8-bit state, so the same change does not matter to it.
    saved = ExperimentConfig(training=TrainingConfig(optimizer="adamw"))
    checkpoint = {"config": saved.to_dict(), "tokenizer_sha256": "0" * 64}
    changed = ExperimentConfig(training=TrainingConfig(optimizer="adamw", optimizer_min_8bit_size=1))
    check_resumable(checkpoint, changed, "0" * 64, Path("latest.pt"))


def test_fsdp_support_and_required_packages_come_from_the_spec() -> None:
    register_optimizer(lion_spec(fsdp_refusal="the toy keeps unsharded state", requires="dlm_toy_missing_module"))
    try:
        training = TrainingConfig(optimizer="toy-lion", parallelism="fsdp")
        with pytest.raises(UserError, match=r"'toy-lion' does not work with .*fsdp.*the toy keeps unsharded state"):
            check_parallelism(training)
        with pytest.raises(UserError, match=r"needs the dlm_toy_missing_module package.*pip install dlm_toy_missing"):
            build_optimizer(nn.Linear(2, 2), training, torch.device("cpu"))
    finally:
        unregister_optimizer("toy-lion")
