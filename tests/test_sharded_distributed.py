"""Sharded checkpoints across processes (gloo on the CPU): resharding 2 -> 1 and 1 -> 2, an exact
resume at equal world size, asynchronous saves completed at exit, kill -9 of a rank mid-save, and
two torchrun agents as two nodes.

Every comparison is against one process at twice the accumulation (the same global batch):
within 1e-5 across world sizes, bit for bit at an equal one.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import tiny_settings

from dlm.artifacts.events import Event, StartEvent
from dlm.artifacts.sharded_checkpoint import (
    MARKER_NAME,
    IncompleteCheckpointNote,
    complete_checkpoints,
    read_marker,
    read_sharded_tensors,
    tensor_entries,
)
from dlm.config.schema import ExperimentConfig, load_config
from dlm.train import checkpointing
from dlm.train.distributed import end_process
from dlm.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5
STEPS = 6
COMMON = (
    f"training.max_steps={STEPS}",
    "training.warmup_steps=1",
    "training.log_interval=1",
    "training.eval_interval=3",
    "training.save_interval=3",
    "training.eval_batches=1",
    "training.ema_decay=0.9",
    "training.keep_last_checkpoints=0",
    "training.batch_size=4",
)
PER_PROCESS = ("training.gradient_accumulation_steps=2", "training.parallelism=fsdp")  # x 2 processes
SINGLE = ("training.gradient_accumulation_steps=4", "training.checkpoint_format=dcp")  # x 1 process
COLLECTIVE_TIMEOUT_S = 120
DEADLINE_S = 900


def settings(data_dir: Path, run_dir: Path, *overrides: str) -> list[str]:
    return tiny_settings(data_dir, run_dir, *COMMON, *overrides)


def tiny(data_dir: Path, run_dir: Path, *overrides: str) -> ExperimentConfig:
    return load_config(ROOT / "configs" / "tiny.toml", settings(data_dir, run_dir, *overrides))


def losses(run_dir: Path) -> list[tuple[str, int, float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(e["event"], e["step"], e["loss"]) for e in lines if e["event"] in ("train", "validation")]


def state(directory: Path) -> dict[str, torch.Tensor]:
    """Every model, optimizer and EMA tensor of a sharded checkpoint, whole."""

    entries = tensor_entries(directory)
    keys = [key for key in entries if key.startswith(("model.", "optim.", "ema."))]
    return read_sharded_tensors(directory, keys, entries)


def assert_same_state(got: Path, want: Path, tolerance: float) -> None:
    left, right = state(got), state(want)
    assert left.keys() == right.keys()
    for key in right:
        if tolerance == 0:
            assert torch.equal(left[key], right[key]), key
        else:
            assert torch.allclose(left[key], right[key], rtol=0, atol=tolerance), key


def assert_close_losses(got: list[tuple[str, int, float]], want: list[tuple[str, int, float]]) -> None:
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert all(abs(g[2] - w[2]) <= TOLERANCE for g, w in zip(got, want, strict=True)), (got, want)


def _join(root: Path, rank: int, world_size: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    torch.set_num_threads(1)
    # Through a file in the test's directory, not a TCP port that another test run could take.
    dist.init_process_group(
        "gloo",
        init_method=(root / "rendezvous").as_uri(),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def _pair(rank: int, world_size: int, data_dir: Path, root: Path) -> None:
    """FSDP on 2 processes with asynchronous saves: straight through, resumed at step 3 of itself
    (same world size), and resumed at step 3 of the 1-process run (1 -> 2); then DDP with sharded
    checkpoints, paused at step 3 and resumed."""

    _join(root, rank, world_size)
    try:
        asynchronous = (*PER_PROCESS, "training.async_checkpoint=true")
        assert train(tiny(data_dir, root / "fsdp", *asynchronous)).step == STEPS
        resumed = train(tiny(data_dir, root / "resumed", *asynchronous), resume=root / "fsdp" / "step-00000003")
        assert resumed.step == STEPS
        grown = train(tiny(data_dir, root / "grown", *PER_PROCESS), resume=root / "single" / "step-00000003")
        assert grown.step == STEPS
        ddp = ("training.gradient_accumulation_steps=2", "training.checkpoint_format=dcp")
        assert train(tiny(data_dir, root / "ddp", *ddp), max_run_steps=3).step == 3
        assert train(tiny(data_dir, root / "ddp", *ddp), resume=root / "ddp").step == STEPS
        _record_staged_bytes(
            root,
            rank,
            lambda: train(tiny(data_dir, root / "ddp-async", *ddp, "training.async_checkpoint=true"), max_run_steps=3),
        )
    finally:
        dist.destroy_process_group()
    end_process(0)


def _record_staged_bytes(root: Path, rank: int, run: Callable[[], object]) -> None:
    """Run `run` with each asynchronous save's tensors counted: the bytes this rank hands DCP to stage."""

    saves: list[int] = []
    stagers: set[int] = set()  # the stager each save was given (none on a torch without one)
    original = checkpointing.dcp.async_save

    def counted(state_dict: dict[str, torch.Tensor], **options: object) -> object:
        saves.append(sum(value.numel() * value.element_size() for value in state_dict.values()))
        if options.get("async_stager") is not None:
            stagers.add(id(options["async_stager"]))
        return original(state_dict, **options)  # type: ignore[arg-type]

    checkpointing.dcp.async_save = counted  # type: ignore[assignment]
    try:
        run()
    finally:
        checkpointing.dcp.async_save = original
    (root / f"staged-{rank}.json").write_text(json.dumps({"bytes": saves, "stagers": len(stagers)}))


