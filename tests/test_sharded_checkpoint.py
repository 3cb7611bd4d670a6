"""Sharded checkpoints (torch.distributed.checkpoint) on one process: layout, exact resume,
checksums, incomplete saves, asynchronous saves and a full disk, export of a sharded checkpoint.

The multi-process cases (resharding 2 -> 1 and 1 -> 2, two torchrun nodes, kill -9 mid-save) are
in tests/test_sharded_distributed.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import tiny_experiment

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.loading import load_model, read_model_source
from dlm.artifacts.run_dir import RunDir
from dlm.artifacts.sharded_checkpoint import (
    MARKER_NAME,
    IncompleteCheckpointNote,
    complete_checkpoints,
    read_marker,
    read_sharded_weights,
)
from dlm.config.schema import ExperimentConfig, load_config
from dlm.errors import UserError
from dlm.train.checkpointing import flatten_rank_state, rank_share, unflatten_rank_state
from dlm.train.loop import train
from dlm.train.stop import SignalStop

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


def tiny(data_dir: Path, run_dir: Path, *overrides: str) -> ExperimentConfig:
    return tiny_experiment(
        data_dir,
        run_dir,
        f"training.max_steps={STEPS}",
        "training.warmup_steps=1",
        "training.log_interval=1",
        "training.save_interval=2",
        "training.eval_interval=2",
        "training.eval_batches=1",
        "training.batch_size=4",
        "training.ema_decay=0.9",
        "training.keep_last_checkpoints=0",
        *overrides,
    )


def losses(run_dir: Path) -> list[tuple[str, int, float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(e["event"], e["step"], e["loss"]) for e in lines if e["event"] in ("train", "validation")]


@pytest.fixture(scope="module")
def runs(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A single-file run and a sharded run, both straight to step 4 (saves at 2 and 4)."""

    root = tmp_path_factory.mktemp("sharded")
    train(tiny(tiny_data_dir, root / "single"))
    train(tiny(tiny_data_dir, root / "dcp", "training.checkpoint_format=dcp"))
    return {"single": root / "single", "dcp": root / "dcp", "data": tiny_data_dir}


def test_the_layout_of_a_sharded_run(runs: dict[str, Path]) -> None:
    run = runs["dcp"]
    assert sorted(path.name for path in run.iterdir()) == [
        ".lock",
        "config.json",
        "latest",
        "metrics.jsonl",
        "step-00000002",
        "step-00000004",
    ]
    assert os.readlink(run / "latest") == "step-00000004"
    marker = json.loads((run / "step-00000004" / MARKER_NAME).read_text())
    assert marker["step"] == STEPS and marker["world_size"] == 1 and marker["ema"]["num_updates"] == STEPS
    assert set(marker["files"]) == {".metadata", "__0_0.distcp"}
    assert RunDir(run).latest_checkpoint() == run / "latest"


def test_sharded_and_single_runs_train_identically(runs: dict[str, Path]) -> None:
    assert losses(runs["dcp"]) == losses(runs["single"])
    single = load_checkpoint(runs["single"] / "latest.pt")
    _, live, kind = read_sharded_weights(runs["dcp"] / "latest", use_ema=False)
    assert kind == "live" and live.keys() == single["model"].keys()
    assert all(torch.equal(live[name], single["model"][name]) for name in live)
    _, ema, kind = read_sharded_weights(runs["dcp"] / "latest")
    assert kind == "ema"
    assert all(torch.equal(ema[name], single["ema"]["shadow"][name]) for name in single["ema"]["shadow"])


def test_resume_from_a_sharded_checkpoint_is_exact(runs: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["dcp"], run, symlinks=True)
    (run / "metrics.jsonl").unlink()
    result = train(tiny(runs["data"], run, "training.checkpoint_format=dcp"), resume=run / "step-00000002")
    assert result.status == "complete" and result.checkpoint == run / "step-00000004"
    assert losses(run) == [loss for loss in losses(runs["dcp"]) if loss[1] > 2]
    _, resumed, _ = read_sharded_weights(run / "latest", use_ema=False)
    _, straight, _ = read_sharded_weights(runs["dcp"] / "latest", use_ema=False)
    assert all(torch.equal(resumed[name], straight[name]) for name in straight)


