"""`dlm distill` in two processes on the CPU (gloo): DDP and FSDP distil as one process with twice the
accumulation (same noise, same teacher steps, losses and weights up to float summation order), and the
round's teacher snapshot is gathered and saved once, by rank 0."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import tiny_experiment

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.export import export_model
from dlm.artifacts.run_dir import RunDir
from dlm.config.schema import ExperimentConfig
from dlm.distill.run import distill, distillation_experiment
from dlm.train.distributed import end_process
from dlm.train.loop import train

TOLERANCE = 1e-5
STEPS = 4  # two rounds of two steps: round 1's teacher is gathered and saved at step 2
DISTILL = {"teacher_steps": 8, "rounds": 2, "steps_per_round": 2}
COMMON = (
    "training.batch_size=4",
    "training.log_interval=1",
    "training.eval_interval=2",
    "training.save_interval=2",
    "training.eval_batches=1",
    "training.warmup_steps=1",
    "training.keep_last_checkpoints=0",
)
DEADLINE_S = 600


def experiment(teacher: Path, data: Path, run: Path, *overrides: str) -> ExperimentConfig:
    return distillation_experiment(teacher, data, run, DISTILL, [*COMMON, *overrides])


def _worker(rank: int, world_size: int, teacher: Path, data: Path, root: Path) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=(root / "rendezvous").as_uri(),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=300),
    )
    try:
        fsdp = ("training.parallelism=fsdp", "training.checkpoint_format=single")
        for name, extra in (("ddp", ()), ("fsdp", fsdp)):
            result = distill(experiment(teacher, data, root / name, *extra))
            assert result.status == "complete" and result.step == STEPS
    finally:
        dist.destroy_process_group()
    end_process(0)


@pytest.fixture(scope="module")
def runs(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("distill-distributed")
    train(tiny_experiment(tiny_data_dir, root / "teacher-run", "training.max_steps=20"))
    teacher = export_model(root / "teacher-run", root / "teacher", dtype="float32")
    distill(experiment(teacher, tiny_data_dir, root / "reference", "training.gradient_accumulation_steps=2"))
    context = mp.start_processes(
        _worker, args=(2, teacher, tiny_data_dir, root), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not context.join(timeout=5):
            assert time.monotonic() < deadline, "the spawned distillation processes did not finish in time"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return root


def _losses(run: Path) -> list[tuple[str, int, float]]:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(e["event"], e["step"], e["loss"]) for e in events if e["event"] in ("train", "validation")]


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_processes_distil_as_one_with_twice_the_accumulation(runs: Path, parallelism: str) -> None:
    got, want = _losses(runs / parallelism), _losses(runs / "reference")
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert all(abs(g[2] - w[2]) <= TOLERANCE for g, w in zip(got, want, strict=True)), (got, want)
    left, right = load_checkpoint(runs / parallelism / "latest.pt"), load_checkpoint(runs / "reference" / "latest.pt")
    assert left["step"] == right["step"] == STEPS
    for name, tensor in right["model"].items():
        assert torch.allclose(left["model"][name], tensor, rtol=0, atol=TOLERANCE), name
    # Round 1's teacher, gathered from the ranks, is the reference's, and the only snapshot kept.
    run, reference = RunDir(runs / parallelism), RunDir(runs / "reference")
    assert run.teacher_snapshots() == {1: run.teacher_snapshot(1)}
    from safetensors.torch import load_file

    snapshot, expected = load_file(str(run.teacher_snapshot(1))), load_file(str(reference.teacher_snapshot(1)))
    for name, tensor in expected.items():
        assert torch.allclose(snapshot[name], tensor, rtol=0, atol=TOLERANCE), name
