"""The memory estimate of a LoRA run: checked against a small model measured on the CPU, then applied to
an 8B model of LLaDA-8B's shape, built on the meta device only."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CliResult
from helpers import ROOT

from dlm.bench.measure import saved_for_backward
from dlm.config.schema import ExperimentConfig, load_config
from dlm.fileio import GIB
from dlm.train.distributed import DistributedContext
from dlm.train.memory import estimate_training_memory, plan_memory
from dlm.train.step import LogWindow, TrainingStep

pytestmark = pytest.mark.lora
pytest.importorskip("peft")

SMALL = (
    "model.d_model=256",
    "model.n_heads=4",
    "model.max_seq_len=128",
    "model.vocab_size=4096",
    "training.batch_size=4",
    "training.lora.rank=8",
    "training.init_from=base",
)


def small(*extra: str) -> ExperimentConfig:
    return load_config(ROOT / "configs" / "tiny.toml", [*SMALL, *extra])


def step_saved_for_backward(step: TrainingStep, clean: torch.Tensor) -> int:
    """Bytes a micro-batch's forward keeps for its backward (`dlm.bench.measure.saved_for_backward`)."""

    return saved_for_backward(step.model, lambda: step.micro_batch(clean, 0, 0.0, LogWindow(step.device)))


@pytest.mark.parametrize(
    ("precision", "extra"),
    [("float32", ()), ("bfloat16", ("training.lora.base_dtype=bfloat16",)), ("bfloat16", ())],
)
def test_the_estimate_matches_a_measured_lora_step(precision: str, extra: tuple[str, ...]) -> None:
    experiment = small(f"training.precision={precision}", *extra)
    estimate = estimate_training_memory(experiment, precision)
    step = TrainingStep(experiment, torch.device("cpu"), precision, DistributedContext())
    step.model.train()
    model_config = experiment.model
    clean = torch.randint(3, model_config.vocab_size, (experiment.training.batch_size, model_config.max_seq_len))
    # Exact: weights as stored (frozen base in its dtype), gradients and AdamW moments of the adapters alone.
    assert estimate.weights == sum(p.numel() * p.element_size() for p in step.model.parameters())
    step.optimizer_step(iter([clean]), LogWindow(step.device))
    grads = [p.grad for p in step.model.parameters() if p.grad is not None]
    assert estimate.gradients == sum(g.numel() * g.element_size() for g in grads)
    moments = [value for state in step.optimizer.state.values() for key, value in state.items() if key != "step"]
    assert estimate.optimizer_state == sum(m.numel() * m.element_size() for m in moments)
    assert estimate.trainable == sum(g.numel() for g in grads) < 0.1 * estimate.parameters
    # Approximate: what the backward keeps. The formula errs high (it counts the full training set of every
    # block, which the frozen matmuls partly spare); measured, it is within a third of what autograd keeps.
    kept, estimated = step_saved_for_backward(step, clean), estimate.activations + estimate.weight_copies
    assert 0.6 * estimated <= kept <= estimated


def llada_8b() -> ExperimentConfig:
    return load_config(ROOT / "configs" / "llada-8b-lora.toml")


def test_an_8b_lora_run_fits_one_24_gib_gpu_and_full_training_does_not() -> None:
    lora = plan_memory(llada_8b(), 24)
    estimate = lora.estimate
    assert lora.fits and lora.verdict is not None and lora.verdict.fits
    assert 8.0e9 < estimate.parameters < 8.1e9 and estimate.trainable is not None  # LLaDA-8B's head is untied
    assert estimate.trainable_share < 0.005  # rank 16 on every Linear layer: 35.7M adapters
    assert 15.5 * GIB < estimate.weights < 16.5 * GIB  # frozen Linear weights and head bfloat16, embedding float32
    assert estimate.weight_copies < 0.01 * GIB  # only the adapters are float32 matmul weights
    # 20.2 GiB; the GPU measured 20.55 GiB at 2 micro-batches a step, where the estimate says 19.7.
    assert 19.5 * GIB < estimate.total < 21 * GIB
    float32_base = plan_memory(
        llada_8b().model_copy(
            update={
                "training": llada_8b().training.model_copy(
                    update={"lora": llada_8b().training.lora.model_copy(update={"base_dtype": "float32"})}
                )
            }
        ),
        24,
    )
    assert float32_base.fits is False and float32_base.verdict is not None and not float32_base.verdict.fits
    assert "base_dtype" in float32_base.verdict.fix


