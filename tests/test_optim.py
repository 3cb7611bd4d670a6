"""Optimizer groups (adamw / adamw8bit), the learning-rate schedule and the weight EMA."""

from __future__ import annotations

import io
import itertools
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_experiment
from torch import nn

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.config.schema import TrainingConfig
from dlm.errors import UserError
from dlm.train.optimizer import ModelEMA, build_optimizer, learning_rate, parameter_groups

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class TinyModel(nn.Module):
    """Stand-in for DiffusionTransformer: a tied embedding / head, a Linear and a LayerNorm."""

    def __init__(self, vocab: int = 128, width: int = 64) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(torch.relu(self.proj(self.token_embedding(tokens))))
        return hidden @ self.token_embedding.weight.T


def _loss(model: TinyModel, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (4, 16), generator=generator)
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))


def _train(model: TinyModel, optimizer: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        optimizer.zero_grad(set_to_none=True)
        _loss(model, seed).backward()
        optimizer.step()


def _config(**overrides: object) -> TrainingConfig:
    base: dict[str, object] = {"learning_rate": 1e-2, "min_learning_rate": 1e-3, "warmup_steps": 2}
    return TrainingConfig(**{**base, **overrides})


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_parameter_groups_decay_only_matrices() -> None:
    model = TinyModel()
    model.norm.bias.requires_grad_(False)
    groups = parameter_groups(model, 0.1)
    decay_ids = {id(p) for p in groups[0]["params"]}
    no_decay_ids = {id(p) for p in groups[1]["params"]}
    assert decay_ids == {id(model.token_embedding.weight), id(model.proj.weight)}
    assert no_decay_ids == {id(model.proj.bias), id(model.norm.weight)}  # frozen bias left out
    assert (groups[0]["weight_decay"], groups[1]["weight_decay"]) == (0.1, 0.0)


def test_adamw_uses_config_hyperparameters() -> None:
    config = _config(adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6, weight_decay=0.05)
    optimizer = build_optimizer(TinyModel(), config, CPU)
    assert isinstance(optimizer, torch.optim.AdamW)
    first, second = optimizer.param_groups
    assert first["betas"] == (0.8, 0.99) and first["eps"] == 1e-6 and first["lr"] == 1e-2
    assert (first["weight_decay"], second["weight_decay"]) == (0.05, 0.0)
    assert not first.get("fused")


def _state_dtypes(model: TinyModel, optimizer: torch.optim.Optimizer) -> tuple[torch.dtype, ...]:
    state = optimizer.state
    return (state[model.token_embedding.weight]["state1"].dtype, state[model.proj.weight]["state1"].dtype)


@pytest.mark.bitsandbytes
def test_adamw8bit_embedding_override_and_min_size() -> None:
    torch.manual_seed(0)
    model = TinyModel()
    # Embedding (8192 elements) and projection (4096) are both large enough for 8-bit state.
    optimizer = build_optimizer(model, _config(optimizer="adamw8bit"), CPU)
    _train(model, optimizer, range(2))
    assert _state_dtypes(model, optimizer) == (torch.float32, torch.uint8)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    # A second optimizer in the same process must not inherit the first one's override.
    model = TinyModel()
    optimizer = build_optimizer(model, _config(optimizer="adamw8bit", optimizer_embedding_32bit=False), CPU)
    _train(model, optimizer, range(1))
    assert _state_dtypes(model, optimizer) == (torch.uint8, torch.uint8)

    model = TinyModel()
    optimizer = build_optimizer(model, _config(optimizer="adamw8bit", optimizer_min_8bit_size=10_000), CPU)
    _train(model, optimizer, range(1))
    assert _state_dtypes(model, optimizer) == (torch.float32, torch.float32)


@pytest.mark.bitsandbytes
def test_adamw8bit_resumes_bit_identically_from_weights_only_state() -> None:
    config = _config(optimizer="adamw8bit")
    torch.manual_seed(1)
    model = TinyModel()
    optimizer = build_optimizer(model, config, CPU)
    _train(model, optimizer, range(3))
    saved = _state(model, optimizer)
    _train(model, optimizer, range(3, 6))

    resumed = TinyModel()
    resumed_optimizer = build_optimizer(resumed, config, CPU)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    _train(resumed, resumed_optimizer, range(3, 6))
    for (name, expected), actual in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), name
    assert _state_dtypes(resumed, resumed_optimizer) == (torch.float32, torch.uint8)


