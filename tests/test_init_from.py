"""`dlm train --init-from MODEL`: weights only, refusals, and exact resume of such a run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CliResult
from helpers import ROOT, tiny_experiment, train_tiny_run

from dlm.artifacts.checkpoint import load_checkpoint, save_inference_checkpoint
from dlm.artifacts.events import Event, StartEvent
from dlm.train.loop import train
from dlm.train.step import LogWindow, TrainingStep

SETTINGS = (
    "training.max_steps=6",
    "training.warmup_steps=1",
    "training.save_interval=100",
    "training.eval_interval=100",
    "training.log_interval=1",
)


@pytest.fixture(scope="module")
def source_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_data_dir, tmp_path_factory.mktemp("source") / "run")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return {name: tensor.float() for name, tensor in load_checkpoint(path)["model"].items()}


def test_the_first_step_starts_from_the_source_weights_with_a_new_optimizer(
    tiny_data_dir: Path, source_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[dict[str, torch.Tensor], int, int]] = []
    original = TrainingStep.optimizer_step

    def record(self: TrainingStep, batches: Iterator[torch.Tensor], window: LogWindow) -> None:
        if not seen:
            state = {name: t.detach().clone() for name, t in self.model.state_dict().items()}
            seen.append((state, len(self.optimizer.state), self.counters.step))
        original(self, batches, window)

    monkeypatch.setattr(TrainingStep, "optimizer_step", record)
    events: list[Event] = []
    source = source_run / "latest.pt"
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run", *SETTINGS, f"training.init_from={source}")
    result = train(experiment, sink=events.append)
    assert result.status == "complete" and result.step == 6
    first, optimizer_entries, step = seen[0]
    assert step == 0 and optimizer_entries == 0  # new counters and a new optimizer
    expected = _weights(source)
    assert first.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(first[name], tensor), name
    start = next(e for e in events if isinstance(e, StartEvent))
    assert start.init_from == str(source.resolve())


def test_resume_of_a_fine_tuning_run_is_exact_and_never_reads_the_source(
    tiny_data_dir: Path, source_run: Path, tmp_path: Path
) -> None:
    source = tmp_path / "source.pt"
    source.write_bytes((source_run / "latest.pt").read_bytes())
    straight = train(tiny_experiment(tiny_data_dir, tmp_path / "straight", *SETTINGS, f"training.init_from={source}"))
    split = tiny_experiment(tiny_data_dir, tmp_path / "split", *SETTINGS, f"training.init_from={source}")
    paused = train(split, max_run_steps=3)
    assert paused.status == "paused"
    source.unlink()  # a resume restores the run's own checkpoint: the source is not needed any more
    resumed = train(split, resume=paused.checkpoint)
    assert resumed.status == "complete" and resumed.step == 6
    a, b = _weights(straight.checkpoint), _weights(resumed.checkpoint)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _train_cli(run_cli: Callable[..., CliResult], data: Path, run: Path, source: Path, *extra: str) -> CliResult:
    overrides = [
        f"training.tokenizer={data / 'tokenizer.json'}",
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}",
        f"training.output_dir={run}",
        *SETTINGS,
        *extra,
    ]
    sets = [item for value in overrides for item in ("--set", value)]
    return run_cli("train", "--config", ROOT / "configs" / "tiny.toml", *sets, "--init-from", source, "--json")


def test_a_different_tokenizer_is_refused_naming_both(
    tiny_data_dir: Path, source_run: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    inference: dict[str, Any] = load_checkpoint(source_run / "inference-latest.pt")
    metadata = {k: v for k, v in inference.items() if k not in ("format", "model", "payload_sha256")}
    metadata["tokenizer_sha256"] = "ab" * 32
    save_inference_checkpoint(tmp_path / "other", inference["model"], metadata)
    result = _train_cli(run_cli, tiny_data_dir, tmp_path / "run", tmp_path / "other" / "inference-latest.pt")
    result.assert_refused("--init-from", "tokenizer sha256 abababababab", "this run uses")
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_different_shape_is_refused_naming_both(
    tiny_data_dir: Path, source_run: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    result = _train_cli(run_cli, tiny_data_dir, tmp_path / "run", source_run / "latest.pt", "model.n_layers=3")
    result.assert_refused("--init-from", "n_layers=2", "n_layers=3")


def _other_vocabulary(tmp_path: Path, source_run: Path) -> tuple[Path, tuple[str, ...]]:
    inference: dict[str, Any] = load_checkpoint(source_run / "inference-latest.pt")
    metadata = {k: v for k, v in inference.items() if k not in ("format", "model", "payload_sha256")}
    metadata["tokenizer_sha256"] = "ab" * 32  # trained with another tokenizer: its ids mean other tokens
    path = save_inference_checkpoint(tmp_path / "other", inference["model"], metadata)
    return path, ("tokenizer sha256 abababababab",)


def _not_a_model(tmp_path: Path, source_run: Path) -> tuple[Path, tuple[str, ...]]:
    path = tmp_path / "notes.txt"
    path.write_text("not a model")
    return path, ("not a dlm checkpoint",)


REFUSED_SOURCES: dict[str, Callable[[Path, Path], tuple[Path, tuple[str, ...]]]] = {
    "another vocabulary": _other_vocabulary,
    "another shape": lambda tmp, run: (run / "latest.pt", ("--init-from", "d_model=64", "d_model=128")),
    "not a model": _not_a_model,
    "a missing path": lambda tmp, run: (tmp / "missing.pt", ("checkpoint not found",)),
}
OVERRIDES = {"another shape": ("model.d_model=128",)}


@pytest.mark.parametrize("case", list(REFUSED_SOURCES))
def test_a_refused_source_leaves_no_run_directory(
    tiny_data_dir: Path, source_run: Path, tmp_path: Path, run_cli: Callable[..., CliResult], case: str
) -> None:
    source, fragments = REFUSED_SOURCES[case](tmp_path, source_run)
    output = tmp_path / "runs" / "new"
    result = _train_cli(run_cli, tiny_data_dir, output, source, *OVERRIDES.get(case, ()))
    result.assert_refused(str(source), *fragments)
    assert not (tmp_path / "runs").exists()  # neither the run directory, its .lock, nor its parent


@pytest.fixture(scope="module")
def block_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_data_dir, tmp_path_factory.mktemp("block") / "run", "model.block_size=4")


@pytest.mark.parametrize(
    ("source_blocks", "run_blocks", "said"),
    [
        (4, "0", "a block diffusion model (block_size 4); this run trains it as a whole-sequence model (block_size 0)"),
        (0, "4", "a whole-sequence model (block_size 0); this run trains it as a block diffusion model (block_size 4)"),
        (
            0,
            "1",
            "a whole-sequence model (block_size 0); this run trains it as a block diffusion model of one-token "
            "blocks (block_size 1)",
        ),
        (
            0,
            "1,causal",
            "a whole-sequence model (block_size 0); this run trains it as an autoregressive model "
            "(block_size 1, causal attention: one pass)",
        ),
        (4, "4", None),
        (0, "64", None),  # one block of the whole sequence is the whole sequence
    ],
)
def test_a_change_of_attention_blocks_is_said_and_trained(
    tiny_data_dir: Path,
    source_run: Path,
    block_run: Path,
    tmp_path: Path,
    run_cli: Callable[..., CliResult],
    source_blocks: int,
    run_blocks: str,
    said: str | None,
) -> None:
    source = (block_run if source_blocks else source_run) / "latest.pt"
    blocks, _, attention = run_blocks.partition(",")
    settings = [f"model.block_size={blocks}"] + ([f"model.attention={attention}"] if attention else [])
    result = _train_cli(run_cli, tiny_data_dir, tmp_path / "run", source, *settings)
    assert result.exit_code == 0, result.stderr
    expected = (
        []
        if said is None
        else [
            f"warning: --init-from: {source} was trained as {said} (the weights fit: "
            "only what each position attends to changes)"
        ]
    )
    assert result.stderr.splitlines() == expected
    assert load_checkpoint(tmp_path / "run" / "latest.pt")["step"] == 6
