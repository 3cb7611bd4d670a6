"""Multi-process training on the CPU (gloo, 2 processes).

Two processes with accumulation 2 must train exactly like one process with accumulation 4: same
data, same noise, same per-step losses and weights (up to float summation order). Accumulating
exercises DDP's no_sync and FSDP's deferred reduce-scatter. The expensive runs happen
once per module (`runs`): a reference in this process, `dlm train --nproc 2` end to end (DDP), and
one spawned pair of processes that trains, stops and resumes under DDP and then under FSDP.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import tiny_settings

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.config.schema import ExperimentConfig, load_config
from dlm.errors import UserError
from dlm.model.transformer import DiffusionTransformer
from dlm.train.distributed import check_parallelism, check_world_size, end_process, kept_accumulation
from dlm.train.loop import train
from dlm.train.step import LogWindow, TrainingStep

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5
STEPS = 6
# Saves at steps 3 and 6 (a resume point in the middle), validation at both.
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
PER_PROCESS = "training.gradient_accumulation_steps=2"  # x 2 processes
SINGLE = "training.gradient_accumulation_steps=4"  # x 1 process: the same global batch of 16
COLLECTIVE_TIMEOUT_S = 300
SPAWNED_DEADLINE_S = 900  # all five spawned runs; each takes seconds on an idle machine


def init_source(root: Path) -> Path:
    """The trained weights the init-from runs start from: the reference run's."""

    return root / "reference" / "latest.pt"


def data_overrides(data_dir: Path, run_dir: Path) -> list[str]:
    return tiny_settings(data_dir, run_dir, *COMMON)


def tiny(data_dir: Path, run_dir: Path, *overrides: str) -> ExperimentConfig:
    return load_config(ROOT / "configs" / "tiny.toml", [*data_overrides(data_dir, run_dir), *overrides])


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[tuple[str, int, float]]:
    return [(e["event"], e["step"], e["loss"]) for e in events(run_dir) if e["event"] in ("train", "validation")]


def assert_close_runs(run_dir: Path, reference: Path, tolerance: float = TOLERANCE) -> None:
    """Same per-step training and validation losses, weights, EMA and optimizer state."""

    got, want = losses(run_dir), losses(reference)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert all(abs(g[2] - w[2]) <= tolerance for g, w in zip(got, want, strict=True)), (got, want)
    left, right = load_checkpoint(run_dir / "latest.pt"), load_checkpoint(reference / "latest.pt")
    assert left["step"] == right["step"] == STEPS
    assert left["micro_batches_seen"] == right["micro_batches_seen"] == 4 * STEPS
    pairs = [(left["model"], right["model"]), (left["ema"]["shadow"], right["ema"]["shadow"])]
    pairs += [(left["optimizer"]["state"][i], right["optimizer"]["state"][i]) for i in right["optimizer"]["state"]]
    for a, b in pairs:
        assert a.keys() == b.keys()
        for name in a:
            assert torch.allclose(a[name], b[name], rtol=0, atol=tolerance), name


@contextlib.contextmanager
def interrupted_after(step: int) -> Iterator[None]:
    """SIGINT to this process alone once it has finished optimizer step `step` (as Ctrl-C would)."""

    original = TrainingStep.optimizer_step

    def step_then_signal(self: TrainingStep, batches: Iterator[torch.Tensor], window: LogWindow) -> None:
        original(self, batches, window)
        if self.counters.step == step:
            os.kill(os.getpid(), signal.SIGINT)

    TrainingStep.optimizer_step = step_then_signal  # type: ignore[method-assign]
    try:
        yield
    finally:
        TrainingStep.optimizer_step = original  # type: ignore[method-assign]