def _spawn(worker: object, root: Path, data_dir: Path) -> list[int | None]:
    context = mp.start_processes(worker, args=(2, data_dir, root), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not all(not process.is_alive() for process in context.processes):
            assert time.monotonic() < deadline, "the spawned training processes did not finish in time"
            time.sleep(1)
    finally:
        for process in context.processes:  # a rank stuck in a collective never handles SIGTERM
            if process.is_alive():
                process.kill()
                process.join()
    return [process.exitcode for process in context.processes]


@pytest.fixture(scope="module")
def root(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded-distributed")
    train(tiny(tiny_data_dir, root / "single", *SINGLE))
    assert _spawn(_pair, root, tiny_data_dir) == [0, 0]
    return root


@pytest.mark.slow
def test_two_fsdp_processes_equal_one_with_twice_the_accumulation(root: Path) -> None:
    assert_close_losses(losses(root / "fsdp"), losses(root / "single"))
    assert_same_state(root / "fsdp" / "latest", root / "single" / "latest", TOLERANCE)
    marker = read_marker((root / "fsdp" / "latest").resolve())
    assert marker["world_size"] == 2 and set(marker["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}


@pytest.mark.slow
def test_async_saves_were_completed_before_exit(root: Path) -> None:
    for run in ("fsdp", "resumed"):
        assert [step for step, _ in complete_checkpoints(root / run)] == ([3, 6] if run == "fsdp" else [6])
        assert os.readlink(root / run / "latest") == "step-00000006"


@pytest.mark.slow
def test_resume_at_the_same_world_size_is_bit_exact(root: Path) -> None:
    assert losses(root / "resumed") == [loss for loss in losses(root / "fsdp") if loss[1] > 3]
    assert_same_state(root / "resumed" / "latest", root / "fsdp" / "latest", 0)


@pytest.mark.slow
def test_resume_from_one_process_on_two(root: Path) -> None:
    reference = [loss for loss in losses(root / "single") if loss[1] > 3]
    assert_close_losses(losses(root / "grown"), reference)
    assert_same_state(root / "grown" / "latest", root / "single" / "latest", TOLERANCE)


@pytest.mark.slow
def test_ddp_with_sharded_checkpoints(root: Path) -> None:
    # DDP's replicated tensors: DCP writes each once, spread over the ranks; resumed on 2 processes.
    marker = read_marker((root / "ddp" / "latest").resolve())
    assert marker["world_size"] == 2 and {".metadata", "__0_0.distcp"} <= set(marker["files"])
    assert_close_losses(losses(root / "ddp"), losses(root / "single"))
    assert_same_state(root / "ddp" / "latest", root / "single" / "latest", TOLERANCE)


@pytest.mark.slow
def test_an_asynchronous_ddp_save_stages_each_ranks_share_only(root: Path) -> None:
    # DDP's tensors are whole on every rank; each rank stages only the half it writes (and its RNG state).
    records = [json.loads((root / f"staged-{rank}.json").read_text()) for rank in range(2)]
    staged = [record["bytes"] for record in records]
    whole = sum(tensor.numel() * tensor.element_size() for tensor in state(root / "ddp-async" / "latest").values())
    assert len(staged[0]) == len(staged[1]) >= 1
    # Every save of a rank stages through the same stager, into the buffers of its last save.
    reusable = checkpointing.reusing_stager() is not None
    assert all(record["stagers"] == (1 if reusable else 0) for record in records)
    for first, second in zip(staged[0], staged[1], strict=True):
        assert first + second <= whole + 64 * 1024  # each tensor once, RNG states aside
        assert max(first, second) <= 0.6 * whole


@pytest.mark.slow
def test_resume_from_two_processes_on_one(root: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "shrunk"
    result = train(tiny(tiny_data_dir, run, *SINGLE), resume=root / "fsdp" / "step-00000003")
    assert result.step == STEPS and read_marker(result.checkpoint)["world_size"] == 1
    assert_close_losses(losses(run), [loss for loss in losses(root / "single") if loss[1] > 3])
    assert_same_state(run / "latest", root / "single" / "latest", TOLERANCE)


@pytest.mark.slow
def test_two_processes_resumed_on_one_keep_the_global_batch(root: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    # The run's own config (accumulation 2 on each of 2 processes), as `dlm resume` reads it, on one
    # process: the accumulation is derived as 4, so the run continues as if never interrupted.
    run = tmp_path / "kept"
    events: list[Event] = []
    config = tiny(tiny_data_dir, run, "training.gradient_accumulation_steps=2", "training.checkpoint_format=dcp")
    result = train(config, resume=root / "fsdp" / "step-00000003", sink=events.append)
    start = next(event for event in events if isinstance(event, StartEvent))
    assert start.global_batch == 16 and start.world_size == 1
    assert start.batch_note == "global batch 16 kept on 1 process: gradient accumulation 4 (the run used 2 on 2)"
    assert json.loads((run / "config.json").read_text())["training"]["gradient_accumulation_steps"] == 4
    assert result.step == STEPS and read_marker(result.checkpoint)["world_size"] == 1
    assert_close_losses(losses(run), [loss for loss in losses(root / "fsdp") if loss[1] > 3])
    assert_same_state(run / "latest", root / "fsdp" / "latest", TOLERANCE)


def _killed_mid_save(rank: int, world_size: int, data_dir: Path, root: Path) -> None:
    """Rank 1 dies by SIGKILL while writing its shards of step 6; rank 0 is left in the save."""

    import torch.distributed.checkpoint.filesystem as filesystem

    _join(root, rank, world_size)
    original = filesystem._FileSystemWriter.write_data

    def write_data(self: object, plan: object, planner: object) -> object:
        if rank == 1 and "step-00000006" in str(getattr(self, "path", "")):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, plan, planner)  # type: ignore[arg-type]

    filesystem._FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    train(tiny(data_dir, root / "killed", *PER_PROCESS))
    end_process(0)  # not reached: rank 0 fails in the save's collective


@pytest.mark.slow
def test_kill_9_of_a_rank_mid_save_keeps_the_previous_checkpoint(
    root: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    codes = _spawn(_killed_mid_save, tmp_path, tiny_data_dir)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0
    run = tmp_path / "killed"
    assert (run / "step-00000006").is_dir() and not (run / "step-00000006" / MARKER_NAME).exists()
    assert os.readlink(run / "latest") == "step-00000003"
    with pytest.warns(IncompleteCheckpointNote, match="step-00000006"):
        result = train(tiny(tiny_data_dir, run, *SINGLE), resume=run)
    assert result.step == STEPS and (run / "step-00000006" / MARKER_NAME).is_file()
    assert_same_state(run / "latest", root / "single" / "latest", TOLERANCE)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def documented_node_commands() -> list[list[str]]:
    """The two torchrun lines of docs/scaling.md, split into words ($NODE0 and $PORT left in)."""

    text = (ROOT / "docs" / "scaling.md").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.startswith("torchrun --nnodes 2 --nproc-per-node 1 ")]
    assert len(lines) == 2, lines
    return [shlex.split(line) for line in lines]


def _two_nodes(tmp_path: Path, documented: list[str], arguments: list[str]) -> None:
    """A documented command, one agent per node: torchrun's options as written, this test's address
    and port for $NODE0:$PORT, and `dlm` given this test's arguments."""

    port = _free_port()
    launcher = documented[1 : documented.index("-m")]
    launcher = [word.replace("$NODE0", "127.0.0.1").replace("$PORT", str(port)) for word in launcher]
    agent = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "dlm", *arguments]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [open(tmp_path / f"node{node}.log", "w") for node in range(2)]  # noqa: SIM115
    try:
        nodes = [subprocess.Popen(agent, stdout=log, stderr=subprocess.STDOUT, env=environment) for log in logs]
        codes = [node.wait(timeout=DEADLINE_S) for node in nodes]
    finally:
        for log in logs:
            log.close()
    assert codes == [0, 0], [(tmp_path / f"node{node}.log").read_text()[-3000:] for node in range(2)]


@pytest.mark.slow
def test_two_nodes_on_one_machine(root: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "nodes"
    first, then = documented_node_commands()
    assert first[first.index("-m") + 1 : first.index("--config")] == ["dlm", "train"]
    assert then[then.index("-m") + 1 :][:2] == ["dlm", "resume"]
    overrides = [part for item in settings(tiny_data_dir, run, *PER_PROCESS) for part in ("--set", item)]
    config = ["--config", str(ROOT / "configs" / "tiny.toml")]
    _two_nodes(tmp_path, first, ["train", *config, *overrides, *first[first.index("--max-run-steps") :]])
    marker = read_marker((run / "latest").resolve())
    assert marker["step"] == 3 and set(marker["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    _two_nodes(tmp_path, then, ["resume", str(run)])
    assert_close_losses(losses(run), losses(root / "single"))
    assert_same_state(run / "latest", root / "single" / "latest", TOLERANCE)
