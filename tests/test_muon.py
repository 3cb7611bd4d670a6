"""`training.optimizer = "muon"`: torch's Muon on the blocks' matrices and AdamW on the rest, as one optimizer."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from helpers import check_resume_is_exact, tiny_experiment

from dlm.artifacts.sharded_checkpoint import read_sharded_weights
from dlm.config.optimizer_registry import check_fsdp_support, optimizer_spec
from dlm.config.schema import ModelConfig, TrainingConfig
from dlm.errors import UserError
from dlm.model.transformer import DiffusionTransformer
from dlm.train.loop import train
from dlm.train.optimizer import build_optimizer, parameter_groups

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch 2.9")
MUON = ("training.optimizer=muon",)


def small_model(**fields: object) -> DiffusionTransformer:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=2, pad_vocab_multiple=64, **fields
    )  # type: ignore[arg-type]
    return DiffusionTransformer(config)


def names_of(model: torch.nn.Module, group: dict[str, object]) -> set[str]:
    ids = {id(p) for p in group["params"]}  # type: ignore[attr-defined]
    return {name for name, p in model.named_parameters() if id(p) in ids}


@pytest.mark.parametrize("tied", [True, False])
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest(tied: bool) -> None:
    model = small_model(tie_embeddings=tied)
    optimizer = build_optimizer(model, TrainingConfig(optimizer="muon"), torch.device("cpu"))
    muon, vocabulary, no_decay = (names_of(model, group) for group in optimizer.param_groups)
    assert muon == {
        f"blocks.{i}.{name}.weight"
        for i in range(2)
        for name in ("attention.qkv", "attention.out", "mlp.gate_up", "mlp.down")
    }
    assert vocabulary == ({"token_embedding.weight"} if tied else {"token_embedding.weight", "head.weight"})
    assert all(name.endswith("norm.weight") for name in no_decay) and len(no_decay) == 5
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.1, 0.0]


def test_it_steps_exactly_as_torchs_muon_and_adamw_each_over_its_part() -> None:
    training = TrainingConfig(optimizer="muon", learning_rate=3e-3)
    model, reference = small_model(), small_model()
    optimizer = build_optimizer(model, training, torch.device("cpu"))
    hidden = [p for name, p in reference.named_parameters() if name.startswith("blocks") and p.ndim == 2]
    alone_muon = torch.optim.Muon(hidden, lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    no_decay = parameter_groups(reference, training.weight_decay)[1]["params"]
    alone_adamw = torch.optim.AdamW(
        [
            {"params": [reference.token_embedding.weight], "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(training.adam_beta1, training.adam_beta2),
        eps=training.adam_eps,
    )
    tokens = torch.randint(2, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):  # momentum and moments carry over between steps
        for network in (model, reference):
            network.zero_grad(set_to_none=True)
            network(tokens).float().logsumexp(-1).mean().backward()
        optimizer.step(), alone_muon.step(), alone_adamw.step()
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(parameter, expected), name


def test_its_state_dict_reloads_into_a_new_optimizer_and_steps_on_identically() -> None:
    training = TrainingConfig(optimizer="muon")
    models = [small_model(), small_model()]
    first = build_optimizer(models[0], training, torch.device("cpu"))
    tokens = torch.randint(2, 64, (2, 16), generator=torch.Generator().manual_seed(2))

    def step(model: DiffusionTransformer, optimizer: torch.optim.Optimizer) -> None:
        model.zero_grad(set_to_none=True)
        model(tokens).float().logsumexp(-1).mean().backward()
        optimizer.step()

    step(models[0], first)
    models[1].load_state_dict(models[0].state_dict())
    second = build_optimizer(models[1], training, torch.device("cpu"))
    second.load_state_dict(copy.deepcopy(first.state_dict()))  # as from a file: no tensor shared
    state = first.state_dict()
    assert sorted(state["state"][0]) == ["momentum_buffer"] and "exp_avg" in state["state"][len(state["state"]) - 1]
    second.param_groups[0]["lr"] = first.param_groups[0]["lr"] = 5e-4  # the schedule reaches the inner optimizers
    step(models[0], first), step(models[1], second)
    for left, right in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(left, right)


RUN = ("training.max_steps=8", "training.log_interval=2", "training.warmup_steps=2", "training.eval_interval=4")


def test_a_resumed_muon_run_is_bit_identical(tiny_data_dir: Path, tmp_path: Path) -> None:
    settings = (*MUON, *RUN, "training.save_interval=100")
    losses = check_resume_is_exact(tiny_data_dir, tmp_path, settings, pause_at=4)
    assert len(losses) == 4 and all(loss is not None and loss < 7 for loss in losses)


def test_a_muon_run_resumes_exactly_from_sharded_checkpoints(tiny_data_dir: Path, tmp_path: Path) -> None:
    settings = (*MUON, *RUN, "training.save_interval=4", "training.checkpoint_format=dcp")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_experiment(tiny_data_dir, straight, *settings))
    shutil.copytree(straight, resumed, symlinks=True)
    result = train(tiny_experiment(tiny_data_dir, resumed, *settings), resume=resumed / "step-00000004")
    assert result.status == "complete" and result.checkpoint == resumed / "step-00000008"
    _, expected, _ = read_sharded_weights(straight / "latest", use_ema=False)
    _, weights, _ = read_sharded_weights(resumed / "latest", use_ema=False)
    assert expected.keys() == weights.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)


def test_fsdp_and_a_torch_without_muon_are_refused(
    monkeypatch: pytest.MonkeyPatch, tiny_data_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match="FSDP shards"):
        check_fsdp_support("muon")
    monkeypatch.delattr(torch.optim, "Muon")
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run", *MUON)
    with pytest.raises(UserError, match=r"needs torch.optim.Muon, in torch 2.9 or later") as error:
        build_optimizer(small_model(), experiment.training, torch.device("cpu"))
    assert 'training.optimizer = "adamw"' in str(error.value.fix)


def test_the_memory_estimate_counts_one_momentum_per_muon_matrix_entry() -> None:
    model = small_model()
    entries = [(name, p.numel()) for name, p in model.named_parameters()]
    hidden = sum(size for name, size in entries if name.startswith("blocks") and "norm" not in name)
    total = sum(size for _, size in entries)
    spec = optimizer_spec("muon")
    assert spec.state_bytes is not None
    assert spec.state_bytes(entries, TrainingConfig(optimizer="muon")) == 4 * hidden + 8 * (total - hidden)