def test_bench_estimate_reports_it_from_the_config_alone(
    run_cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    result = run_cli(
        "bench", "--config", ROOT / "configs" / "llada-8b-lora.toml", "--estimate", "--device-memory", "24", "--json"
    )
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["fits"] is True and plan["precision"] == "bfloat16"
    assert plan["estimate"]["trainable"] == 35_651_584
    monkeypatch.setattr("dlm.cli.bench_cmd.wants_json", lambda flag: flag)  # the table, as on a terminal
    table = run_cli("bench", "--config", ROOT / "configs" / "llada-8b-lora.toml", "--estimate", "--device-memory", "24")
    assert table.exit_code == 0, table.stderr
    assert "fits one 24 GiB GPU" in table.stdout and "35.7M trained" in table.stdout


def test_validate_reports_the_adapters_and_compares_with_a_planned_gpu(
    tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    sets = [
        f"training.tokenizer={tiny_data_dir / 'tokenizer.json'}",
        "training.lora.rank=4",
        f"training.train_data={tiny_data_dir / 'train.bin'}",
        f"training.output_dir={tmp_path / 'run'}",
        f"training.init_from={tmp_path}",
    ]
    args = [item for value in sets for item in ("--set", value)]
    result = run_cli(
        "validate", "--config", ROOT / "configs" / "tiny.toml", *args, "--device-memory", "0.0005", "--json"
    )
    checks = {check["name"]: check for check in json.loads(result.stdout)["checks"]}
    assert "8.7K of 148.3K parameters train (5.87%)" in checks["LoRA adapters"]["detail"]
    assert checks["memory"]["status"] == "failed" and "on a 0.0005 GiB device" in checks["memory"]["detail"]
    assert result.exit_code == 2 and "error: " in result.stderr
    bad = run_cli(
        "validate",
        "--config",
        ROOT / "configs" / "tiny.toml",
        *args,
        "--set",
        "training.lora.target_modules=qkv,wq",
        "--json",
    )
    checks = {check["name"]: check for check in json.loads(bad.stdout)["checks"]}
    adapters = checks["LoRA adapters"]
    assert adapters["status"] == "failed" and "'wq' is not a Linear layer" in adapters["detail"]


@pytest.mark.bitsandbytes
def test_adamw8bit_holds_the_adapters_alone_as_estimated() -> None:
    experiment = small("training.optimizer=adamw8bit", "training.optimizer_min_8bit_size=1024")
    step = TrainingStep(experiment, torch.device("cpu"), "float32", DistributedContext())
    model = experiment.model
    clean = torch.randint(3, model.vocab_size, (experiment.training.batch_size, model.max_seq_len))
    step.optimizer_step(iter([clean]), LogWindow(step.device))
    # The embedding's 32-bit override names a frozen parameter now: it must not bring it into the optimizer.
    optimized = {id(p) for group in step.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in step.model.parameters() if p.requires_grad}
    moments = sum(
        state[key].numel() * state[key].element_size()
        for state in step.optimizer.state.values()
        for key in ("state1", "state2")
    )
    assert moments == estimate_training_memory(experiment, "float32").optimizer_state


def test_estimate_refuses_the_options_of_a_timed_run(run_cli: Callable[..., CliResult]) -> None:
    config = ROOT / "configs" / "llada-8b-lora.toml"
    timed = run_cli("bench", "--config", config, "--estimate", "--steps", "3", "--batch-size", "2")
    timed.assert_refused("error: --steps, --batch-size do not apply to --estimate, which runs no step")
    alone = run_cli("bench", "--config", config, "--device-memory", "24")
    alone.assert_refused("error: --device-memory plans for another GPU: it goes with --estimate")
