"""The training memory estimate: exact parameter and optimizer-state counts from the config, the
free-memory figure, and `dlm train` refusing a model that cannot fit before writing anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm.config.optimizer_registry import OptimizerSpec, register_optimizer, unregister_optimizer
from dlm.config.schema import ExperimentConfig, ModelConfig
from dlm.config.shapes import count_parameters, parameter_shapes
from dlm.diffusion.objective import masked_token_losses
from dlm.model.denoiser import masked_logits
from dlm.model.transformer import DiffusionTransformer
from dlm.train import memory
from dlm.train.memory import (
    AvailableMemory,
    activation_bytes,
    available_ram,
    check_training_memory,
    estimate_training_memory,
    format_bytes,
    optimizer_state_bytes,
    parameter_entries,
    weight_copy_bytes,
)
from dlm.train.optimizer import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
CPU = torch.device("cpu")
# configs/tiny.toml widened and deepened to ~26T parameters: hundreds of TiB of model state.
HUGE = ("model.d_model=65536", "model.n_layers=512")

MODELS = [
    {},
    {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 2, "pad_vocab_multiple": 64},
    {"vocab_size": 1000, "d_model": 96, "n_layers": 3, "n_heads": 3, "ffn_hidden_size": 200},
    {"vocab_size": 300, "d_model": 32, "n_layers": 5, "n_heads": 4, "pad_vocab_multiple": 1, "max_seq_len": 16},
]


def experiment(model: dict | None = None, **training: object) -> ExperimentConfig:
    return ExperimentConfig.model_validate({"model": model or MODELS[1], "training": training})


def one_step(model: torch.nn.Module, config: ExperimentConfig) -> torch.optim.Optimizer:
    """An optimizer over `model` after one step, so that its lazily created state exists."""

    optimizer = build_optimizer(model, config.training, CPU)
    tokens = torch.randint(0, config.model.vocab_size, (2, config.model.max_seq_len))
    model(tokens).float().square().mean().backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("fields", MODELS)
def test_parameters_are_counted_from_the_config_exactly(fields: dict) -> None:
    config = ModelConfig.model_validate(fields)
    model = DiffusionTransformer(config)
    assert parameter_shapes(config) == [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert count_parameters(config) == model.num_parameters


def test_model_state_is_weights_gradients_optimizer_and_ema() -> None:
    config = experiment(ema_decay=0.999)
    parameters = count_parameters(config.model)
    estimate = estimate_training_memory(config, "float32")
    assert (estimate.weights, estimate.gradients, estimate.optimizer_state, estimate.ema) == (
        4 * parameters,
        4 * parameters,
        8 * parameters,
        4 * parameters,
    )
    assert estimate.model_state == 20 * parameters
    assert estimate.total == estimate.model_state + estimate.activations
    assert estimate_training_memory(experiment(), "float32").ema == 0
    # FSDP splits the model state over the processes; each keeps its own activations.
    sharded = estimate_training_memory(config, "float32", shards=4)
    assert sharded.model_state == 5 * parameters and sharded.activations == estimate.activations


def test_adamw_state_matches_torch() -> None:
    config = experiment()
    model = DiffusionTransformer(config.model)
    optimizer = one_step(model, config)
    moments = sum(state[key].nbytes for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq"))
    assert optimizer_state_bytes(config.model, config.training) == moments


@pytest.mark.parametrize("embedding_32bit", [True, False])
def test_adamw8bit_keeps_small_tensors_and_the_embedding_in_32_bit(embedding_32bit: bool) -> None:
    config = experiment(optimizer="adamw8bit", optimizer_min_8bit_size=1024, optimizer_embedding_32bit=embedding_32bit)
    expected = 0
    for name, parameter in DiffusionTransformer(config.model).named_parameters():
        full = parameter.numel() < 1024 or (embedding_32bit and name == "token_embedding.weight")
        expected += parameter.numel() * (8 if full else 2)
    assert optimizer_state_bytes(config.model, config.training) == expected


def test_an_optimizer_without_a_known_state_size_counts_none() -> None:
    spec = OptimizerSpec(
        name="toy-sgd",
        build=lambda model, groups, training, device: torch.optim.SGD(groups),
        description="plain SGD, for this test",
    )
    register_optimizer(spec)
    try:
        estimate = estimate_training_memory(experiment(optimizer="toy-sgd"), "float32")
    finally:
        unregister_optimizer(spec.name)
    # Counting no state errs towards running, never towards refusing a run that fits.
    assert estimate.optimizer_state == 0 and "toy-sgd state not estimated" in estimate.breakdown()


@pytest.mark.bitsandbytes
@pytest.mark.parametrize("tied", [True, False])
def test_adamw8bit_state_matches_bitsandbytes(tied: bool) -> None:
    config = experiment({**MODELS[1], "tie_embeddings": tied}, optimizer="adamw8bit", optimizer_min_8bit_size=1024)
    model = DiffusionTransformer(config.model)
    optimizer = one_step(model, config)
    moments = sum(state[key].nbytes for state in optimizer.state.values() for key in ("state1", "state2"))
    assert optimizer_state_bytes(config.model, config.training) == moments
    # The vocabulary matrices keep 32-bit state, an untied head as well as the embedding.
    vocabulary = [model.token_embedding.weight] + ([] if model.head is None else [model.head.weight])
    assert all(optimizer.state[weight]["state1"].dtype == torch.float32 for weight in vocabulary)
    assert optimizer.state[model.blocks[0].mlp.down.weight]["state1"].dtype == torch.uint8


def saved_activation_bytes(config: ExperimentConfig, precision: str) -> int:
    """Bytes of the tensors autograd keeps from a training forward pass and its loss."""

    torch.manual_seed(0)
    model = DiffusionTransformer(config.model).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, config.model.vocab_size, (config.training.batch_size, config.model.max_seq_len))
    mask = torch.rand(tokens.shape) < 0.5
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16")
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), autocast:
        masked_token_losses(masked_logits(model, tokens, mask, tokens), tokens[mask])  # a block model's 2L pass
    return sum(size for pointer, size in saved.items() if pointer not in weights)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_activation_estimate_is_close_to_what_autograd_keeps(precision: str) -> None:
    fields = {"vocab_size": 2048, "d_model": 128, "n_layers": 4, "n_heads": 2, "max_seq_len": 128}
    config = experiment(fields, batch_size=4)
    measured = saved_activation_bytes(config, precision)
    estimated = activation_bytes(config.model, config.training, precision)
    assert measured / 1.5 <= estimated <= measured * 1.5
    checkpointed = experiment({**fields, "activation_checkpointing": True}, batch_size=4)
    # Checkpointed, autograd keeps only block inputs; the estimate adds the block being recomputed.
    assert (
        saved_activation_bytes(checkpointed, precision)
        <= activation_bytes(checkpointed.model, checkpointed.training, precision)
        < estimated
    )


@pytest.mark.parametrize("tied", [True, False])
def test_weight_copies_are_the_bfloat16_casts_autograd_keeps(tied: bool) -> None:
    # An untied embedding is only indexed: autocast casts the head, never the embedding.
    config = experiment({**MODELS[1], "d_model": 48, "max_seq_len": 32, "tie_embeddings": tied}, batch_size=2)
    torch.manual_seed(0)
    model = DiffusionTransformer(config.model).train()
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    copies: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        # A matmul keeps its weight's copy as is or transposed.
        if tensor.dtype == torch.bfloat16 and any(
            tensor.shape == view.shape and torch.equal(tensor, view.detach().to(torch.bfloat16))
            for p in matrices
            for view in (p, p.T)
        ):
            copies[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    tokens = torch.randint(0, config.model.vocab_size, (2, 32))
    mask = torch.rand(tokens.shape) < 0.5
    hooks = torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        masked_token_losses(masked_logits(model, tokens, mask, tokens), tokens[mask])
    entries = parameter_entries(config.model, config.training)
    assert sum(copies.values()) == weight_copy_bytes(entries, config.model, "bfloat16") > 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_estimate_counts_the_2l_pass_of_block_models(checkpointing: bool) -> None:
    fields = {
        "vocab_size": 2048,
        "d_model": 128,
        "n_layers": 4,
        "n_heads": 2,
        "max_seq_len": 128,
        "activation_checkpointing": checkpointing,
    }
    whole, block = experiment(fields, batch_size=4), experiment({**fields, "block_size": 16}, batch_size=4)
    estimated = activation_bytes(block.model, block.training, "float32")
    measured = saved_activation_bytes(block, "float32")
    if checkpointing:  # the estimate adds the block being recomputed, which autograd does not keep
        assert measured <= estimated
    else:
        assert measured / 1.5 <= estimated <= measured * 1.5
    # The blocks' share doubles, the head's does not; the measurement agrees on the direction.
    head = 4 * 128 * (4 + 8) * 2048 // 2  # batch x length x (a + 8) x vocab / 2
    assert estimated - head == 2 * (activation_bytes(whole.model, whole.training, "float32") - head)
    # (1.3x with checkpointing, where each model also keeps its rotary tables for the recompute)
    assert measured > saved_activation_bytes(whole, "float32") * 1.25


def test_available_ram_reads_meminfo_and_a_cgroup_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    monkeypatch.setattr(memory, "_MEMINFO", meminfo)
    monkeypatch.setattr(memory, "_CGROUP", cgroup)
    assert available_ram() == AvailableMemory(8_000_000 * 1024, "of RAM available")  # no cgroup files
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert available_ram() == AvailableMemory(8_000_000 * 1024, "of RAM available")  # no limit
    (cgroup / "memory.max").write_text(f"{3 << 30}\n")
    (cgroup / "memory.current").write_text(f"{1 << 30}\n")
    assert available_ram() == AvailableMemory(2 << 30, "left under the cgroup memory limit")


def test_this_machine_reports_its_free_ram() -> None:
    found = memory.available_memory(CPU)
    assert found is not None and found.bytes > 0


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 20 << 20, 3 << 30, 5 << 50)] == [
        "0 B",
        "1023 B",
        "1.5 KiB",
        "20.0 MiB",
        "3.0 GiB",
        "5120.0 TiB",
    ]


def with_free_memory(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda device: AvailableMemory(free, "of RAM available"))


def test_only_the_model_state_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    config = experiment(batch_size=64)
    estimate = estimate_training_memory(config, "float32")
    with_free_memory(monkeypatch, estimate.total)
    fits = check_training_memory(config, CPU, "float32")
    assert fits.fits and fits.fix == "" and format_bytes(estimate.total) in fits.detail
    # Room for the model state but not the activations: allowed, with the fix for the activations.
    with_free_memory(monkeypatch, estimate.model_state)
    tight = check_training_memory(config, CPU, "float32")
    assert tight.fits and "the activations may not fit" in tight.detail
    assert "training.batch_size" in tight.fix and "model.activation_checkpointing = true" in tight.fix
    with_free_memory(monkeypatch, estimate.model_state - 1)
    refused = check_training_memory(config, CPU, "float32")
    assert not refused.fits
    assert f"at least {format_bytes(estimate.model_state)} for the model state" in refused.detail
    assert f"only {format_bytes(estimate.model_state - 1)} of RAM available" in refused.detail
    assert "smaller model (model.d_model, model.n_layers)" in refused.fix and '"adamw8bit"' in refused.fix


def test_unknown_free_memory_is_reported_not_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda device: None)
    verdict = check_training_memory(experiment(), CPU, "float32")
    assert verdict.fits and "unknown, not compared" in verdict.detail


def tiny_args(data: Path, run_dir: Path, *overrides: str) -> list[str]:
    settings = [
        f"training.tokenizer={data / 'tokenizer.json'}",
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}",
        f"training.output_dir={run_dir}",
        *overrides,
    ]
    return ["--config", str(TINY), *[arg for setting in settings for arg in ("--set", setting)]]


def test_train_refuses_a_model_too_large_before_writing(tiny_data_dir: Path, tmp_path: Path, run_cli) -> None:
    run_dir = tmp_path / "run"
    result = run_cli("train", *tiny_args(tiny_data_dir, run_dir, *HUGE), "--json")
    result.assert_refused(
        "error: memory: the run needs at least ",
        " TiB for the model state",
        "26.39T parameters",
        "of RAM available",
        "use a smaller model (model.d_model, model.n_layers)",
        "adamw8bit",
    )
    assert result.stdout == ""
    assert not run_dir.exists()  # no lock, no metrics.jsonl, no config.json: not even the directory
    run_dir.mkdir()
    run_cli("train", *tiny_args(tiny_data_dir, run_dir, *HUGE), "--json").assert_refused("error: memory:")
    assert list(run_dir.iterdir()) == []


def test_a_refused_resume_leaves_the_run_as_it_was(
    tiny_data_dir: Path, tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    steps = ("training.max_steps=4", "training.warmup_steps=1", "training.save_interval=2")
    assert run_cli("train", *tiny_args(tiny_data_dir, run_dir, *steps), "--max-run-steps", "2", "--json").exit_code == 0
    before = {path.name: path.read_bytes() for path in run_dir.iterdir()}
    with_free_memory(monkeypatch, 1 << 20)
    run_cli("resume", run_dir, "--json").assert_refused("error: memory:", "only 1.0 MiB of RAM available")
    assert {path.name: path.read_bytes() for path in run_dir.iterdir()} == before


def test_train_warns_when_the_activations_may_not_fit(
    tiny_data_dir: Path, tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch, narrow_console: int
) -> None:
    """A run that may not fit is not refused (the activation figure is approximate), but said so before it
    starts: on the CPU the system would otherwise end it without a word."""

    from dlm.config.schema import load_config

    steps = ("training.max_steps=1", "training.warmup_steps=0")
    arguments = tiny_args(tiny_data_dir, tmp_path / "run", *steps)
    overrides = [value for flag, value in zip(arguments[2::2], arguments[3::2], strict=True) if flag == "--set"]
    state = estimate_training_memory(load_config(TINY, overrides), "float32").model_state
    with_free_memory(monkeypatch, state)
    result = run_cli("train", *arguments, "--json")
    assert result.exit_code == 0, result.stderr
    warned = " ".join(result.stderr.split())
    assert "warning: memory: needs ~" in warned and "the activations may not fit" in warned
    assert "lower training.batch_size" in warned
    with_free_memory(monkeypatch, 1 << 50)
    result = run_cli("train", *tiny_args(tiny_data_dir, tmp_path / "roomy", *steps), "--json")
    assert result.exit_code == 0 and "warning: memory" not in result.stderr