def test_a_single_file_run_resumes_into_sharded_checkpoints(runs: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["single"], run)
    experiment = tiny(runs["data"], run, "training.checkpoint_format=dcp", "training.max_steps=6")
    result = train(experiment, resume=run / "step-00000004.pt")
    assert result.checkpoint == run / "step-00000006"
    assert RunDir(run).latest_checkpoint() == run / "latest"  # newer than latest.pt (step 4)
    info, weights = read_model_source(run)
    assert info.step == 6 and info.weights == "ema" and weights


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_exports_of_both_formats_are_identical(
    runs: dict[str, Path], tmp_path: Path, run_cli: Callable[..., Any], dtype: str
) -> None:
    # The sharded one is streamed into model.safetensors tensor by tensor, the other written whole.
    for name in ("single", "dcp"):
        source = runs[name] / ("latest.pt" if name == "single" else "step-00000004")
        assert run_cli("export", source, "--output", tmp_path / name, "--dtype", dtype).exit_code == 0
    from safetensors.torch import load_file

    left = load_file(str(tmp_path / "single" / "model.safetensors"))
    right = load_file(str(tmp_path / "dcp" / "model.safetensors"))
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)
    assert all(tensor.dtype == getattr(torch, dtype) for tensor in right.values())
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("single", "dcp")]
    assert configs[0]["parameters"] == configs[1]["parameters"] and configs[1]["weights"] == "ema"
    model, _ = load_model(tmp_path / "dcp")
    assert model.num_parameters == configs[1]["parameters"]


def test_a_missing_or_foreign_shard_names_itself_and_the_older_checkpoint(
    runs: dict[str, Path], tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["dcp"], run, symlinks=True)
    newest = run / "step-00000004"
    shutil.copy(run / "step-00000002" / "__0_0.distcp", newest / "__0_0.distcp")  # a shard of another save
    result = run_cli("export", newest, "--output", tmp_path / "export")
    assert result.exit_code == 2
    assert result.stderr.count("error:") == 1
    assert "__0_0.distcp" in result.stderr and "another run" in result.stderr
    assert "step-00000002" in result.stderr
    (newest / "__0_0.distcp").unlink()
    with pytest.raises(UserError, match=r"shard __0_0.distcp of this checkpoint is missing.*step-00000002"):
        train(tiny(runs["data"], run, "training.checkpoint_format=dcp"), resume=newest)


@pytest.mark.parametrize("foreign", ["unlisted metadata", "extra file"])
def test_a_step_directory_with_files_dlm_did_not_vouch_for_is_refused(
    runs: dict[str, Path], tmp_path: Path, foreign: str
) -> None:
    # DCP's .metadata is a pickle: it is read only when the marker lists it with its sha256, and a
    # file the marker does not list (a pickled payload dropped beside the shards) is refused too.
    run = tmp_path / "run"
    shutil.copytree(runs["dcp"], run, symlinks=True)
    newest = run / "step-00000004"
    marker = newest / MARKER_NAME
    (newest / ".DS_Store").write_bytes(b"a file browser's")  # never read by DCP: no reason to refuse
    if foreign == "extra file":
        (newest / "__9_0.distcp").write_bytes(b"not ours")
        message = r"__9_0\.distcp is not listed in dlm-checkpoint\.json: this step directory holds files dlm did not"
    else:
        record = json.loads(marker.read_text())
        del record["files"][".metadata"]
        marker.write_text(json.dumps(record))
        message = r"\.metadata is not listed in dlm-checkpoint\.json: this step directory holds files dlm did not"
    with pytest.raises(UserError, match=message):
        read_marker(newest)
    with pytest.raises(UserError, match=message):
        train(tiny(runs["data"], run, "training.checkpoint_format=dcp"), resume=newest)
    assert read_marker(run / "step-00000002")["step"] == 2
    (run / "step-00000002" / ".DS_Store").write_bytes(b"")
    assert read_marker(run / "step-00000002")["step"] == 2


