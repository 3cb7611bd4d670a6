"""Shared fixtures: a tiny tokenizer and a tiny packed dataset (built once per test run), and a
way to run the real CLI entry point in-process."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dlm.assets import shakespeare_files
from dlm.data.pack import pack_corpus
from dlm.data.tokenizer import train_tokenizer

# Tiny models gain nothing from intra-op threads, and OpenMP threads that spin while other
# processes (DataLoader workers, CLI subprocesses, a busy machine) hold the cores make a step
# ~20x slower. One thread per process keeps the suite fast; children inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

TINY_VOCAB_SIZE = 512  # configs/tiny.toml: model.vocab_size
TINY_SEQ_LEN = 64  # configs/tiny.toml: model.max_seq_len


def tiny_train_files() -> list[Path]:
    return shakespeare_files("train")[:4]


def tiny_val_files() -> list[Path]:
    return shakespeare_files("val")[:1]


def pytest_runtest_setup(item: pytest.Item) -> None:
    # bitsandbytes comes with the `gpu` extra only; the README installs `.[dev]`, where these
    # tests must skip, not fail. The import runs before any fixture, so a skip costs nothing.
    if item.get_closest_marker("bitsandbytes") is not None:
        pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install -e '.[gpu]')")


@pytest.fixture(scope="session")
def tiny_corpus() -> dict[str, list[Path]]:
    """The bundled files behind the tiny fixtures: 4 training works (~0.2 MB) and Hamlet."""

    return {"train": tiny_train_files(), "val": tiny_val_files()}


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 512-token byte-level BPE (ids: eos 0, mask 1, pad 2) trained on `tiny_train_files()`."""

    path = tmp_path_factory.mktemp("tiny-tokenizer") / "tokenizer.json"
    train_tokenizer(tiny_train_files(), TINY_VOCAB_SIZE, path)
    return path


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_path: Path) -> Path:
    """tokenizer.json, train.bin/json (4 works) and val.bin/json (Hamlet) at seq_len 64."""

    output = tmp_path_factory.mktemp("tiny-data")
    pack_corpus(
        tiny_train_files(),
        tiny_tokenizer_path,
        TINY_SEQ_LEN,
        output,
        val_inputs=tiny_val_files(),
        overwrite=True,
    )
    return output


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str

    def assert_refused(self, *fragments: str) -> None:
        """A user error: exit 2, one `error:` line holding every fragment, and no traceback."""

        assert self.exit_code == 2, (self.stdout, self.stderr)
        lines = self.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), self.stderr
        assert "Traceback" not in self.stderr + self.stdout
        for fragment in fragments:
            assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def narrow_console(monkeypatch: pytest.MonkeyPatch) -> int:
    """The CLI's human output rendered 80 columns wide, whatever terminal runs the tests."""

    from rich.console import Console

    import dlm.cli
    from dlm.cli import bench_cmd, common, data_cmd, demo_cmd, demo_view, eval_cmd, export_cmd, sample_cmd, train_cmd

    width = 80
    # Each module holds its own reference to the shared consoles (`from common import console`).
    modules = (common, data_cmd, train_cmd, eval_cmd, export_cmd, bench_cmd, sample_cmd, demo_cmd, demo_view)
    for module in (dlm.cli, *modules):
        if hasattr(module, "console"):
            monkeypatch.setattr(module, "console", Console(width=width))
        if hasattr(module, "err_console"):
            monkeypatch.setattr(module, "err_console", Console(width=width, stderr=True))
    return width


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run `dlm ARGS...` through `dlm.cli.main`, the console-script entry point, in-process."""

    from dlm.cli import main

    def run(*args: str | Path) -> CliResult:
        capsys.readouterr()
        try:
            main([str(arg) for arg in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        sys.stdout.flush()
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
