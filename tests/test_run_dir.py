"""Run directories: self-contained on resume, never overwritten by accident, refused commands change
nothing, damaged checkpoints and replaced data are caught, a full disk loses nothing."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import tiny_experiment

from dlm.artifacts.checkpoint import UnverifiedCheckpointWarning, load_checkpoint
from dlm.artifacts.checksum import CHECKSUM_KEY
from dlm.errors import UserError
from dlm.fileio import temporaries
from dlm.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
# Long enough that an error line naming it twice would wrap at 80 columns if it could.
LONG = "a-directory-with-a-rather-long-name-" * 3


def cli_args(data_dir: Path, run_dir: Path, *settings: str) -> list[str]:
    """`dlm train` arguments for configs/tiny.toml on the tiny data, writing to `run_dir`."""

    args = ["--config", str(ROOT / "configs" / "tiny.toml")]
    for item in (
        f"training.tokenizer={data_dir / 'tokenizer.json'}",
        f"training.train_data={data_dir / 'train.bin'}",
        f"training.val_data={data_dir / 'val.bin'}",
        f"training.output_dir={run_dir}",
        *settings,
    ):
        args += ["--set", item]
    return args


def tiny_run(data_dir: Path, run_dir: Path, *settings: str, steps: int | None = None) -> Path:
    """A run saved every 2 steps, without validation, stopped after `steps` (default: all)."""

    defaults = (
        "training.max_steps=4",
        "training.save_interval=2",
        "training.eval_interval=1000",
        "training.warmup_steps=1",
    )
    train(tiny_experiment(data_dir, run_dir, *defaults, *settings), max_run_steps=steps, sink=lambda event: None)
    return run_dir


def snapshot(directory: Path) -> dict[str, tuple[bytes, int | None]]:
    """Every file of a directory by name, with its bytes and modification time. Each command takes
    the run's lock, which rewrites the holder's pid into `.lock`: its time is left out."""

    return {
        path.name: (path.read_bytes(), None if path.name == ".lock" else path.stat().st_mtime_ns)
        for path in sorted(directory.iterdir())
        if path.is_file()
    }


def events(run_dir: Path, kind: str) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["event"] == kind]


def step_files(run_dir: Path) -> list[str]:
    return sorted(path.name for path in run_dir.glob("step-*.pt"))


def test_resume_of_a_copied_run_writes_into_the_copy(
    tiny_data_dir: Path, tmp_path: Path, run_cli, narrow_console: int
) -> None:
    original = tiny_run(tiny_data_dir, tmp_path / LONG / "original", "training.max_steps=8", steps=4)
    before, lock_time = snapshot(original), (original / ".lock").stat().st_mtime_ns
    assert step_files(original) == ["step-00000002.pt", "step-00000004.pt"]
    copy = tmp_path / LONG / "copy"
    shutil.copytree(original, copy)

    result = run_cli("resume", copy, "--json")
    assert result.exit_code == 0, result.stderr
    # The original is untouched: no relink, no retention, no config, no lock, no metrics.
    assert snapshot(original) == before and (original / ".lock").stat().st_mtime_ns == lock_time
    assert load_checkpoint(copy / "latest.pt")["step"] == 8
    assert step_files(copy) == ["step-00000006.pt", "step-00000008.pt"]
    assert os.path.samefile(copy / "latest.pt", copy / "step-00000008.pt")
    assert json.loads((copy / "config.json").read_text())["training"]["output_dir"] == str(copy.resolve())
    starts = events(copy, "start")
    assert [start["run_dir"] for start in starts] == [str(original.resolve()), str(copy.resolve())]


def test_train_refuses_a_directory_that_holds_a_run_until_told_to_overwrite(
    tiny_data_dir: Path, tmp_path: Path, run_cli, narrow_console: int
) -> None:
    run_dir = tiny_run(tiny_data_dir, tmp_path / LONG / "run")
    (run_dir / "notes.txt").write_text("mine\n")
    before = snapshot(run_dir)

    again = cli_args(
        tiny_data_dir, run_dir, "training.max_steps=3", "training.save_interval=3", "training.warmup_steps=1"
    )
    run_cli("train", *again, "--json").assert_refused(
        f"{run_dir}: already holds a run", f"dlm resume {run_dir}", "--overwrite"
    )
    assert snapshot(run_dir) == before

    result = run_cli("train", *again, "--overwrite", "--json")
    assert result.exit_code == 0, result.stderr
    assert step_files(run_dir) == ["step-00000003.pt"]  # the old run's step-2 / step-4 are gone
    assert load_checkpoint(run_dir / "latest.pt")["step"] == 3
    assert len(events(run_dir, "start")) == 1
    assert json.loads((run_dir / "config.json").read_text())["training"]["max_steps"] == 3
    assert (run_dir / "notes.txt").read_text() == "mine\n"  # not a run file: left alone


def test_overwrite_cannot_be_combined_with_resume(tiny_data_dir: Path, tmp_path: Path) -> None:
    run_dir = tiny_run(tiny_data_dir, tmp_path / "run", "training.max_steps=6", steps=2)
    before = snapshot(run_dir)
    with pytest.raises(UserError, match="--overwrite starts a new run"):
        train(tiny_experiment(tiny_data_dir, run_dir), resume=run_dir / "latest.pt", overwrite=True)
    assert snapshot(run_dir) == before


def test_continuing_another_runs_checkpoint_into_a_run_is_refused(tiny_data_dir: Path, tmp_path: Path) -> None:
    first = tiny_run(tiny_data_dir, tmp_path / "first", "training.max_steps=6", steps=2)
    second = tiny_run(tiny_data_dir, tmp_path / "second", "training.max_steps=6", steps=2)
    before = snapshot(second)
    with pytest.raises(UserError, match=f"continuing {first / 'latest.pt'} here would mix two runs"):
        train(tiny_experiment(tiny_data_dir, second, "training.max_steps=6"), resume=first / "latest.pt")
    assert snapshot(second) == before


def test_a_refused_resume_changes_nothing(tiny_data_dir: Path, tmp_path: Path, run_cli, narrow_console: int) -> None:
    run_dir = tiny_run(tiny_data_dir, tmp_path / LONG / "run")
    before = snapshot(run_dir)
    run_cli("resume", run_dir, "--json").assert_refused("already at step 4 of max_steps 4", "training.max_steps")
    assert snapshot(run_dir) == before
    assert len(events(run_dir, "start")) == 1


def test_metrics_jsonl_that_is_a_directory_is_one_error_line(
    tiny_data_dir: Path, tmp_path: Path, run_cli, narrow_console: int
) -> None:
    run_dir = tmp_path / LONG / "run"
    (run_dir / "metrics.jsonl").mkdir(parents=True)
    settings = ("training.max_steps=2", "training.warmup_steps=1")
    result = run_cli("train", *cli_args(tiny_data_dir, run_dir, *settings), "--json")
    result.assert_refused(f"{run_dir / 'metrics.jsonl'}: metrics.jsonl is not a regular file")
    assert sorted(path.name for path in run_dir.iterdir()) == [".lock", "metrics.jsonl"]


# ----------------------------------------------------------------------------------- checksums


def zero_four_bytes_of_a_tensor(path: Path) -> None:
    """Zero 4 bytes in the middle of the largest tensor record, as a failing disk might."""

    with zipfile.ZipFile(path) as archive:
        record = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as handle:
        handle.seek(record.header_offset)
        name_length, extra_length = struct.unpack("<HH", handle.read(30)[26:30])
        offset = record.header_offset + 30 + name_length + extra_length + record.file_size // 2
        handle.seek(offset)
        assert handle.read(4) != bytes(4)
        handle.seek(offset)
        handle.write(bytes(4))


def test_a_damaged_checkpoint_is_refused_naming_the_next_older_one(
    tiny_data_dir: Path, tmp_path: Path, run_cli, narrow_console: int
) -> None:
    run_dir = tiny_run(tiny_data_dir, tmp_path / LONG / "run", "training.max_steps=6", steps=4)
    zero_four_bytes_of_a_tensor(run_dir / "latest.pt")  # a hard link: step-00000004.pt is damaged too
    before = snapshot(run_dir)

    run_cli("resume", run_dir, "--json").assert_refused(
        f"{run_dir / 'latest.pt'}: the checkpoint is damaged",
        f"dlm resume {run_dir} --checkpoint step-00000002.pt",
    )
    with pytest.raises(UserError, match="damaged"):
        load_checkpoint(run_dir / "step-00000004.pt")
    assert snapshot(run_dir) == before

    result = run_cli("resume", run_dir, "--checkpoint", "step-00000002.pt", "--json")
    assert result.exit_code == 0, result.stderr
    assert events(run_dir, "start")[-1]["start_step"] == 2
    assert load_checkpoint(run_dir / "latest.pt")["step"] == 6
    assert load_checkpoint(run_dir / "step-00000004.pt")["step"] == 4  # rewritten, sound again


def test_resume_checkpoint_must_belong_to_the_run(
    tiny_data_dir: Path, tmp_path: Path, run_cli, narrow_console: int
) -> None:
    run_dir = tiny_run(tiny_data_dir, tmp_path / LONG / "run", "training.max_steps=6", steps=2)
    elsewhere = tmp_path / "elsewhere.pt"
    shutil.copyfile(run_dir / "latest.pt", elsewhere)
    run_cli("resume", run_dir, "--checkpoint", elsewhere).assert_refused(
        "--checkpoint must be a checkpoint of this run"
    )


def test_a_checkpoint_without_checksum_still_resumes_with_a_warning(
    tiny_data_dir: Path, tmp_path: Path, run_cli, narrow_console: int
) -> None:
    run_dir = tiny_run(tiny_data_dir, tmp_path / LONG / "run", "training.max_steps=6", steps=2)
    legacy = load_checkpoint(run_dir / "latest.pt")
    del legacy[CHECKSUM_KEY]
    (run_dir / "latest.pt").unlink()  # keep step-00000002.pt as it is
    torch.save(legacy, run_dir / "latest.pt")
    with pytest.warns(UnverifiedCheckpointWarning, match="saved without a checksum"):
        assert load_checkpoint(run_dir / "latest.pt")["step"] == 2

    result = run_cli("resume", run_dir, "--max-run-steps", "2", "--json")
    assert result.exit_code == 0, result.stderr
    warning = f"warning: {run_dir / 'latest.pt'}: saved without a checksum (by an older dlm), so it is loaded"
    warning += " unverified"
    assert warning in result.stderr.splitlines()
    assert CHECKSUM_KEY in load_checkpoint(run_dir / "latest.pt")  # new saves carry one


# ----------------------------------------------------------------------------------- data identity


def halve_packed_split(bin_path: Path) -> None:
    """Replace a packed split by its first half, metadata consistent (what a re-pack would do)."""

    meta_path = bin_path.with_suffix(".json")
    metadata = json.loads(meta_path.read_text())
    blocks = metadata["num_blocks"] // 2
    size = blocks * metadata["seq_len"] * (2 if metadata["dtype"] == "uint16" else 4)
    bin_path.write_bytes(bin_path.read_bytes()[:size])
    meta_path.write_text(json.dumps({**metadata, "num_blocks": blocks, "num_tokens": blocks * metadata["seq_len"]}))


def test_resume_on_replaced_data_is_refused_unless_allowed(
    tiny_data_dir: Path, tmp_path: Path, run_cli, narrow_console: int
) -> None:
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    run_dir = tiny_run(data, tmp_path / LONG / "run", "training.max_steps=6", steps=2)
    recorded = load_checkpoint(run_dir / "latest.pt")["data_sha256"]
    halve_packed_split(data / "train.bin")
    before = snapshot(run_dir)

    run_cli("resume", run_dir, "--json").assert_refused(
        "the train data is not the data this run was trained on", "--allow-data-change"
    )
    assert snapshot(run_dir) == before

    result = run_cli("resume", run_dir, "--max-run-steps", "2", "--allow-data-change", "--json")
    assert result.exit_code == 0, result.stderr
    start = events(run_dir, "start")[-1]
    assert start["data_changed"] is True and start["training_blocks"] < events(run_dir, "start")[0]["training_blocks"]
    now = load_checkpoint(run_dir / "latest.pt")["data_sha256"]
    assert now["val"] == recorded["val"] and now["train"] != recorded["train"]
    # The run now records the new data: resuming on it needs no flag.
    result = run_cli("resume", run_dir, "--json")
    assert result.exit_code == 0, result.stderr
    assert events(run_dir, "start")[-1]["data_changed"] is False


# ----------------------------------------------------------------------------------- full disk


def _limit_file_size(limit: int) -> None:
    # SIGXFSZ ignored: a write past the limit fails with EFBIG, as on a full disk, instead of killing.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def run_limited(limit: int, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """`dlm ARGS` in a child process that cannot write files larger than `limit` bytes."""

    return subprocess.run(
        [sys.executable, "-m", "dlm", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: _limit_file_size(limit),
        env={**os.environ, "COLUMNS": "80"},
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_disk_full_while_saving_a_checkpoint_keeps_latest(tiny_data_dir: Path, tmp_path: Path) -> None:
    run_dir = tiny_run(tiny_data_dir, tmp_path / LONG / "run", "training.max_steps=6", steps=2)
    latest = (run_dir / "latest.pt").read_bytes()

    result = run_limited(len(latest) // 2, "resume", run_dir, "--json")
    assert_one_error_line(
        result, f"{run_dir}: could not write step-00000004.pt: File too large", f"dlm resume {run_dir}"
    )
    assert (run_dir / "latest.pt").read_bytes() == latest
    assert load_checkpoint(run_dir / "latest.pt")["step"] == 2
    assert step_files(run_dir) == ["step-00000002.pt"]
    assert not temporaries(run_dir)


def test_run_dir_owns_the_layout_and_what_a_resume_continues(tiny_data_dir: Path, tmp_path: Path) -> None:
    from dlm.artifacts.run_dir import RunDir, load_run

    run_dir = tiny_run(tiny_data_dir, tmp_path / "run", "training.max_steps=6", steps=4)
    run = RunDir(run_dir)
    assert [path.name for path in (run.config, run.metrics, run.latest, run.inference, run.eval_report)] == [
        "config.json",
        "metrics.jsonl",
        "latest.pt",
        "inference-latest.pt",
        "eval.json",
    ]
    assert run.checkpoints() == [(2, run.step_checkpoint(2)), (4, run.step_checkpoint(4))]
    assert run.resume_checkpoint() == run.latest
    assert run.resume_checkpoint(Path("step-00000002.pt")) == run.step_checkpoint(2)

    moved = shutil.move(run_dir, tmp_path / "moved")
    experiment, source = load_run(Path(moved), overrides=["training.max_steps=8"])
    assert experiment.training.output_dir == Path(moved).absolute() and experiment.training.max_steps == 8
    assert source == RunDir(Path(moved)).latest
    with pytest.raises(UserError, match=r"training\.output_dir cannot be set"):
        load_run(Path(moved), overrides=[f"training.output_dir = {tmp_path}"])
    with pytest.raises(UserError, match=r"missing config\.json"):
        load_run(tmp_path)


def test_a_resume_may_change_the_seed_with_a_warning_but_not_where_the_run_started(
    tiny_data_dir: Path, tmp_path: Path, run_cli, narrow_console: int
) -> None:
    """A new seed on resume is allowed (a way past a loss spike) and said: from there on the run's noise
    and data order follow it. A new init_from is refused: a resumed run's weights are its checkpoint's."""

    from dlm.artifacts.export import export_model

    run_dir = tiny_run(tiny_data_dir, tmp_path / LONG / "run", "training.max_steps=8", steps=4)
    seed = json.loads((run_dir / "config.json").read_text())["training"]["seed"]
    model = export_model(run_dir, tmp_path / "model")
    before = snapshot(run_dir)
    run_cli("resume", run_dir, "--set", f"training.init_from={model}", "--json").assert_refused(
        f"training.init_from is {model} but the run started from None",
        "a resumed run's weights come from its checkpoint",
    )
    assert snapshot(run_dir) == before
    same = run_cli("resume", run_dir, "--set", f"training.seed={seed}", "--max-run-steps", "2", "--json")
    assert same.exit_code == 0 and "warning" not in same.stderr, same.stderr
    changed = run_cli("resume", run_dir, "--set", f"training.seed={seed + 1}", "--json")
    assert changed.exit_code == 0, changed.stderr
    said = " ".join(changed.stderr.split())
    assert f"warning: training.seed is {seed + 1} but the run was trained with {seed}" in said
    assert "no longer resumes bit for bit" in said
    assert events(run_dir, "complete")[-1]["step"] == 8
