"""`dlm rl` in two processes on the CPU (gloo, DDP and FSDP): the step's prompts split over the ranks,
each prompt's rollouts and scoring masks seeded by its place in the step, so two processes run the
one-process run's RL up to float summation order."""

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
from helpers import build_addition_task, rl_config

from dlm.artifacts.loading import read_model_source
from dlm.rl.run import rl
from dlm.train.distributed import end_process

TOLERANCE = 1e-5
DEADLINE_S = 600
# Two samples per estimate: the estimator's variance is reported, summed over the ranks' rows.
SETTINGS = ("rl.prompts_per_step=4", "rl.heldout=none", "rl.estimator_samples=2")


def _worker(rank: int, world_size: int, root: Path, parallelism: str) -> None:
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
        result = rl(rl_config(root, parallelism, *SETTINGS, f"training.parallelism={parallelism}"))
        assert result.status == "complete" and result.step == 4
    finally:
        dist.destroy_process_group()
    end_process(0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = build_addition_task(tmp_path_factory.mktemp("rl-distributed"))
    torch.set_num_threads(1)
    rl(rl_config(root, "reference", *SETTINGS))
    for parallelism in ("ddp", "fsdp"):
        context = mp.start_processes(_worker, args=(2, root, parallelism), nprocs=2, join=False, start_method="spawn")
        deadline = time.monotonic() + DEADLINE_S
        try:
            while not context.join(timeout=5):
                assert time.monotonic() < deadline, f"the spawned {parallelism} RL processes did not finish in time"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
    return root


def _rollout_events(run: Path) -> list[dict[str, float]]:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [event for event in events if event["event"] == "rollout"]


def _rollouts(run: Path) -> list[tuple[int, float, float]]:
    return [(e["step"], e["mean_reward"], e["reward_std"]) for e in _rollout_events(run)]


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_processes_run_rl_as_one(runs: Path, parallelism: str) -> None:
    # The rewards of the rollouts (sampled on each rank from the same seeds) are the one process's;
    # FSDP's sharded weights gather into the one process's too.
    assert _rollouts(runs / parallelism) == _rollouts(runs / "reference")
    # The estimator's variance and the clipped share are those of all the step's rows, not rank 0's.
    for split, whole in zip(_rollout_events(runs / parallelism), _rollout_events(runs / "reference"), strict=True):
        assert whole["estimator_variance"] is not None and whole["estimator_variance"] > 0
        assert split["estimator_variance"] == pytest.approx(whole["estimator_variance"], rel=1e-4)
        assert split["clip_fraction"] == pytest.approx(whole["clip_fraction"], abs=1e-6)
    # FSDP saves sharded (DCP) checkpoints: the run's latest, in whichever format, read as a model.
    (left_info, left), (right_info, right) = (
        read_model_source(runs / parallelism),
        read_model_source(runs / "reference"),
    )
    assert left_info.step == right_info.step == 4
    for name, tensor in right.items():
        assert torch.allclose(left[name], tensor, rtol=0, atol=TOLERANCE), name