def test_adamw_resumes_bit_identically() -> None:
    config = _config()
    torch.manual_seed(2)
    model = TinyModel()
    optimizer = build_optimizer(model, config, CPU)
    _train(model, optimizer, range(2))
    saved = _state(model, optimizer)
    _train(model, optimizer, range(2, 4))
    resumed = TinyModel()
    resumed_optimizer = build_optimizer(resumed, config, CPU)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    _train(resumed, resumed_optimizer, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True))


def test_adamw8bit_without_bitsandbytes_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(UserError, match="gpu"):
        build_optimizer(TinyModel(), _config(optimizer="adamw8bit"), CPU)


def test_learning_rate_warmup_peak_and_floor() -> None:
    config = _config(learning_rate=1.0, min_learning_rate=0.1, warmup_steps=4, max_steps=21)
    assert [learning_rate(s, config) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert learning_rate(4, config) == 1.0  # first cosine step is the peak
    # Cosine progress 0.5 (step 4 + 16 / 2): halfway between peak and floor.
    assert learning_rate(12, config) == pytest.approx(0.55)
    assert learning_rate(20, config) == pytest.approx(0.1, abs=1e-12)  # last step: the floor
    assert learning_rate(100, config) == pytest.approx(0.1, abs=1e-12)  # past the end: floor
    decay = [learning_rate(s, config) for s in range(4, 21)]
    assert all(a > b for a, b in itertools.pairwise(decay))


def test_learning_rate_without_warmup() -> None:
    config = _config(learning_rate=1.0, min_learning_rate=0.0, warmup_steps=0, max_steps=3)
    assert [learning_rate(s, config) for s in range(3)] == pytest.approx([1.0, 0.5, 0.0])


def test_ema_update_state_dict_and_swap() -> None:
    torch.manual_seed(3)
    model = TinyModel()
    ema = ModelEMA(model, decay=0.9)
    start = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    for shadow, old, live in zip(ema.shadow, start, model.parameters(), strict=True):
        assert torch.allclose(shadow, 0.1 * old + 0.9 * live, atol=1e-6)  # the first decay: min(0.9, 1 / 10)

    buffer = io.BytesIO()
    torch.save(ema.state_dict(), buffer)
    buffer.seek(0)
    restored = ModelEMA(TinyModel(), decay=0.9)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.num_updates == 1
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, restored.shadow, strict=True))

    live = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="inside"), ema.applied(model):
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), ema.shadow, strict=True))
        raise RuntimeError("inside")  # live weights must come back even after an error
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), live, strict=True))
    ema.copy_to(model)
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), ema.shadow, strict=True))


@pytest.mark.parametrize("decay", [0.999, 0.2])
def test_ema_warms_up_its_decay(decay: float) -> None:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(-2.0)
    ema = ModelEMA(model, decay=decay)
    expected = {"weight": 1.0, "bias": -2.0}
    for n, live in enumerate([4.0, -8.0, 16.0, 0.5, 3.0]):
        with torch.no_grad():
            model.weight.fill_(live)
            model.bias.fill_(live / 2)
        ema.update(model)
        # By hand: after n earlier updates the decay is min(decay, (1 + n) / (10 + n)), so 0.1,
        # 2/11, 3/12 ... at 0.999, and 0.1, 2/11, then 0.2 from the third update on at 0.2.
        d = min(decay, (1 + n) / (10 + n))
        targets = {"weight": live, "bias": live / 2}
        expected = {name: d * expected[name] + (1 - d) * targets[name] for name in expected}
        shadow = ema.state_dict()["shadow"]
        for name, value in expected.items():
            assert torch.allclose(shadow[name], torch.full_like(shadow[name], value), rtol=1e-6, atol=1e-6), (n, name)
    assert ema.num_updates == 5 and ema.current_decay() == min(decay, 6 / 15)


