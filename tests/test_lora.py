"""LoRA (`[training.lora]`, the `lora` extra): training only the adapters on a frozen base, exact resume,
checkpoints that hold the adapters alone, merged and adapters-only exports."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CliResult
from helpers import check_resume_is_exact, tiny_experiment, train_tiny_run

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.events import Event, StartEvent
from dlm.artifacts.loading import load_model, read_model_source
from dlm.config.schema import load_config
from dlm.errors import UserError
from dlm.model.transformer import DiffusionTransformer
from dlm.train.loop import train

pytestmark = pytest.mark.lora
peft = pytest.importorskip("peft")

LORA = (
    "training.lora.rank=4",
    "training.lora.alpha=8",
    "training.max_steps=6",
    "training.warmup_steps=1",
    "training.save_interval=3",
    "training.eval_interval=100",
    "training.log_interval=1",
)


@pytest.fixture(scope="module")
def base_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_data_dir, tmp_path_factory.mktemp("base") / "run")


def lora_settings(base: Path, *extra: str) -> tuple[str, ...]:
    return (*LORA, f"training.init_from={base / 'latest.pt'}", *extra)


def test_only_the_adapters_train_and_the_checkpoint_holds_them_alone(
    tiny_data_dir: Path, base_run: Path, tmp_path: Path
) -> None:
    events: list[Event] = []
    result = train(tiny_experiment(tiny_data_dir, tmp_path / "run", *lora_settings(base_run)), sink=events.append)
    checkpoint = load_checkpoint(result.checkpoint)
    assert checkpoint["model"] and all(".lora_" in name for name in checkpoint["model"])
    base = load_checkpoint(base_run / "latest.pt")["model"]
    assert checkpoint["lora_base"]["path"] == str((base_run / "latest.pt").resolve())
    # The optimizer holds state for the adapters only, in the [decay, no_decay] groups.
    groups = checkpoint["optimizer"]["param_groups"]
    assert [len(group["params"]) for group in groups] == [len(checkpoint["model"]), 0]
    start = next(event for event in events if isinstance(event, StartEvent))
    assert start.trainable_parameters == sum(t.numel() for t in checkpoint["model"].values())
    # Read back, the adapters come merged onto the unchanged base: plain weights of the base's names.
    _, merged = read_model_source(result.checkpoint)
    assert merged.keys() == base.keys()
    assert any(not torch.equal(merged[name], base[name]) for name in base if name.endswith("qkv.weight"))
    assert torch.equal(merged["token_embedding.weight"], base["token_embedding.weight"])  # frozen, no adapter


@pytest.mark.parametrize(
    "extra",
    [
        ("training.lora.dropout=0.1",),  # dropout draws from the global RNG: its state is part of the resume
        ("training.precision=bfloat16", "training.lora.base_dtype=bfloat16", "training.lora.target_modules=qkv,down"),
    ],
)
def test_resume_of_a_lora_run_is_bit_identical(
    tiny_data_dir: Path, base_run: Path, tmp_path: Path, extra: tuple[str, ...]
) -> None:
    losses = check_resume_is_exact(tiny_data_dir, tmp_path, lora_settings(base_run, *extra), 3)
    assert len(losses) == 6 and all(loss is not None for loss in losses)


def test_the_adapters_are_float32_on_a_bfloat16_base(tiny_data_dir: Path, base_run: Path, tmp_path: Path) -> None:
    # The base is placed in bfloat16 as it is read; peft would make the adapters bfloat16 too, where
    # AdamW's small updates are lost.
    settings = lora_settings(base_run, "training.precision=bfloat16", "training.lora.base_dtype=bfloat16")
    result = train(tiny_experiment(tiny_data_dir, tmp_path / "run", *settings))
    adapters = load_checkpoint(result.checkpoint)["model"]
    assert adapters and all(tensor.dtype == torch.float32 for tensor in adapters.values())
    assert any(bool(tensor.abs().sum() > 0) for name, tensor in adapters.items() if "lora_A" in name)


def test_a_resume_refuses_a_changed_base(tiny_data_dir: Path, base_run: Path, tmp_path: Path) -> None:
    base = tmp_path / "base.pt"
    base.write_bytes((base_run / "latest.pt").read_bytes())
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run", *LORA, f"training.init_from={base}")
    paused = train(experiment, max_run_steps=3)
    other = train_tiny_run(tiny_data_dir, tmp_path / "other", "training.seed=7")
    base.write_bytes((other / "latest.pt").read_bytes())
    with pytest.raises(UserError, match="not the base model this LoRA run was trained on"):
        train(experiment, resume=paused.checkpoint)


def test_an_unknown_target_is_refused_with_the_valid_names(tiny_data_dir: Path, base_run: Path, tmp_path: Path) -> None:
    experiment = tiny_experiment(
        tiny_data_dir, tmp_path / "run", *lora_settings(base_run), "training.lora.target_modules=qkv,q_proj"
    )
    with pytest.raises(UserError, match=r"'q_proj' is not a Linear layer.*down, gate_up, out, qkv"):
        train(experiment)
    assert not (tmp_path / "run").exists()


def test_lora_needs_init_from() -> None:
    with pytest.raises(UserError, match=r"training\.lora: rank > 0 without training\.init_from"):
        load_config(Path(__file__).parents[1] / "configs" / "tiny.toml", ["training.lora.rank=4"])


@pytest.mark.parametrize("setting", ["training.checkpoint_format=dcp", "training.async_checkpoint=true"])
def test_lora_checkpoints_stay_single_files(setting: str) -> None:
    # A LoRA checkpoint holds the adapters and the base's checksum, which the sharded format does not carry.
    settings = ["training.lora.rank=4", "training.init_from=base", setting]
    with pytest.raises(UserError, match=r"training\.lora: adapters with sharded or asynchronous checkpoints"):
        load_config(Path(__file__).parents[1] / "configs" / "tiny.toml", settings)


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens)


def test_merged_and_adapter_exports_equal_the_adapter_model(
    tiny_data_dir: Path, base_run: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    from dlm.model.lora import add_adapters, load_base_and_adapters

    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run", *lora_settings(base_run))
    result = train(experiment)
    # The adapter model as training holds it: base + injected adapters, float32.
    model = add_adapters(DiffusionTransformer(experiment.model), experiment.training.lora)
    checkpoint = load_checkpoint(result.checkpoint)
    load_base_and_adapters(model, load_checkpoint(base_run / "latest.pt")["model"], checkpoint["model"])
    tokens = torch.randint(3, experiment.model.vocab_size, (2, experiment.model.max_seq_len))
    expected = _logits(model, tokens)

    merged = run_cli("export", tmp_path / "run", "--output", tmp_path / "merged", "--dtype", "float32")
    assert merged.exit_code == 0, merged.stderr
    assert "lora" not in json.loads((tmp_path / "merged" / "config.json").read_text())["model"]
    plain, _ = load_model(tmp_path / "merged")
    assert type(plain) is DiffusionTransformer and not any("lora" in n for n in plain.state_dict())
    torch.testing.assert_close(_logits(plain, tokens), expected, rtol=0, atol=1e-5)

    apart = run_cli("export", tmp_path / "run", "--output", tmp_path / "adapters", "--adapters-only", "--json")
    assert apart.exit_code == 0, apart.stderr
    assert sorted(json.loads(apart.stdout)["files"]) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
    ]
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["dlm"]["base"] == checkpoint["lora_base"]
    reloaded, _ = load_model(tmp_path / "adapters")
    torch.testing.assert_close(_logits(reloaded, tokens), expected, rtol=0, atol=1e-5)


def test_adapters_only_refuses_a_plain_run(base_run: Path, tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    refused = run_cli("export", base_run, "--output", tmp_path / "out", "--adapters-only")
    assert refused.exit_code == 2
    assert "error: " in refused.stderr and "--adapters-only needs the checkpoint or run directory of a LoRA run" in (
        refused.stderr
    )
    assert not (tmp_path / "out").exists()


def test_the_inference_checkpoint_and_the_ema_of_a_lora_run_load_merged(
    tiny_data_dir: Path, base_run: Path, tmp_path: Path
) -> None:
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run", *lora_settings(base_run, "training.ema_decay=0.9"))
    result = train(experiment)
    checkpoint = load_checkpoint(result.checkpoint)
    assert checkpoint["ema"]["shadow"].keys() == checkpoint["model"].keys()  # the average tracks the adapters
    inference = load_checkpoint(tmp_path / "run" / "inference-latest.pt")
    assert inference["weights"] == "ema" and inference["lora_base"] == checkpoint["lora_base"]
    assert all(".lora_" in name for name in inference["model"])
    info, merged = read_model_source(tmp_path / "run" / "inference-latest.pt")
    _, from_training = read_model_source(result.checkpoint)  # EMA weights too, by default
    assert info.lora is not None and merged.keys() == from_training.keys()
    for name, tensor in from_training.items():  # the inference file's adapters are bfloat16
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=2e-3)


def test_a_resume_refuses_other_lora_settings(tiny_data_dir: Path, base_run: Path, tmp_path: Path) -> None:
    paused = train(tiny_experiment(tiny_data_dir, tmp_path / "run", *lora_settings(base_run)), max_run_steps=3)
    changed = tiny_experiment(tiny_data_dir, tmp_path / "run", *lora_settings(base_run, "training.lora.alpha=4"))
    with pytest.raises(UserError, match=r"training\.lora is .*alpha=4\.0.* but the checkpoint used .*alpha=8\.0"):
        train(changed, resume=paused.checkpoint)


def test_a_resume_without_its_base_says_so(tiny_data_dir: Path, base_run: Path, tmp_path: Path) -> None:
    base = tmp_path / "base.pt"
    base.write_bytes((base_run / "latest.pt").read_bytes())
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run", *LORA, f"training.init_from={base}")
    paused = train(experiment, max_run_steps=3)
    base.unlink()
    with pytest.raises(UserError, match="checkpoint not found") as info:
        train(experiment, resume=paused.checkpoint)
    assert str(base) in str(info.value)


@pytest.mark.slow  # two processes that each import peft and torch: about 30 s
def test_two_ddp_processes_train_the_adapters_as_one_process(
    tiny_data_dir: Path, base_run: Path, tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys

    config = Path(__file__).parents[1] / "configs" / "tiny.toml"
    settings = [
        f"training.tokenizer={tiny_data_dir / 'tokenizer.json'}",
        "training.val_data=none",
        f"training.train_data={tiny_data_dir / 'train.bin'}",
        "training.batch_size=4",
        *lora_settings(base_run),
    ]
    single = train(
        load_config(
            config, [*settings, f"training.output_dir={tmp_path / 'one'}", "training.gradient_accumulation_steps=4"]
        )
    )
    overrides = [*settings, f"training.output_dir={tmp_path / 'two'}", "training.gradient_accumulation_steps=2"]
    command = [
        sys.executable,
        "-m",
        "dlm",
        "train",
        "--config",
        str(config),
        "--nproc",
        "2",
        *[part for item in overrides for part in ("--set", item)],
        "--json",
    ]
    finished = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    one, two = load_checkpoint(single.checkpoint), load_checkpoint(tmp_path / "two" / "latest.pt")
    assert one["model"].keys() == two["model"].keys() and one["lora_base"] == two["lora_base"]
    for name, tensor in one["model"].items():  # the same adapters, up to the order of the gradient sums
        torch.testing.assert_close(two["model"][name], tensor, rtol=0, atol=1e-5)


VARIANT = ("model.n_kv_heads=1", "model.qkv_bias=true", "model.qk_norm=true", "model.tie_embeddings=false")


def test_lora_on_a_model_with_the_imported_variant_properties(
    tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    from dlm.model.lora import add_adapters, load_base_and_adapters

    base = train_tiny_run(tiny_data_dir, tmp_path / "base", *VARIANT)
    head = tiny_experiment(
        tiny_data_dir, tmp_path / "head", *VARIANT, *lora_settings(base), "training.lora.target_modules=qkv,head"
    )
    # The model multiplies by the untied head's weight, not through the module: an adapter there would never train.
    valid = r"'head' is not a Linear layer of the model's blocks \(use some of: down, gate_up, out, qkv\)"
    with pytest.raises(UserError, match=valid):
        train(head)
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run", *VARIANT, *lora_settings(base))
    result = train(experiment)
    model = add_adapters(DiffusionTransformer(experiment.model), experiment.training.lora)
    adapters = load_checkpoint(result.checkpoint)["model"]
    load_base_and_adapters(model, load_checkpoint(base / "latest.pt")["model"], adapters)
    tokens = torch.randint(3, experiment.model.vocab_size, (2, experiment.model.max_seq_len))
    expected = _logits(model, tokens)
    for extra in ((), ("--adapters-only",)):
        output = tmp_path / f"export{len(extra)}"
        exported = run_cli("export", tmp_path / "run", "--output", output, "--dtype", "float32", *extra)
        assert exported.exit_code == 0, exported.stderr
        loaded, _ = load_model(output)
        assert loaded.config.tie_embeddings is False and loaded.config.kv_heads == 1
        torch.testing.assert_close(_logits(loaded, tokens), expected, rtol=0, atol=1e-5)
