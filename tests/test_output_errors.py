"""Writing results fails cleanly: a full disk or an unwritable --output is one `error:` line
(exit 2), an old export survives a failed replacement, and bad command-line text is refused."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import train_tiny_run

import dlm.errors
from dlm.artifacts.export import export_model

LONG = "a-directory-with-a-rather-long-name-" * 3


@pytest.fixture(scope="module")
def run_dir(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_data_dir, tmp_path_factory.mktemp("output-errors") / "run")


def _limit_file_size(limit: int) -> None:
    # SIGXFSZ ignored: a write past the limit fails with EFBIG, as on a full disk, instead of killing.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_disk_full_during_export_keeps_the_old_export(run_dir: Path, tmp_path: Path) -> None:
    output = export_model(run_dir, tmp_path / LONG / "model", dtype="float32")
    before = files(output)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlm",
            "export",
            str(run_dir),
            "--output",
            str(output),
            "--overwrite",
            "--dtype",
            "float32",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: _limit_file_size(100_000),
        env={**os.environ, "COLUMNS": "80"},
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {output}: cannot write the export: ") and "File too large" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert files(output) == before  # replaced only once the new export is complete
    assert [path.name for path in output.parent.iterdir()] == ["model"]  # no half-built directory left


@pytest.fixture
def locked_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory nobody may write in. Root ignores the mode bits, so for root the permission
    check is answered as the kernel would answer any other user."""

    locked = tmp_path / LONG / "locked"
    locked.mkdir(parents=True)
    locked.chmod(0o555)
    if os.geteuid() == 0:
        real_access = os.access

        def access(path: str | Path, mode: int, **kwargs: object) -> bool:
            return not (Path(path) == locked and mode & os.W_OK) and real_access(path, mode, **kwargs)

        monkeypatch.setattr(dlm.errors.os, "access", access)
    yield locked
    locked.chmod(0o755)


def test_export_into_an_unwritable_directory_is_one_error_line(
    run_dir: Path, tmp_path: Path, locked_dir: Path, run_cli, narrow_console: int
) -> None:
    run_cli("export", run_dir, "--output", locked_dir / "model").assert_refused(
        f"{locked_dir / 'model'}: --output: {locked_dir} is not writable"
    )
    a_file = tmp_path / LONG / "a-file"
    a_file.write_text("x")
    run_cli("export", run_dir, "--output", a_file / "model").assert_refused(
        f"{a_file / 'model'}: --output: {a_file} is not a directory"
    )
    assert list(locked_dir.iterdir()) == []


def test_eval_output_into_an_unwritable_directory_is_refused_before_evaluating(
    run_dir: Path, locked_dir: Path, run_cli, narrow_console: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dlm.evaluation.evaluate

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("evaluated although the report could not be written")

    monkeypatch.setattr(dlm.evaluation.evaluate, "evaluate_source", never)
    run_cli("eval", run_dir, "--output", locked_dir / "eval.json").assert_refused(
        f"{locked_dir / 'eval.json'}: --output: {locked_dir} is not writable"
    )


@pytest.mark.parametrize("option", ["--prompt", "--text"])
def test_sample_text_that_is_not_utf8_is_one_error_line(run_dir: Path, option: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dlm", "sample", str(run_dir), option, b"ROMEO \xff\xfe"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {option} is not valid UTF-8 text (at character 7) (pass the text in UTF-8)"
    ]