def test_ema_state_without_an_update_count_loads_past_the_warmup() -> None:
    model = TinyModel()
    state = ModelEMA(model, decay=0.99).state_dict()
    del state["num_updates"]  # as saved before the count existed
    restored = ModelEMA(TinyModel(), decay=0.99)
    restored.load_state_dict(state)
    assert restored.current_decay() == 0.99 and restored.num_updates == 890
    assert (1 + 889) / (10 + 889) < 0.99  # one update fewer would still be in the warmup


def test_resume_keeps_the_ema_warmup_exact(tiny_data_dir: Path, tmp_path: Path) -> None:
    from dlm.train.loop import train

    # 8 updates at decay 0.999 stay inside the warmup (the 8th uses 8 / 17): a resume that lost
    # the update count would restart the warmup and average differently.
    settings = (
        "training.max_steps=8",
        "training.warmup_steps=1",
        "training.ema_decay=0.999",
        "training.save_interval=100",
        "training.eval_interval=100",
    )
    straight = train(tiny_experiment(tiny_data_dir, tmp_path / "straight", *settings), sink=lambda event: None)
    split = tiny_experiment(tiny_data_dir, tmp_path / "split", *settings)
    paused = train(split, max_run_steps=5, sink=lambda event: None)
    assert load_checkpoint(paused.checkpoint)["ema"]["num_updates"] == 5
    resumed = train(split, resume=paused.checkpoint, sink=lambda event: None)
    want, got = load_checkpoint(straight.checkpoint)["ema"], load_checkpoint(resumed.checkpoint)["ema"]
    assert want["num_updates"] == got["num_updates"] == 8
    assert want["shadow"].keys() == got["shadow"].keys()
    assert all(torch.equal(want["shadow"][name], got["shadow"][name]) for name in want["shadow"])


def test_ema_is_fp32_for_bf16_models_and_names_ignore_wrappers() -> None:
    model = TinyModel().to(torch.bfloat16)
    ema = ModelEMA(model, decay=0.5)
    assert all(s.dtype == torch.float32 for s in ema.shadow)
    ema.update(model)
    wrapped = nn.Module()
    wrapped.module = TinyModel()  # the DDP naming: module.<name>
    names = ModelEMA(wrapped, decay=0.5).state_dict()["shadow"].keys()
    assert list(names) == list(ema.state_dict()["shadow"].keys())
    with pytest.raises(UserError, match="do not match"):
        ModelEMA(nn.Linear(2, 2), decay=0.5).load_state_dict(ema.state_dict())


@pytest.mark.gpu
@needs_cuda
def test_fused_adamw_and_adamw8bit_on_cuda() -> None:
    cuda = torch.device("cuda")
    model = TinyModel().to(cuda)
    optimizer = build_optimizer(model, _config(), cuda)
    assert optimizer.param_groups[0]["fused"]
    tokens = torch.randint(0, 128, (4, 16), device=cuda)
    model(tokens).float().square().mean().backward()
    optimizer.step()
    pytest.importorskip("bitsandbytes")
    model = TinyModel().to(cuda)
    optimizer = build_optimizer(model, _config(optimizer="adamw8bit"), cuda)
    for _ in range(2):
        optimizer.zero_grad()
        model(tokens).float().square().mean().backward()
        optimizer.step()
    assert _state_dtypes(model, optimizer) == (torch.float32, torch.uint8)
    ema = ModelEMA(model, decay=0.99)
    ema.update(model)
    assert ema.shadow[0].device.type == "cuda"