def test_an_incomplete_save_is_ignored_and_removed_with_a_note(runs: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["dcp"], run, symlinks=True)
    half = run / "step-00000006"
    shutil.copytree(run / "step-00000004", half)
    (half / MARKER_NAME).unlink()  # as a save killed before its marker
    assert RunDir(run).latest_checkpoint() == run / "latest" and os.readlink(run / "latest") == "step-00000004"
    with pytest.raises(UserError, match=r"incomplete checkpoint.*step-00000004"):
        train(tiny(runs["data"], run, "training.checkpoint_format=dcp"), resume=half)
    experiment = tiny(runs["data"], run, "training.checkpoint_format=dcp", "training.max_steps=6")
    with pytest.warns(IncompleteCheckpointNote, match="step-00000006"):
        result = train(experiment, resume=run / "latest")
    assert result.step == 6 and (half / MARKER_NAME).is_file()  # written again, completely this time


def test_async_saves_complete_and_equal_synchronous_ones(runs: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "async"
    result = train(tiny(runs["data"], run, "training.async_checkpoint=true"))
    assert result.checkpoint == run / "step-00000004" and (result.checkpoint / MARKER_NAME).is_file()
    assert [step for step, _ in complete_checkpoints(run)] == [2, 4]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saved = [(e["step"], e["path"]) for e in lines if e["event"] == "checkpoint"]
    assert saved == [(2, str(run / "step-00000002")), (4, str(run / "step-00000004"))]  # each once complete
    for step in (2, 4):
        _, got, _ = read_sharded_weights(run / f"step-{step:08d}")
        _, want, _ = read_sharded_weights(runs["dcp"] / f"step-{step:08d}")
        assert all(torch.equal(got[name], want[name]) for name in want)


def test_async_saves_of_a_run_stage_into_the_same_cpu_buffers(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dlm.train.checkpointing as checkpointing

    reusing_stager = checkpointing.reusing_stager
    if reusing_stager() is None:
        pytest.skip("this torch has no reusable stager for asynchronous saves (torch < 2.9)")
    stagers: list[Any] = []
    addresses: list[dict[str, int]] = []  # each save: where every model tensor was staged

    def recording_stager() -> Any:
        stager = reusing_stager()
        stage = stager.stage

        def staged(state_dict: dict[str, Any], **options: Any) -> Any:
            copy = stage(state_dict, **options)
            addresses.append({key: value.data_ptr() for key, value in copy.items() if key.startswith("model.")})
            return copy

        stager.stage = staged
        stagers.append(stager)
        return stager

    monkeypatch.setattr(checkpointing, "reusing_stager", recording_stager)
    run = tmp_path / "async"
    assert train(tiny(runs["data"], run, "training.async_checkpoint=true")).step == 4
    assert len(stagers) == 1 and len(addresses) == 2 and addresses[0]  # one stager, two saves
    assert addresses[0] == addresses[1]  # the second save allocated no new buffers
    _, got, _ = read_sharded_weights(run / "step-00000004")  # and still wrote step 4's values
    _, want, _ = read_sharded_weights(runs["dcp"] / "step-00000004")
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_a_full_disk_during_an_async_save_stops_cleanly(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint.filesystem as filesystem

    def write_files(self: object, plan: object, planner: object) -> object:
        if "step-00000004" in str(getattr(self, "path", "")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original_write(self, plan, planner)

    original_write = filesystem._FileSystemWriter.write_data
    monkeypatch.setattr(filesystem._FileSystemWriter, "write_data", write_files)
    run = tmp_path / "full"
    # The save of step 4 fails in the background; the run stops at the next check (after step 5,
    # or at the latest as step 6's save waits for it) instead of training on without checkpoints.
    with pytest.raises(UserError, match=r"step-00000004: No space left on device.*step-00000002 is kept"):
        train(tiny(runs["data"], run, "training.async_checkpoint=true", "training.max_steps=6"))
    assert [step for step, _ in complete_checkpoints(run)] == [2]
    assert os.readlink(run / "latest") == "step-00000002" and not (run / "step-00000006").exists()


def test_each_replicated_tensor_is_saved_by_one_rank_with_the_bytes_balanced() -> None:
    # DDP's tensors are whole on every rank: an asynchronous save stages only this rank's share of them.
    sizes = {"embedding": 1000, "head": 900, "norm": 10, "a": 300, "b": 300, "c": 290, "d": 5}
    tensors = {name: torch.zeros(size) for name, size in sizes.items()}
    shares = [rank_share(tensors, rank, 3) for rank in range(3)]
    assert sorted(name for share in shares for name in share) == sorted(sizes)  # each exactly once
    loads = [sum(tensor.numel() for tensor in share.values()) for share in shares]
    assert max(loads) == 1000 and sum(loads) == sum(sizes.values())  # no rank holds more than the largest
    assert rank_share(tensors, 0, 1) == tensors


def test_rank_state_round_trips_through_tensors() -> None:
    from dlm.runtime.rng import capture_rng_state

    state = {"rng": capture_rng_state(torch.device("cpu")), "data_generator": torch.Generator().get_state()}
    flat = flatten_rank_state(state, "rank3.")
    assert all(isinstance(value, torch.Tensor) and key.startswith("rank3.") for key, value in flat.items())
    back = unflatten_rank_state(flat, "rank3.")
    assert back["rng"]["python"]["version"] == state["rng"]["python"]["version"]
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert torch.equal(back["data_generator"], state["data_generator"])
    assert back["rng"]["numpy"]["pos"] == state["rng"]["numpy"]["pos"]


def test_checkpoint_format_auto_resolves_by_parallelism_and_world_size() -> None:
    from dlm.config.schema import TrainingConfig

    assert TrainingConfig().resolved_checkpoint_format(1) == "single"
    assert TrainingConfig(parallelism="fsdp").resolved_checkpoint_format(1) == "single"
    assert TrainingConfig(parallelism="fsdp").resolved_checkpoint_format(2) == "dcp"
    assert TrainingConfig(parallelism="ddp").resolved_checkpoint_format(2) == "single"
    assert TrainingConfig(async_checkpoint=True).resolved_checkpoint_format(1) == "dcp"
    assert TrainingConfig(checkpoint_format="single", parallelism="fsdp").resolved_checkpoint_format(2) == "single"
    with pytest.raises(ValueError, match="async_checkpoint"):
        TrainingConfig(checkpoint_format="single", async_checkpoint=True)


def test_checkpoint_estimates_of_both_formats() -> None:
    from dlm.train.memory import checkpoint_state_bytes, estimate_checkpoints

    experiment = load_config(ROOT / "configs" / "tiny.toml", ["training.parallelism=fsdp", "training.ema_decay=0.9"])
    total = checkpoint_state_bytes(experiment)
    assert total == 16 * experiment_parameters(experiment)  # weights, two AdamW moments, EMA: float32
    single, sharded, asynchronous = estimate_checkpoints(experiment, 4)
    assert (single.bytes_per_rank, single.rank0_host_bytes) == (total, total)  # gathered on rank 0
    assert sharded.bytes_per_rank == asynchronous.rank0_host_bytes == -(-total // 4) and sharded.rank0_host_bytes == 0
    alone = estimate_checkpoints(experiment, 1)[0]
    assert alone.rank0_host_bytes == 0  # one process writes its tensors in place


def experiment_parameters(experiment: ExperimentConfig) -> int:
    from dlm.config.shapes import count_parameters

    return count_parameters(experiment.model)


@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shard write takes 0.3 s longer, so that an asynchronous save is still in flight when
    the run ends; what is checked is that it completes all the same."""

    import time

    import torch.distributed.checkpoint.filesystem as filesystem

    original = filesystem._FileSystemWriter.write_data

    def write_data(self: object, plan: object, planner: object) -> object:
        time.sleep(0.3)
        return original(self, plan, planner)  # type: ignore[arg-type]

    monkeypatch.setattr(filesystem._FileSystemWriter, "write_data", write_data)


def _after_step(step: int, action: Callable[[], None], monkeypatch: pytest.MonkeyPatch) -> None:
    from dlm.train.step import TrainingStep

    original = TrainingStep.optimizer_step

    def step_then_act(self: TrainingStep, batches: object, window: object) -> None:
        original(self, batches, window)  # type: ignore[arg-type]
        if self.counters.step == step:
            action()

    monkeypatch.setattr(TrainingStep, "optimizer_step", step_then_act)


@pytest.mark.usefixtures("slow_writes")
def test_ctrl_c_waits_for_the_async_save_in_flight(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _after_step(3, lambda: os.kill(os.getpid(), signal.SIGINT), monkeypatch)
    run = tmp_path / "run"
    result = train(tiny(runs["data"], run, "training.async_checkpoint=true"))
    assert (result.status, result.step) == ("interrupted", 3)
    assert [step for step, _ in complete_checkpoints(run)] == [2, 3]  # the final save, complete on return
    assert os.readlink(run / "latest") == "step-00000003"


@pytest.mark.usefixtures("slow_writes")
def test_a_second_ctrl_c_still_lets_the_save_in_flight_complete(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def second_signal() -> None:
        raise SignalStop(signal.SIGINT)  # what the handler raises in the main thread

    _after_step(3, second_signal, monkeypatch)
    run = tmp_path / "run"
    with pytest.raises(SignalStop):
        train(tiny(runs["data"], run, "training.async_checkpoint=true"))
    assert [step for step, _ in complete_checkpoints(run)] == [2]  # started at step 2, finished before exit


def test_a_sharded_run_is_refused_unless_overwritten(runs: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["dcp"], run, symlinks=True)
    experiment = tiny(runs["data"], run, "training.checkpoint_format=single", "training.max_steps=2")
    with pytest.raises(UserError, match=r"already holds a run .*latest.*step-00000002.*dlm resume"):
        train(experiment)
    train(experiment, overwrite=True)
    assert sorted(path.name for path in run.iterdir()) == [
        ".lock",
        "config.json",
        "inference-latest.pt",
        "latest.pt",
        "metrics.jsonl",
        "step-00000002.pt",
    ]


@pytest.mark.parametrize(
    "variant",
    [
        ("model.n_kv_heads=1", "model.qkv_bias=true", "model.qk_norm=true", "model.tie_embeddings=false"),
        ("model.document_separator_id=0",),
    ],  # dlm's tokenizers end a document with id 0
    ids=["imported-variant", "document-attention"],
)
def test_the_model_variants_save_resume_and_export_sharded(
    tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., Any], variant: tuple[str, ...]
) -> None:
    straight = tiny(tiny_data_dir, tmp_path / "straight", "training.checkpoint_format=dcp", *variant)
    train(straight)
    split = tiny(tiny_data_dir, tmp_path / "split", "training.checkpoint_format=dcp", *variant)
    paused = train(split, max_run_steps=2)
    assert paused.checkpoint == tmp_path / "split" / "step-00000002"
    train(split, resume=paused.checkpoint)
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")
    _, resumed, _ = read_sharded_weights(tmp_path / "split" / "latest")
    _, expected, _ = read_sharded_weights(tmp_path / "straight" / "latest")
    assert resumed.keys() == expected.keys() and all(torch.equal(resumed[k], expected[k]) for k in expected)
    exported = run_cli("export", tmp_path / "split", "--output", tmp_path / "export", "--dtype", "float32")
    assert exported.exit_code == 0, exported.stderr
    model, _ = load_model(tmp_path / "export")
    assert model.config == split.model
    assert all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items())
