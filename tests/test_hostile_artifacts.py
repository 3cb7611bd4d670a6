"""Damaged or hostile model files and run directories: each command refuses them with one error line
(exit code 2, no traceback) and writes nothing, rather than computing NaN or deleting a user's file."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult
from helpers import ROOT, train_tiny_run

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.checksum import with_checksum
from dlm.errors import UserError

POISONED = "blocks.1.attention.qkv.weight"  # the tensor that holds the NaN / inf


@pytest.fixture(scope="module")
def run_dir(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_data_dir, tmp_path_factory.mktemp("hostile") / "run")


def tree(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (relative name: bytes), to show that nothing changed; the run
    lock's content is the pid of its last holder, so only its presence counts."""

    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return {str(p.relative_to(directory)): b"" if p.name == ".lock" else p.read_bytes() for p in files}


def _poison(checkpoint: dict[str, Any], value: float) -> dict[str, Any]:
    """The checkpoint with one element of POISONED set to `value`, in its weights and its EMA's."""

    ema = checkpoint.get("ema")
    for weights in [checkpoint["model"]] + ([] if ema is None else [ema["shadow"]]):
        weights[POISONED] = weights[POISONED].clone()
        weights[POISONED].view(-1)[3] = value
    checkpoint.pop("payload_sha256", None)
    return with_checksum(checkpoint)  # a sound file that holds bad numbers, not a damaged one


@pytest.fixture
def nan_run(run_dir: Path, tmp_path: Path) -> Path:
    """A copy of the run whose every checkpoint holds a NaN in POISONED."""

    copy = tmp_path / "nan-run"
    shutil.copytree(run_dir, copy)
    for path in [*copy.glob("step-*.pt"), copy / "inference-latest.pt"]:
        torch.save(_poison(load_checkpoint(path), float("nan")), path)
    (copy / "latest.pt").unlink()
    (copy / "latest.pt").hardlink_to(next(copy.glob("step-*.pt")))
    return copy


def _nan_export(run_dir: Path, tmp_path: Path, value: float) -> Path:
    from safetensors.torch import load_file, save_file

    from dlm.artifacts.export import export_model

    export = export_model(run_dir, tmp_path / "export", dtype="float32")
    weights = load_file(str(export / "model.safetensors"))
    weights[POISONED].view(-1)[0] = value
    save_file(weights, str(export / "model.safetensors"), metadata={"format": "pt"})
    return export


@pytest.mark.parametrize("name", ["latest.pt", "inference-latest.pt", "."])
def test_eval_of_nan_weights_is_refused_naming_the_tensor_and_the_file(
    nan_run: Path, tiny_data_dir: Path, run_cli: Callable[..., CliResult], name: str
) -> None:
    source = nan_run / name
    result = run_cli("eval", source, "--data", tiny_data_dir, "--batches", "1", "--mc-samples", "1", "--json")
    shown = nan_run / ("latest.pt" if name == "." else name)
    result.assert_refused("NaN or inf", f"tensor {POISONED}", str(shown))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_an_export_with_non_finite_weights_is_refused_by_sample_and_the_harness(
    run_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult], value: float
) -> None:
    export = _nan_export(run_dir, tmp_path, value)
    result = run_cli("sample", export, "--length", "8", "--steps", "2", "--json")
    result.assert_refused("NaN or inf", f"tensor {POISONED}", str(export / "model.safetensors"))
    from dlm.artifacts.loading import load_model_with_info  # what the lm-eval adapter (dlm.harness) loads with

    with pytest.raises(UserError, match=f"tensor {POISONED}"):
        load_model_with_info(export)


def test_export_init_from_and_resume_refuse_nan_weights_and_write_nothing(
    nan_run: Path, tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    before = tree(nan_run)
    run_cli("export", nan_run, "--output", tmp_path / "export").assert_refused(f"tensor {POISONED}")
    assert not (tmp_path / "export").exists()
    data = tiny_data_dir
    sets = [
        f"training.tokenizer={data / 'tokenizer.json'}",
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}",
        f"training.output_dir={tmp_path / 'new'}",
    ]
    options = [item for value in sets for item in ("--set", value)]
    config = ROOT / "configs" / "tiny.toml"
    result = run_cli("train", "--config", config, *options, "--init-from", nan_run / "latest.pt", "--json")
    result.assert_refused(f"tensor {POISONED}", str(nan_run / "latest.pt"))
    assert not (tmp_path / "new").exists()
    resumed = run_cli("resume", nan_run, "--set", "training.max_steps=6", "--json")
    resumed.assert_refused(f"tensor {POISONED}", str(nan_run / "latest.pt"))
    assert tree(nan_run) == before


