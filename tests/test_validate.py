"""`dlm validate`: every check passes on matching files and each mismatch fails with its fix."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_settings

from dlm.config.schema import load_config
from dlm.errors import UserError
from dlm.train.preflight import ensure_valid, validate_config_file

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


def tiny_overrides(data: Path, output: Path, *extra: str) -> list[str]:
    return tiny_settings(data, output, *extra)


def failed(overrides: list[str]) -> dict[str, tuple[str, str]]:
    """The failed checks as {name: (detail, fix)}."""

    _, results = validate_config_file(TINY, overrides)
    return {r.name: (r.detail, r.fix) for r in results if not r.passed}


def test_matching_files_pass_every_check(tiny_data_dir: Path, tmp_path: Path, run_cli) -> None:
    overrides = tiny_overrides(tiny_data_dir, tmp_path / "run")
    result = run_cli("validate", "--config", TINY, *[a for o in overrides for a in ("--set", o)], "--json")
    assert result.exit_code == 0, result.stdout
    report = json.loads(result.stdout)
    assert report["passed"] is True
    names = [check["name"] for check in report["checks"]]
    assert names[:4] == ["config schema", "tokenizer", "tokenizer vocab_size", "tokenizer mask_token_id"]
    for split in ("train", "val"):
        assert {f"{split} data", f"{split} data seq_len", f"{split} data vocab_size", f"{split} data tokenizer"} <= set(
            names
        )
    assert names[-4:] == ["output_dir writable", "training budget", "memory", "checkpoint size"]
    blocks = json.loads((tiny_data_dir / "train.json").read_text())["num_blocks"]
    budget = report["checks"][-3]["detail"]
    assert f"{60 * 8:,} blocks ({60 * 8 * 64:,} tokens) = {60 * 8 / blocks:.2f} epochs of {blocks:,}" in budget
    assert "139.6K parameters: weights 545.2 KiB" in report["checks"][-2]["detail"]
    assert "of RAM available" in report["checks"][-2]["detail"]
    assert "checkpoint_format 'auto' -> single; * single: 1.6 MiB" in report["checks"][-1]["detail"]
    assert not (tmp_path / "run").exists()  # validating never creates the run directory
    assert result.stderr == ""


def test_a_model_too_large_fails_the_memory_check_with_its_fix(tiny_data_dir: Path, tmp_path: Path, run_cli) -> None:
    overrides = tiny_overrides(tiny_data_dir, tmp_path / "run", "model.d_model=65536", "model.n_layers=512")
    result = run_cli("validate", "--config", TINY, *[a for o in overrides for a in ("--set", o)], "--json")
    checks = {check["name"]: check for check in json.loads(result.stdout)["checks"]}
    memory = checks["memory"]
    assert not memory["passed"]
    assert memory["detail"].startswith("the run needs at least 384.0 TiB for the model state (26.39T parameters")
    assert "of RAM available" in memory["detail"] and "model.d_model" in memory["fix"]
    assert [name for name, check in checks.items() if not check["passed"]] == ["memory"]
    result.assert_refused(f"error: 1 of {len(checks)} checks failed: memory", 'see the "fix" of each failed check')
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_unavailable_device_fails_the_memory_check(tiny_data_dir: Path, tmp_path: Path) -> None:
    failures = failed(tiny_overrides(tiny_data_dir, tmp_path / "run", "training.device=cuda"))
    assert list(failures) == ["memory"] and "no CUDA device is available" in failures["memory"][0]


@pytest.mark.parametrize(
    ("override", "check", "fix"),
    [
        ("model.vocab_size=600", "tokenizer vocab_size", "set model.vocab_size = 512"),
        ("model.mask_token_id=2", "tokenizer mask_token_id", "set model.mask_token_id = 1"),
        ("model.max_seq_len=128", "train data seq_len", "re-pack with --seq-len 128"),
        ("training.batch_size=100000", "training budget", "lower training.batch_size"),
    ],
)
def test_each_mismatch_fails_with_its_fix(
    override: str, check: str, fix: str, tiny_data_dir: Path, tmp_path: Path
) -> None:
    failures = failed(tiny_overrides(tiny_data_dir, tmp_path / "run", override))
    assert check in failures and fix in failures[check][1]


def test_data_from_another_tokenizer_and_broken_files_fail(tiny_data_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    with (data / "tokenizer.json").open("a") as handle:
        handle.write("\n")  # still a valid tokenizer, but not the file the data was packed with
    (data / "val.bin").write_bytes((data / "val.bin").read_bytes()[:-64])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    failures = failed(tiny_overrides(data, blocker / "run"))
    assert set(failures) == {"train data tokenizer", "val data", "output_dir writable"}
    assert "different tokenizer" in failures["train data tokenizer"][0]
    assert "truncated" in failures["val data"][0] and str(data / "val.bin") in failures["val data"][0]
    assert "not a directory" in failures["output_dir writable"][0]


def test_missing_tokenizer_and_data_fail_without_dependent_checks(tmp_path: Path) -> None:
    _, results = validate_config_file(TINY, tiny_overrides(tmp_path / "absent", tmp_path / "run"))
    by_name = {r.name: r for r in results}
    assert not by_name["tokenizer"].passed and "tokenizer file not found" in by_name["tokenizer"].detail
    assert not by_name["train data"].passed and "dlm pack" in by_name["train data"].fix
    assert "tokenizer vocab_size" not in by_name and "training budget" not in by_name


def test_schema_errors_are_a_failed_check_and_exit_2(tmp_path: Path, run_cli) -> None:
    _, results = validate_config_file(TINY, ["model.n_heads=3"])
    assert len(results) == 1 and results[0].name == "config schema" and not results[0].passed
    assert "n_heads" in results[0].detail
    result = run_cli("validate", "-c", TINY, "--set", "model.nope=1", "--json")
    assert json.loads(result.stdout)["passed"] is False
    result.assert_refused("error: 1 of 1 checks failed: config schema")


def test_table_rendering_and_exit_code(
    tiny_data_dir: Path, tmp_path: Path, run_cli, monkeypatch, narrow_console
) -> None:
    monkeypatch.setattr("dlm.cli.data_cmd.wants_json", lambda flag: False)
    overrides = tiny_overrides(tiny_data_dir, tmp_path / "run", "model.mask_token_id=2")
    result = run_cli("validate", "-c", TINY, *[a for o in overrides for a in ("-s", o)])
    assert "tokenizer mask_token_id" in result.stdout and "failed" in result.stdout and "passed" in result.stdout
    checks = len(validate_config_file(TINY, overrides)[1])
    result.assert_refused(
        f"error: 1 of {checks} checks failed: tokenizer mask_token_id (fix the rows marked failed above)"
    )


def test_ensure_valid_raises_the_first_failure(tiny_data_dir: Path, tmp_path: Path) -> None:
    good = load_config(TINY, tiny_overrides(tiny_data_dir, tmp_path / "run"))
    ensure_valid(good)
    bad = load_config(TINY, tiny_overrides(tiny_data_dir, tmp_path / "run", "model.max_seq_len=32"))
    with pytest.raises(UserError, match="train data seq_len: packed with seq_len 64"):
        ensure_valid(bad)


def test_lora_without_peft_is_one_error_naming_the_extra(
    tiny_data_dir: Path, tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` fail, installed or not
    sets = [
        f"training.tokenizer={tiny_data_dir / 'tokenizer.json'}",
        f"training.output_dir={tmp_path / 'run'}",
        f"training.train_data={tiny_data_dir / 'train.bin'}",
        f"training.val_data={tiny_data_dir / 'val.bin'}",
        "training.lora.rank=4",
        f"training.init_from={tmp_path}",
    ]
    result = run_cli("train", "--config", TINY, *[item for value in sets for item in ("--set", value)])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs peft, which is not installed" in errors[0], result.stderr
    assert "pip install 'dlm[lora]'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