def _worker(rank: int, world_size: int, data_dir: Path, root: Path) -> None:
    """One rank of the spawned pair: for DDP then FSDP, 3 steps, then a resume to step 6.

    The DDP run is stopped by a SIGINT that only rank 1 receives: both ranks must agree to stop
    after the same step (a rank stopping alone would hang the other in a collective).
    """

    # One thread, as the CLI run it is compared to: dlm's thread plan follows OMP_NUM_THREADS, so a
    # caller's own (inherited here) would change the float sums and not the CLI run's.
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"}
    )
    torch.set_num_threads(1)
    # The ranks meet through a file in this test's directory, not a TCP port: a port probed free
    # can be taken (by another test run on the machine) before rank 0 listens on it, and then the
    # store fails with EADDRINUSE or, worse, rank 1 joins a stranger's store. The timeout bounds
    # each collective: long enough for a rank that saves while the machine is loaded, short
    # enough that desynchronised ranks fail the test (before the fixture's deadline) instead of hanging it.
    dist.init_process_group(
        "gloo",
        init_method=(root / "rendezvous").as_uri(),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        # The single-file format under FSDP too (sharded checkpoints: tests/test_sharded_distributed.py).
        fsdp = ("training.parallelism=fsdp", "model.activation_checkpointing=true", "training.checkpoint_format=single")
        runs = {"ddp": (), "fsdp": fsdp}
        runs = {name: (PER_PROCESS, *extra) for name, extra in runs.items()}
        for name, extra in runs.items():
            experiment = tiny(data_dir, root / name, *extra)
            if name == "ddp":
                with interrupted_after(3) if rank == 1 else contextlib.nullcontext():
                    first = train(experiment)
                assert first.status == "interrupted" and first.step == 3
            else:
                first = train(experiment, max_run_steps=3)
                assert first.status == "paused" and first.step == 3
            second = train(experiment, resume=first.checkpoint)
            assert second.status == "complete" and second.step == STEPS
        # From trained weights: rank 0 builds the whole model from them, the other rank from their shapes
        # alone (rank 0 sends it the weights), and no rank draws any at random.
        drawn: list[str] = []
        built: list[str] = []
        init_weights, from_weights = DiffusionTransformer.init_weights, DiffusionTransformer.from_weights.__func__

        def recorded(model: DiffusionTransformer) -> None:
            drawn.append(next(model.parameters()).device.type)
            init_weights(model)

        def recorded_build(cls: type, config: object, weights: dict[str, torch.Tensor]) -> DiffusionTransformer:
            built.append(next(iter(weights.values())).device.type)
            return from_weights(cls, config, weights)

        DiffusionTransformer.init_weights = recorded  # type: ignore[method-assign]
        DiffusionTransformer.from_weights = classmethod(recorded_build)  # type: ignore[method-assign, assignment]
        try:
            initialised = tiny(data_dir, root / "fsdp-init", *runs["fsdp"], f"training.init_from={init_source(root)}")
            assert train(initialised).step == STEPS
        finally:
            DiffusionTransformer.init_weights = init_weights  # type: ignore[method-assign]
            DiffusionTransformer.from_weights = classmethod(from_weights)  # type: ignore[method-assign, assignment]
        (root / f"drawn-{rank}.json").write_text(json.dumps({"drawn": drawn, "built": built}))
    finally:
        dist.destroy_process_group()
    end_process(0)  # as `dlm train` under torchrun ends: no interpreter teardown under gloo's threads


@dataclass
class Runs:
    data_dir: Path
    reference: Path  # 1 process, accumulation 4
    cli_ddp: Path  # dlm train --nproc 2, accumulation 2, straight through
    ddp: Path  # 2 processes, interrupted after 3 steps + resume
    fsdp: Path  # 2 processes, FSDP with activation checkpointing, 3 steps + resume
    fsdp_init: Path  # 2 processes, FSDP from the reference's trained weights
    reference_init: Path  # 1 process from the reference's trained weights


@pytest.fixture(scope="module")
def runs(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("distributed")
    names = ("reference", "cli-ddp", "ddp", "fsdp", "fsdp-init", "reference-init")
    result = Runs(tiny_data_dir, *(root / name for name in names))
    train(tiny(tiny_data_dir, result.reference, SINGLE))
    train(tiny(tiny_data_dir, result.reference_init, SINGLE, f"training.init_from={init_source(root)}"))

    settings = [*data_overrides(tiny_data_dir, result.cli_ddp), PER_PROCESS]
    overrides = [part for item in settings for part in ("--set", item)]
    command = [
        sys.executable,
        "-m",
        "dlm",
        "train",
        "--config",
        str(ROOT / "configs" / "tiny.toml"),
        "--nproc",
        "2",
        *overrides,
        "--json",
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert json.loads(finished.stdout.splitlines()[-1])["event"] == "complete"

    context = mp.start_processes(_worker, args=(2, tiny_data_dir, root), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWNED_DEADLINE_S
    try:
        while not context.join(timeout=5):
            assert time.monotonic() < deadline, "the spawned training processes did not finish in time"
    finally:
        for process in context.processes:  # SIGKILL: a rank stuck in a collective never handles SIGTERM
            if process.is_alive():
                process.kill()
                process.join()
    return result


@pytest.mark.slow
def test_ddp_equals_one_process_with_twice_the_accumulation(runs: Runs) -> None:
    assert_close_runs(runs.cli_ddp, runs.reference)
    start = events(runs.cli_ddp)[0]
    assert start["event"] == "start" and start["world_size"] == 2 and start["parallelism"] == "ddp"
    assert start["global_batch"] == 4 * 2 * 2 == events(runs.reference)[0]["global_batch"]


@pytest.mark.slow
def test_fsdp_equals_one_process_with_twice_the_accumulation(runs: Runs) -> None:
    # Also covers FSDP's gathered saves and sharded resume (the run stopped at step 3).
    assert_close_runs(runs.fsdp, runs.reference)
    assert events(runs.fsdp)[0]["parallelism"] == "fsdp"
    inference = load_checkpoint(runs.fsdp / "inference-latest.pt")
    ema = load_checkpoint(runs.fsdp / "latest.pt")["ema"]["shadow"]
    assert inference["weights"] == "ema"
    for name, tensor in inference["model"].items():
        assert torch.equal(tensor, ema[name].to(torch.bfloat16)), name


@pytest.mark.slow
def test_fsdp_from_trained_weights_equals_one_process_and_draws_no_random_weights(runs: Runs) -> None:
    assert_close_runs(runs.fsdp_init, runs.reference_init)
    record = [json.loads((runs.fsdp_init.parent / f"drawn-{rank}.json").read_text()) for rank in range(2)]
    assert all(device == "meta" for rank in record for device in rank["drawn"])  # only meta "draws", on any rank
    assert record[0]["built"] == ["cpu"] and record[1]["built"] == ["meta"]  # one whole copy, on rank 0


@pytest.mark.slow
def test_ddp_resume_is_exact(runs: Runs) -> None:
    stops = [event for event in events(runs.ddp) if event["event"] in ("interrupted", "complete")]
    assert [(event["event"], event["step"]) for event in stops] == [("interrupted", 3), ("complete", STEPS)]
    assert losses(runs.ddp) == losses(runs.cli_ddp)
    resumed, straight = load_checkpoint(runs.ddp / "latest.pt"), load_checkpoint(runs.cli_ddp / "latest.pt")
    for part in ("model", "optimizer", "ema"):
        flat = [(resumed[part], straight[part])]
        while flat:
            a, b = flat.pop()
            if isinstance(a, dict):
                assert a.keys() == b.keys()
                flat += [(a[key], b[key]) for key in a]
            elif isinstance(a, torch.Tensor):
                assert torch.equal(a, b)
            else:
                assert a == b


@pytest.mark.slow
def test_only_rank_zero_writes(runs: Runs) -> None:
    expected = {
        ".lock",
        "config.json",
        "metrics.jsonl",
        "latest.pt",
        "inference-latest.pt",
        "step-00000003.pt",
        "step-00000006.pt",
    }
    for run_dir, launches in ((runs.cli_ddp, 1), (runs.ddp, 2), (runs.fsdp, 2)):
        assert {path.name for path in run_dir.iterdir()} == expected, run_dir
        kinds = [event["event"] for event in events(run_dir)]
        assert kinds.count("start") == launches and kinds.count("complete") == 1
        assert kinds.count("checkpoint") == 2 and kinds.count("validation") == 2
        assert [e["step"] for e in events(run_dir) if e["event"] == "train"] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_resume_with_another_world_size(runs: Runs, tmp_path: Path) -> None:
    # 2 FSDP processes x accumulation 2 saved at step 3; 1 process x accumulation 4 finishes the run.
    run_dir = tmp_path / "single"
    experiment = tiny(runs.data_dir, run_dir, SINGLE, "model.activation_checkpointing=true")
    result = train(experiment, resume=runs.fsdp / "step-00000003.pt")
    assert result.status == "complete" and load_checkpoint(result.checkpoint)["world_size"] == 1
    reference = [loss for loss in losses(runs.reference) if loss[1] > 3]
    assert [loss[:2] for loss in losses(run_dir)] == [loss[:2] for loss in reference]
    assert all(abs(a[2] - b[2]) <= TOLERANCE for a, b in zip(losses(run_dir), reference, strict=True))
    final = load_checkpoint(result.checkpoint)["model"]
    expected = load_checkpoint(runs.reference / "latest.pt")["model"]
    assert all(torch.allclose(final[name], expected[name], rtol=0, atol=TOLERANCE) for name in expected)


# Imported by every Python process started with it on PYTHONPATH; it watches the torchrun workers.
EXIT_PROBE = """
import atexit, os, sys
if "RANK" in os.environ:
    class _Teardown:
        def __del__(self, write=os.write):
            write(2, b"interpreter teardown reached\\n")

    _sentinel = _Teardown()  # collected only when the interpreter tears its modules down

    def _report():
        import torch.distributed as dist
        # One write(2) of a short line is atomic on a pipe: the two ranks' lines never interleave.
        os.write(2, f"process group at exit: {dist.is_initialized()}\\n".encode())

    atexit.register(_report)  # registered first, so it runs after dlm's own exit handlers
"""


@pytest.mark.slow
def test_a_finished_worker_exits_without_interpreter_teardown(tiny_data_dir: Path, tmp_path: Path) -> None:
    # DDP keeps gloo's threads running to the end; tearing the interpreter down under them
    # sometimes aborted a finished `dlm train --nproc 2` (SIGABRT, "terminate called without an
    # active exception"), and torchrun reported the run as failed.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(EXIT_PROBE)
    settings = [
        *data_overrides(tiny_data_dir, tmp_path / "run"),
        PER_PROCESS,
        "training.max_steps=2",
        "training.eval_interval=2",
        "training.save_interval=2",
    ]
    overrides = [part for item in settings for part in ("--set", item)]
    command = [
        sys.executable,
        "-m",
        "dlm",
        "train",
        "--config",
        str(ROOT / "configs" / "tiny.toml"),
        "--nproc",
        "2",
        *overrides,
        "--json",
    ]
    paths = [str(site), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(paths)}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert json.loads(finished.stdout.splitlines()[-1])["event"] == "complete"
    assert finished.stderr.count("process group at exit: False") == 2, finished.stderr[-3000:]
    assert "interpreter teardown reached" not in finished.stderr


def test_resume_refuses_a_world_size_that_cannot_split_the_consumed_batches() -> None:
    checkpoint = {"micro_batches_seen": 9, "world_size": 1}
    check_world_size(checkpoint, 3, Path("latest.pt"))
    with pytest.raises(UserError, match=r"9 micro-batches .*world size 1.*2 processes cannot split"):
        check_world_size(checkpoint, 2, Path("latest.pt"))


def test_another_world_size_keeps_the_global_batch_or_refuses_in_one_line() -> None:
    # Saved by 2 processes of batch_size 4 at accumulation 2: a global batch of 16.
    record = {"world_size": 2, "config": {"training": {"batch_size": 4, "gradient_accumulation_steps": 2}}}
    assert kept_accumulation(record, 4, 2, 2, "ckpt") == (2, None)
    assert kept_accumulation(record, 4, 2, 1, "ckpt") == (
        4,
        "global batch 16 kept on 1 process: gradient accumulation 4 (the run used 2 on 2)",
    )
    assert kept_accumulation(record, 4, 2, 4, "ckpt")[0] == 1
    with pytest.raises(
        UserError,
        match=r"global batch of 16 sequences \(batch_size 4 x accumulation 2 x 2 processes\) "
        r"cannot be kept on 3 processes.*resume on 1, 2, 4 processes, or pass --allow-batch-change to "
        r"continue with a global batch of 24",
    ):
        kept_accumulation(record, 4, 2, 3, "ckpt")
    assert kept_accumulation(record, 4, 2, 3, "ckpt", allow_change=True) == (
        2,
        "global batch changed from 16 to 24 on 3 processes (--allow-batch-change)",
    )
    assert kept_accumulation({"config": {}}, 4, 2, 3, "ckpt") == (2, None)  # recorded before world sizes were


def test_fsdp_refuses_adamw8bit_and_float16(tiny_data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"adamw8bit.*fsdp"):
        train(tiny(tiny_data_dir, tmp_path / "run", "training.parallelism=fsdp", "training.optimizer=adamw8bit"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    half = tiny(
        tiny_data_dir,
        tmp_path / "run",
        "training.device=cuda",
        "training.precision=float16",
        "training.parallelism=fsdp",
    )
    with pytest.raises(UserError, match=r"float16.*fsdp.*bfloat16"):
        check_parallelism(half.training)
