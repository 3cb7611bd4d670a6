"""Export and load: logits survive the round trip, files are what they claim, refusals are clear."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from helpers import train_tiny_run
from safetensors import safe_open

import dlm
from dlm.artifacts.card_data import NEUTRAL_PROMPT, usage_prompt
from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.checksum import with_checksum
from dlm.artifacts.export import _store_once, export_model
from dlm.artifacts.export_layout import EXPORT_FORMAT
from dlm.artifacts.loading import load_model, load_model_with_info
from dlm.config.schema import ExperimentConfig
from dlm.data.dataset import load_packed_dataset
from dlm.data.tokenizer import load_tokenizer, tokenizer_sha256
from dlm.errors import UserError
from dlm.model.transformer import DiffusionTransformer
from dlm.runtime import device

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_data_dir, tmp_path_factory.mktemp("export-run") / "run")


def reference_model(checkpoint_path: Path, weights: str = "model") -> DiffusionTransformer:
    """The model as the training loop holds it, built the plain way from the checkpoint."""

    checkpoint = load_checkpoint(checkpoint_path)
    model = DiffusionTransformer(ExperimentConfig.from_dict(checkpoint["config"]).model)
    state = checkpoint[weights] if weights == "model" else {**checkpoint["model"], **checkpoint["ema"]["shadow"]}
    model.load_state_dict(state)
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    tokens[:, ::3] = 1  # some masks, as the model sees in use
    with torch.no_grad():
        return model(tokens).float()


def test_float32_export_reproduces_the_checkpoint_logits(run_dir: Path, tmp_path: Path) -> None:
    output = export_model(run_dir, tmp_path / "model", dtype="float32")
    model, tokenizer = load_model(output)
    assert not model.training and model.token_embedding.weight.dtype == torch.float32
    assert torch.allclose(logits(model), logits(reference_model(run_dir / "latest.pt")), atol=1e-6, rtol=0)
    assert tokenizer.token_to_id("<|mask|>") == model.config.mask_token_id


def test_bfloat16_export_is_two_bytes_per_parameter_and_close(run_dir: Path, tmp_path: Path) -> None:
    output = export_model(run_dir, tmp_path / "model")
    config = json.loads((output / "config.json").read_text())
    parameters = config["parameters"]
    reference = reference_model(run_dir / "latest.pt")
    assert parameters == reference.num_parameters
    size = (output / "model.safetensors").stat().st_size
    assert 2 * parameters < size < 2 * parameters + 16_384  # the tied head is not stored twice
    expected = logits(reference)
    upcast, _ = load_model(output, dtype=torch.float32)
    native, _ = load_model(output, dtype=torch.bfloat16)  # bf16 weights; the rotary tables stay float32
    assert native.token_embedding.weight.dtype == torch.bfloat16 and native.rope_cos.dtype == torch.float32
    scale = expected.abs().max()
    assert (logits(upcast) - expected).abs().max() < 0.01 * scale
    assert (logits(native) - expected).abs().max() < 0.025 * scale


@pytest.mark.parametrize("native", [False, True])
def test_a_bfloat16_export_loads_in_float32_where_the_cpu_emulates_bfloat16(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """dtype None: the stored bfloat16 on a CPU with native bfloat16, float32 on one that emulates it
    (faster there), and an explicit dtype always wins."""

    output = export_model(run_dir, tmp_path / "model")
    monkeypatch.setattr(device, "cpu_has_native_bfloat16", lambda: native)
    model, _ = dlm.load(output)
    expected = torch.bfloat16 if native else torch.float32
    assert {parameter.dtype for parameter in model.parameters()} == {expected}
    kept, _ = dlm.load(output, dtype=torch.bfloat16)
    assert {parameter.dtype for parameter in kept.parameters()} == {torch.bfloat16}


def test_export_files_config_and_model_card(run_dir: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "run"
    shutil.copytree(run_dir, source)
    (source / "eval.json").write_text(
        json.dumps(
            {
                "format": "dlm-eval-v1",
                "nll": 5.4321,
                "nll_stderr": 0.01,
                "bits_per_byte": 3.2109,
                "context": {"step": 4},
            }
        )
    )
    output = export_model(source / "step-00000004.pt", tmp_path / "model")
    assert sorted(p.name for p in output.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert not list(tmp_path.glob(".model.*"))  # no temporary directory left behind
    config = json.loads((output / "config.json").read_text())
    checkpoint = load_checkpoint(run_dir / "latest.pt")
    assert config["format"] == EXPORT_FORMAT and config["dlm_version"] == dlm.__version__
    assert config["step"] == 4 and config["tokens_seen"] == checkpoint["tokens_seen"]
    assert config["model"] == checkpoint["config"]["model"] and config["weights"] == "live"
    assert config["tokenizer_sha256"] == tokenizer_sha256(output / "tokenizer.json") == checkpoint["tokenizer_sha256"]
    assert "output_dir" not in config["training"] and config["training"]["max_steps"] == 4
    with safe_open(str(output / "model.safetensors"), "pt") as handle:
        assert sorted(handle.keys()) == sorted(checkpoint["model"])
        assert handle.metadata()["dlm_format"] == EXPORT_FORMAT
    card = (output / "README.md").read_text()
    validation = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"validation"' in line
    ][-1]
    assert f"{validation['loss']:.4f}" in card and "ELBO NLL 5.4321" in card and "3.2109 bits per byte" in card
    assert "4 optimizer steps" in card and 'dlm.load("model")' in card and "dlm sample model" in card


def test_ema_weights_are_exported_when_present(run_dir: Path, tmp_path: Path) -> None:
    checkpoint = load_checkpoint(run_dir / "latest.pt")
    shadow = {name: tensor + 0.25 for name, tensor in checkpoint["model"].items()}
    checkpoint["ema"] = {"decay": 0.99, "num_updates": 4, "shadow": shadow}
    torch.save(with_checksum(checkpoint), tmp_path / "ema.pt")  # an edited checkpoint, consistent again
    loaded = load_model_with_info(export_model(tmp_path / "ema.pt", tmp_path / "ema", dtype="float32"))
    assert loaded.info.weights == "ema"
    assert torch.allclose(logits(loaded.model), logits(reference_model(tmp_path / "ema.pt", "ema")), atol=1e-6)
    live = load_model_with_info(export_model(tmp_path / "ema.pt", tmp_path / "live", dtype="float32", use_ema=False))
    assert live.info.weights == "live"
    assert torch.equal(live.model.token_embedding.weight, checkpoint["model"]["token_embedding.weight"])


def test_every_source_kind_loads_without_pickle(run_dir: Path, tmp_path: Path, monkeypatch) -> None:
    exported = export_model(run_dir, tmp_path / "model", dtype="float32")
    kinds = {
        path: load_model_with_info(path).info.kind
        for path in (run_dir, run_dir / "step-00000004.pt", run_dir / "inference-latest.pt")
    }
    assert list(kinds.values()) == ["training", "training", "inference"]
    monkeypatch.setattr(device, "cpu_has_native_bfloat16", lambda: True)  # the stored dtype, kept
    inference, _ = load_model(run_dir / "inference-latest.pt")
    assert inference.token_embedding.weight.dtype == torch.bfloat16

    expected = logits(reference_model(run_dir / "latest.pt"))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an exported model must load without torch.load")

    monkeypatch.setattr(torch, "load", refuse)
    model, _ = dlm.load(exported)
    assert torch.allclose(logits(model), expected, atol=1e-6)


def test_shared_storage_is_stored_once_and_retied() -> None:
    weight = torch.randn(4, 3)
    stored, tied = _store_once(
        {"embedding.weight": weight, "head.weight": weight, "norm": torch.ones(3)}, torch.bfloat16
    )
    assert sorted(stored) == ["embedding.weight", "norm"] and tied == {"head.weight": "embedding.weight"}
    assert stored["embedding.weight"].dtype == torch.bfloat16


def test_refusals(run_dir: Path, tmp_path: Path) -> None:
    output = export_model(run_dir, tmp_path / "model")
    with pytest.raises(UserError, match="already exists"):
        export_model(run_dir, output)
    assert export_model(run_dir, output, dtype="float32", overwrite=True) == output
    assert json.loads((output / "config.json").read_text())["dtype"] == "float32"
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not an export"):
        export_model(run_dir, foreign, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "keep me"
    (tmp_path / "weights.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(UserError, match="not a dlm checkpoint"):
        export_model(tmp_path / "weights.pt", tmp_path / "out")
    torch.save({"format": "dlm-checkpoint-v1", "model": {}}, tmp_path / "partial.pt")
    with pytest.raises(UserError, match="lacks config"):
        export_model(tmp_path / "partial.pt", tmp_path / "out")
    with pytest.raises(UserError, match="already an exported model"):
        export_model(output, tmp_path / "again")
    with pytest.raises(UserError, match="dtype"):
        export_model(run_dir, tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()


def test_tokenizer_hash_is_checked(run_dir: Path, tmp_path: Path) -> None:
    checkpoint = load_checkpoint(run_dir / "latest.pt")
    changed = tmp_path / "tokenizer.json"
    changed.write_text(Path(checkpoint["config"]["training"]["tokenizer"]).read_text() + "\n")
    checkpoint["config"]["training"]["tokenizer"] = str(changed)
    torch.save(with_checksum(checkpoint), tmp_path / "moved.pt")  # an edited checkpoint, consistent again
    with pytest.raises(UserError, match="the tokenizer file changed since training"):
        export_model(tmp_path / "moved.pt", tmp_path / "out")
    changed.unlink()
    with pytest.raises(UserError, match="missing"):
        export_model(tmp_path / "moved.pt", tmp_path / "out")
    exported = export_model(run_dir, tmp_path / "model")
    (exported / "tokenizer.json").write_text((exported / "tokenizer.json").read_text() + " ")
    with pytest.raises(UserError, match="sha256"):
        load_model(exported)


def test_cli_export(run_dir: Path, tmp_path: Path, run_cli) -> None:
    result = run_cli("export", run_dir, "--output", tmp_path / "model", "--dtype", "float32", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["dtype"] == "float32" and summary["step"] == 4 and "model.safetensors" in summary["files"]
    again = run_cli("export", run_dir, "--output", tmp_path / "model")
    assert again.exit_code == 2 and again.stderr.startswith("error:") and "--overwrite" in again.stderr
    replaced = run_cli("export", run_dir, "-o", tmp_path / "model", "--overwrite", "--no-ema", "--json")
    assert replaced.exit_code == 0 and json.loads(replaced.stdout)["dtype"] == "bfloat16"


def test_model_card_names_the_run_its_data_and_a_prompt_from_it(
    run_dir: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    previous = os.umask(0o002)
    try:
        output = export_model(run_dir, tmp_path / "a-very-long-export-directory-name" / "model")
    finally:
        os.umask(previous)
    for name in ("model.safetensors", "config.json", "README.md", "tokenizer.json"):
        assert stat.S_IMODE((output / name).stat().st_mode) == 0o664, name  # not safetensors' 0600
    card = (output / "README.md").read_text()
    title = card.splitlines()[0]
    assert title.startswith("# ") and title[2:] != "model" and f"on {tiny_data_dir.name}, step 4" in title
    train = json.loads((tiny_data_dir / "train.json").read_text())
    assert "## Data" in card and f"- training: {train['num_tokens']:,} tokens" in card
    assert f"`{Path(train['sources'][0]['path']).name}`" in card and "- validation: " in card
    prompt = usage_prompt(load_model_with_info(output).info)  # an export knows no data: neutral
    assert prompt == NEUTRAL_PROMPT
    val_text = load_tokenizer(tiny_data_dir / "tokenizer.json").decode(
        [int(t) for t in load_packed_dataset(tiny_data_dir, split="val")[0]]
    )
    first_words = " ".join(val_text.split()[:3])
    assert f'--prompt "{first_words}"' in card and "ROMEO:" not in card