@pytest.mark.parametrize("export_format", ["dlm", "hf"])
@pytest.mark.parametrize("damage", ["missing", "unexpected", "shape"])
def test_export_refuses_weights_that_do_not_fit_the_config_and_writes_nothing(
    run_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult], damage: str, export_format: str
) -> None:
    """A sound file (its checksum right) whose weights no model of its config takes: the export would be
    one that nothing can load, so it is refused, as loading it is."""

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    path = copy / "inference-latest.pt"
    checkpoint = load_checkpoint(path)
    weights = checkpoint["model"]
    if damage == "missing":
        del weights["norm.weight"]
    elif damage == "unexpected":
        weights["extra.weight"] = torch.zeros(2)
    else:
        weights["norm.weight"] = weights["norm.weight"][:-1].clone()
    checkpoint.pop("payload_sha256", None)
    torch.save(with_checksum(checkpoint), path)
    run_cli("export", path, "--output", tmp_path / "out", "--format", export_format).assert_refused(
        "the weights do not fit the model config", damage if damage != "shape" else "wrong shape ['norm.weight']"
    )
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_whose_model_is_no_weights_or_that_was_cut_short_is_one_error(
    run_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    path = copy / "inference-latest.pt"
    checkpoint = load_checkpoint(path)
    checkpoint["model"] = "weights"
    checkpoint.pop("payload_sha256", None)
    torch.save(with_checksum(checkpoint), path)
    for command in ("export", "sample"):
        arguments = ("--output", tmp_path / "out") if command == "export" else ("--length", "4")
        run_cli(command, path, *arguments).assert_refused("its model field is not a map of tensor names to tensors")
    # The newest numbered checkpoint cut short, as a crash or a full disk leaves it: the one before it is named.
    newest = sorted(copy.glob("step-*.pt"))[-1]
    shutil.copy(newest, copy / "step-00000001.pt")  # an older one kept beside it (the run keeps one)
    numbered = sorted(copy.glob("step-*.pt"))
    (copy / "latest.pt").unlink()
    cut = numbered[-1].read_bytes()
    numbered[-1].unlink()
    numbered[-1].write_bytes(cut[: len(cut) // 2])
    (copy / "latest.pt").hardlink_to(numbered[-1])
    run_cli("resume", copy).assert_refused(
        "not a dlm checkpoint", f"go on from {numbered[-2]}", f"--checkpoint {numbered[-2].name}"
    )


def test_a_tokenizer_that_is_not_the_models_is_refused_where_no_checksum_catches_it(
    run_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """A Hugging Face export records no tokenizer sha256 (a transformers re-save may reformat the file): a
    tokenizer of another vocabulary put beside it is refused by its size; a config whose mask token is
    not the tokenizer's, by the mask id."""

    import json

    from tokenizers import Tokenizer

    hf = tmp_path / "hf"
    assert run_cli("export", run_dir, "--output", hf, "--format", "hf").exit_code == 0
    tokenizer = Tokenizer.from_file(str(hf / "tokenizer.json"))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_tokens(["zounds"])
    tokenizer.save(str(hf / "tokenizer.json"))
    wanted = f"the tokenizer has {size + 1} tokens, the model {size}"
    run_cli("sample", hf, "--length", "4").assert_refused(wanted)
    run_cli("export", hf, "--output", tmp_path / "again").assert_refused(wanted)
    assert not (tmp_path / "again").exists()
    export = tmp_path / "export"
    assert run_cli("export", run_dir, "--output", export).exit_code == 0
    config = json.loads((export / "config.json").read_text())
    config["model"]["mask_token_id"] = 5
    (export / "config.json").write_text(json.dumps(config))
    run_cli("sample", export, "--length", "4").assert_refused("mask token is id 1, the model's mask_token_id is 5")


def test_an_export_missing_its_weights_or_tokenizer_says_which_file(
    run_dir: Path, tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    export = tmp_path / "export"
    assert run_cli("export", run_dir, "--output", export).exit_code == 0
    (export / "model.safetensors").rename(export / "pytorch_model.bin")  # as if only pickled weights were there
    for arguments in (("sample", export), ("export", export, "--output", tmp_path / "again")):
        run_cli(*arguments).assert_refused("the export's model.safetensors is missing", "pytorch_model.bin is pickle")
    hf = tmp_path / "hf"
    assert run_cli("export", run_dir, "--output", hf, "--format", "hf").exit_code == 0
    (hf / "tokenizer.json").unlink()
    run_cli("eval", hf, "--data", tiny_data_dir).assert_refused("tokenizer.json", "is missing")


def test_nan_in_the_ema_weights_alone_is_refused_too(tmp_path: Path) -> None:
    from dlm.artifacts.checkpoint import save_training_checkpoint

    good, bad = torch.ones(3), torch.tensor([1.0, float("nan"), 1.0])
    path = save_training_checkpoint(tmp_path, {"step": 1, "model": {"w": good}, "ema": {"shadow": {"w": bad}}}, 1, 0)
    with pytest.raises(UserError, match="the EMA weights hold NaN or inf values: tensor w;"):
        load_checkpoint(path)


@pytest.mark.parametrize("export_format", ["dlm", "hf"])
def test_export_overwrite_refuses_to_delete_a_users_files_beside_an_export(
    run_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult], export_format: str
) -> None:
    output = tmp_path / "model"
    first = run_cli("export", run_dir, "--output", output, "--format", export_format, "--json")
    assert first.exit_code == 0, first.stderr
    (output / "notes.txt").write_text("my notes")
    (output / "plots").mkdir()
    before = tree(output)
    again = run_cli("export", run_dir, "--output", output, "--format", export_format, "--overwrite", "--json")
    again.assert_refused("files an export does not write (notes.txt, plots/)", str(output))
    assert tree(output) == before and (output / "plots").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary left beside it
    (output / "notes.txt").unlink()
    (output / "plots").rmdir()
    replaced = run_cli("export", run_dir, "--output", output, "--format", export_format, "--overwrite", "--json")
    assert replaced.exit_code == 0, replaced.stderr  # only what an export writes: replaced as before


@pytest.fixture(scope="module")
def exports(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from dlm.artifacts.export import export_model
    from dlm.artifacts.hf_export import export_hf

    root = tmp_path_factory.mktemp("exports")
    return {"dlm": export_model(run_dir, root / "dlm"), "hf": export_hf(run_dir, root / "hf")}


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda config: config.pop(key)


def _set(*keys: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(config: dict[str, Any]) -> None:
        for key in keys[:-1]:
            config = config[key]
        config[keys[-1]] = value

    return change


MALFORMED = {  # (export format, what is wrong, the change, what the error line names)
    "dlm model missing": ("dlm", _drop("model"), "the field model is missing"),
    "dlm model a list": ("dlm", _set("model", value=[1, 2]), "the field model is a list, not an object"),
    "dlm training a string": ("dlm", _set("training", value="x"), "the field training is a string, not an object"),
    "dlm diffusion a number": ("dlm", _set("diffusion", value=3), "the field diffusion is an integer, not an object"),
    "dlm tied a list": ("dlm", _set("tied", value=["a"]), "the field tied is a list, not an object"),
    "dlm tied to nothing": ("dlm", _set("tied", value={"x": "absent.weight"}), "tied names tensors"),
    "dlm tied to a number": ("dlm", _set("tied", value={"x": 3}), "the field tied must map tensor names"),
    "dlm step a string": ("dlm", _set("step", value="four"), "the field step is a string, not an integer or null"),
    "dlm tokens_seen true": ("dlm", _set("tokens_seen", value=True), "the field tokens_seen is true or false"),
    "hf dlm a list": ("hf", _set("dlm", value=[1]), "the field dlm is a list, not an object or null"),
    "hf dlm a string": ("hf", _set("dlm", value="x"), "the field dlm is a string"),
    "hf dlm.model a number": ("hf", _set("dlm", "model", value=3), "the field dlm.model is an integer"),
    "hf dlm.training a list": ("hf", _set("dlm", "training", value=[]), "the field dlm.training is a list"),
    "hf dlm.diffusion a string": ("hf", _set("dlm", "diffusion", value="x"), "the field dlm.diffusion is a string"),
    "hf dlm.step a list": ("hf", _set("dlm", "step", value=[4]), "the field dlm.step is a list"),
    "hf hidden_size missing": ("hf", _drop("hidden_size"), "the field hidden_size is missing"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_export_config_is_one_error_naming_the_file_and_field(
    exports: dict[str, Path], tmp_path: Path, run_cli: Callable[..., CliResult], case: str
) -> None:
    import json

    kind, change, message = MALFORMED[case]
    export = tmp_path / "model"
    shutil.copytree(exports[kind], export)
    config = json.loads((export / "config.json").read_text())
    change(config)
    (export / "config.json").write_text(json.dumps(config))
    result = run_cli("sample", export, "--length", "4", "--steps", "1", "--json")
    result.assert_refused(str(export / "config.json"), message)


def test_export_leaves_a_damaged_eval_report_out_of_the_model_card_with_a_warning(
    run_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    import json

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "eval.json").write_text(json.dumps({"format": "dlm-eval-v2", "nll": 4.5, "context": [4]}))
    result = run_cli("export", run, "--output", tmp_path / "model", "--json")
    assert result.exit_code == 0, result.stderr
    warning = f"warning: {run / 'eval.json'}: a damaged eval report (its context is not an object); left out"
    assert result.stderr.splitlines() == [f"{warning} of the model card"]
    assert "dlm eval" not in (tmp_path / "model" / "README.md").read_text().split("## Use")[0]


def test_large_finite_weights_whose_sum_overflows_are_accepted(tmp_path: Path) -> None:
    from dlm.artifacts.checkpoint import check_finite_weights

    large = torch.full((4,), 60000.0, dtype=torch.float16)  # finite, but its float16 sum is inf
    assert not torch.isfinite(large.sum())
    check_finite_weights({"w": large}, tmp_path / "x.pt")
    large[2] = float("nan")
    with pytest.raises(UserError, match="tensor w;"):
        check_finite_weights({"w": large}, tmp_path / "x.pt")
