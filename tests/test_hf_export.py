"""`dlm export --format hf` without transformers: the files, the round trip back to dlm, refusals.

What transformers does with the directory is tested in test_hf_transformers.py (the `hf` extra).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import train_tiny_run
from safetensors.torch import load_file

import dlm
import dlm.diffusion.schedules
from dlm.artifacts.export import export_model
from dlm.artifacts.hf.names import from_hf_names, to_hf_names
from dlm.artifacts.hf_export import AUTO_MAP, CODE_FILES, check_hf_exportable, export_hf
from dlm.artifacts.loading import read_model_source
from dlm.config.schema import DiffusionConfig, ModelConfig
from dlm.diffusion.schedules import Schedule, register_schedule
from dlm.errors import UserError


@pytest.fixture(scope="module")
def run_dir(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_data_dir, tmp_path_factory.mktemp("hf-run") / "run")


@pytest.fixture(scope="module")
def hf_dir(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf(run_dir, tmp_path_factory.mktemp("hf-export") / "tiny-hf", dtype="float32")


def test_hf_export_files_config_and_tokenizer(hf_dir: Path, tiny_data_dir: Path) -> None:
    names = {path.name for path in hf_dir.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "README.md",
        *CODE_FILES,
    }
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "dlm_diffusion" and config["architectures"] == ["DlmDiffusionForMaskedLM"]
    for target in AUTO_MAP.values():  # every auto_map entry names a file shipped in the directory
        module, _, cls = target.partition(".")
        assert f"class {cls}(" in (hf_dir / f"{module}.py").read_text()
    assert set(config["auto_map"]) >= {"AutoConfig", "AutoModelForMaskedLM"}
    assert (config["vocab_size"], config["padded_vocab_size"], config["hidden_size"]) == (512, 512, 64)
    assert (config["mask_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 0, 2)
    assert config["dlm"]["step"] == 4 and config["schedule"] == "linear"
    assert (hf_dir / "tokenizer.json").read_bytes() == (tiny_data_dir / "tokenizer.json").read_bytes()
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    special = json.loads((hf_dir / "special_tokens_map.json").read_text())
    assert special == {"eos_token": "<|endoftext|>", "mask_token": "<|mask|>", "pad_token": "<|pad|>"}
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert special.items() <= tokenizer_config.items()
    readme = (hf_dir / "README.md").read_text()  # both loads: transformers would otherwise ask first
    assert readme.count("trust_remote_code=True") == 2 and "from_pretrained" in readme
    assert "add dtype=torch.float32" in readme  # where the CPU emulates the stored bfloat16


def test_hf_weights_are_the_checkpoint_s_under_hf_names(hf_dir: Path, run_dir: Path) -> None:
    stored = load_file(str(hf_dir / "model.safetensors"))
    _, weights = read_model_source(run_dir)
    assert "model.embed_tokens.weight" in stored and not any("lm_head" in name for name in stored)  # tied: once
    assert stored.keys() == to_hf_names(weights).keys()
    for name, value in to_hf_names(weights).items():
        assert torch.equal(stored[name], value.float()), name
    assert from_hf_names(stored).keys() == weights.keys()


def test_round_trip_back_to_dlm_gives_identical_weights(hf_dir: Path, run_dir: Path, tmp_path: Path) -> None:
    direct = export_model(run_dir, tmp_path / "direct", dtype="float32")
    back = export_model(hf_dir, tmp_path / "back", dtype="float32")
    direct_weights, back_weights = (load_file(str(path / "model.safetensors")) for path in (direct, back))
    assert direct_weights.keys() == back_weights.keys()
    assert all(torch.equal(direct_weights[name], back_weights[name]) for name in direct_weights)
    direct_config, back_config = (json.loads((path / "config.json").read_text()) for path in (direct, back))
    for key in ("model", "diffusion", "step", "tokens_seen", "tokenizer_sha256", "weights", "training"):
        assert back_config[key] == direct_config[key], key
    assert back_config["source"]["kind"] == "hf"
    # dlm loads the HF directory itself, with the checkpoint's logits.
    tokens = torch.randint(3, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    tokens[:, ::4] = 1
    model, tokenizer = dlm.load(hf_dir)
    reference, _ = dlm.load(run_dir)
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))
    assert tokenizer.token_to_id("<|mask|>") == 1


def test_round_trip_of_a_bfloat16_export(hf_dir: Path, run_dir: Path, tmp_path: Path) -> None:
    hf_bf16 = export_hf(hf_dir, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((hf_bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    direct = load_file(str(export_model(run_dir, tmp_path / "direct") / "model.safetensors"))
    back = load_file(str(export_model(hf_bf16, tmp_path / "back") / "model.safetensors"))
    assert all(back[name].dtype == torch.bfloat16 and torch.equal(back[name], direct[name]) for name in direct)


def test_block_models_export_with_their_block_size_and_come_back(tiny_data_dir: Path, tmp_path: Path) -> None:
    run_dir = train_tiny_run(tiny_data_dir, tmp_path / "run", "model.block_size=16")
    hf_dir = export_hf(run_dir, tmp_path / "hf", dtype="float32")
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["block_size"] == 16 and config["dlm"]["model"]["block_size"] == 16
    # dlm reads the block size back from the transformers field, with the checkpoint's logits.
    model, _ = dlm.load(hf_dir)
    reference, _ = dlm.load(run_dir)
    assert model.config.block_size == 16 and model.config.is_block_model
    tokens = torch.randint(3, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))
    check_hf_exportable(ModelConfig(), DiffusionConfig(schedule="cosine"))


def test_schedules_without_a_bundled_sampler_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Registered into a copy of the registry, so no other test sees the extra schedule.
    monkeypatch.setattr(dlm.diffusion.schedules, "_SCHEDULES", dlm.diffusion.schedules._SCHEDULES.copy())

    @register_schedule("hf-test-quadratic")
    class Quadratic(Schedule):
        def mask_probability(self, t):  # type: ignore[no-untyped-def]
            return t * t

        def mask_rate(self, t):  # type: ignore[no-untyped-def]
            return 2 * t

    with pytest.raises(UserError, match="'hf-test-quadratic' noise schedule has no sampler"):
        check_hf_exportable(ModelConfig(), DiffusionConfig(schedule="hf-test-quadratic"))


def test_overwrite_replaces_only_an_export(hf_dir: Path, run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="already exists"):
        export_hf(run_dir, hf_dir)
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="refusing to replace it"):
        export_hf(run_dir, folder, overwrite=True)
    assert (folder / "notes.txt").read_text() == "keep me"
    dlm_export = export_model(run_dir, tmp_path / "dlm-format")
    assert export_hf(run_dir, dlm_export, overwrite=True) == dlm_export
    assert json.loads((dlm_export / "config.json").read_text())["model_type"] == "dlm_diffusion"


def test_cli_export_format_hf_and_back(run_dir: Path, tmp_path: Path, run_cli) -> None:
    result = run_cli("export", run_dir, "--output", tmp_path / "hf", "--format", "hf", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["step"] == 4 and summary["dtype"] == "bfloat16" and "modeling_dlm.py" in summary["files"]
    assert summary["parameters"] == sum(t.numel() for t in read_model_source(run_dir)[1].values())
    human = run_cli("export", tmp_path / "hf", "--output", tmp_path / "back")
    assert human.exit_code == 0, human.stderr
    assert json.loads((tmp_path / "back" / "config.json").read_text())["format"] == "dlm-export-v1"
    assert run_cli("export", run_dir, "-o", tmp_path / "bad", "--format", "onnx").exit_code == 2
    # Imported, it would be a foreign family: `dlm import` says what to do with dlm's own instead.
    run_cli("import", tmp_path / "hf", "--output", tmp_path / "imported").assert_refused(
        "dlm's own Hugging Face export: it needs no import", f"dlm export {tmp_path / 'hf'} --output DIR"
    )


@pytest.mark.parametrize("record", ["null", "empty", "absent"])
def test_a_directory_without_dlm_s_record_exports_with_a_card_that_says_so(
    hf_dir: Path, tmp_path: Path, run_cli, record: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # transformers' save_pretrained of a fine-tuned model may drop or empty the "dlm" object.
    saved = tmp_path / "saved"
    shutil.copytree(hf_dir, saved)
    config = json.loads((saved / "config.json").read_text())
    del config["dlm"]
    if record != "absent":
        config["dlm"] = None if record == "null" else {}
    (saved / "config.json").write_text(json.dumps(config))
    result = run_cli("export", saved, "--output", tmp_path / "back")
    assert result.exit_code == 0, result.stderr
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (exported["step"], exported["tokens_seen"], exported["weights"]) == (None, None, "live")
    card = (tmp_path / "back" / "README.md").read_text()
    assert "- optimizer steps and tokens seen not recorded\n" in card and "None" not in card
    assert card.splitlines()[0].endswith("-parameter diffusion language model")
    monkeypatch.setattr("dlm.cli.export_cmd.wants_json", lambda flag: False)  # the summary a person reads
    human = run_cli("export", saved, "--output", tmp_path / "back", "--overwrite")
    assert human.exit_code == 0 and "live weights, step not recorded." in " ".join(human.stdout.split())


def test_either_format_replaces_the_other(run_dir: Path, tmp_path: Path) -> None:
    output = export_hf(run_dir, tmp_path / "model")
    assert export_model(run_dir, output, overwrite=True) == output
    assert {path.name for path in output.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
    }
    assert json.loads((output / "config.json").read_text())["format"] == "dlm-export-v1"
    assert export_hf(run_dir, output, overwrite=True) == output
    (output / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match=r"files an export does not write \(notes\.txt\)"):
        export_model(run_dir, output, overwrite=True)
    assert (output / "notes.txt").read_text() == "keep me" and (output / "modeling_dlm.py").is_file()


@pytest.mark.parametrize("export", [export_model, export_hf])
def test_a_run_directory_is_never_an_export_s_output(run_dir: Path, export, run_cli) -> None:
    before = sorted(path.name for path in run_dir.iterdir())
    for overwrite in (False, True):
        with pytest.raises(UserError, match=r"output is a run directory \(.*latest\.pt.*\), which an export never"):
            export(run_dir, run_dir, overwrite=overwrite)
    result = run_cli("export", run_dir, "--output", run_dir, "--overwrite")
    result.assert_refused("is a run directory", "choose another --output")
    assert sorted(path.name for path in run_dir.iterdir()) == before
