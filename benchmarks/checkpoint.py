"""What a checkpoint costs a 2-process FSDP run on the CPU (gloo): single file against DCP and async DCP.

Two spawned processes build the same FSDP2-sharded model and AdamW state (float32; the optimizer
state is initialised by torch's zero-gradient step), then save it round after round in three ways,
in `dlm.bench.measure.interleaved` rounds (the order rotated every round, no warm-up: the first
save of each is part of the figure), so that all three see the same load from other work:

- single: dlm's `checkpoint_format = "single"` path: the full state gathered to rank 0
  (`get_model_state_dict(..., full_state_dict=True, cpu_offload=True)`) and written as one file;
- dcp: `checkpoint_format = "dcp"`: each rank writes its shards (torch.distributed.checkpoint),
  hashes them, rank 0 writes the marker;
- dcp_async: the same with `async_checkpoint = true`: each rank stages a CPU copy of its shards and
  the rest runs in a background thread.

Per save: the wall time training is blocked (until the call returns on the slower rank; for async
also the time until the checkpoint is complete), rank 0's peak resident memory above its level
before the save (sampled every 2 ms from /proc/self/statm until the save is complete; glibc's mmap
threshold is fixed at 1 MiB so that freed blocks leave the resident set) and the bytes each rank
wrote. The figures are the medians over rounds, and each format's blocked time over the single
file's within the same round.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks import harness
from dlm.bench.measure import Timing, interleaved, round_ratios, self_timed, spread

KINDS = ("single", "dcp", "dcp_async")
WORLD_SIZE = 2
MIB = float(1 << 20)


class PeakRss:
    """The peak resident set size of this process while running, sampled in a thread."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.baseline = self.peak = self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def read(self) -> int:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * self.page

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.read())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.read()) - self.baseline


def _written(path: Path, rank: int, kind: str) -> int:
    if kind == "single":
        return sum(file.stat().st_size for file in path.glob("step-*.pt")) if rank == 0 else 0
    mine = list(path.rglob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine += [*path.rglob(".metadata"), *path.rglob("dlm-checkpoint.json")]
    return sum(file.stat().st_size for file in mine)


def _saves(rank: int, size: dict[str, int], root: Path, records: list[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
    """This rank's process group, and one save function per format; each appends its record to `records`."""

    import torch

    from dlm.artifacts.checkpoint import save_training_checkpoint
    from dlm.config.schema import ExperimentConfig
    from dlm.model.transformer import DiffusionTransformer
    from dlm.train.checkpointing import ShardedCheckpointer, training_tensors
    from dlm.train.distributed import DistributedContext, build_model, full_model_state, full_optimizer_state
    from dlm.train.optimizer import build_optimizer

    model_config = {"mask_token_id": 1, "max_seq_len": 64, "n_heads": max(1, size["d_model"] // 64), **size}
    training = {"device": "cpu", "precision": "float32", "parallelism": "fsdp", "output_dir": str(root)}
    experiment = ExperimentConfig.from_dict({"model": model_config, "training": training})
    world = DistributedContext(rank=rank, local_rank=rank, world_size=WORLD_SIZE)
    device = torch.device("cpu")
    model = build_model(lambda: DiffusionTransformer(experiment.model), device, world, "fsdp")
    optimizer = build_optimizer(model, experiment.training, device)
    training_tensors(model, optimizer, None)  # AdamW's moments exist from here on
    savers = {
        kind: ShardedCheckpointer(world, root / kind, keep_last=0, asynchronous=kind == "dcp_async")
        for kind in KINDS[1:]
    }
    done = dict.fromkeys(KINDS, 0)

    def saver(kind: str) -> Callable[[], Timing]:
        def save() -> Timing:
            folder, step = root / kind, done[kind] + 1
            world.barrier()
            rss = PeakRss() if rank == 0 else None
            cpu, started = time.process_time(), time.perf_counter()
            if kind == "single":
                state = {"model": full_model_state(model), "optimizer": full_optimizer_state(model, optimizer)}
                if rank == 0:
                    save_training_checkpoint(folder, {**state, "step": step}, step, keep_last=0)
                del state
                world.barrier()
                blocked = time.perf_counter() - started
            else:
                _, tensors = training_tensors(model, optimizer, None)
                savers[kind].save(tensors, step, {"step": step})
                blocked = time.perf_counter() - started
                savers[kind].wait()
            complete, cpu_s = time.perf_counter() - started, time.process_time() - cpu
            extra = rss.stop() if rss is not None else 0
            world.barrier()
            records.append(
                {
                    "kind": kind,
                    "round": done[kind],
                    "rank": rank,
                    "blocked_s": blocked,
                    "complete_s": complete,
                    "cpu_s": cpu_s,
                    "rank0_extra_rss": extra,
                    "written": _written(folder, rank, kind),
                }
            )
            done[kind] = step
            world.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            world.barrier()
            return Timing(cpu_s=cpu_s, wall_s=blocked)

        return save

    meta = {"parameters": sum(p.numel() for p in model.parameters())}
    return meta, {kind: saver(kind) for kind in KINDS}


def _worker(rank: int, size: dict[str, int], rounds: int, root: Path) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rendezvous = (root / "rendezvous").as_uri()
    timeout = timedelta(minutes=10)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD_SIZE, timeout=timeout)
    records: list[dict[str, Any]] = []
    meta, saves = _saves(rank, size, root, records)
    progress = harness.progress if rank == 0 else None
    interleaved(saves, rounds, warmup=0, timer=self_timed, progress=progress)
    gathered: list[list[dict[str, Any]] | None] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, records)
    if rank == 0:
        everything = [record for part in gathered if part for record in part]
        (root / "results.json").write_text(json.dumps({**meta, "records": everything}))
    dist.destroy_process_group()


def summarise(parameters: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds (a round's time is its slower rank's), and the blocked time over the single file's."""

    state_bytes = parameters * 12  # float32 weights + AdamW's two float32 moments
    rounds = sorted({record["round"] for record in records})

    def per_round(kind: str, key: str) -> list[float]:
        return [max(r[key] for r in records if r["kind"] == kind and r["round"] == n) for n in rounds]

    kinds: dict[str, Any] = {}
    for kind in KINDS:
        mine = [record for record in records if record["kind"] == kind]
        kinds[kind] = {
            "blocked_s": statistics.median(per_round(kind, "blocked_s")),
            "complete_s": statistics.median(per_round(kind, "complete_s")),
            "blocked_vs_single": spread(round_ratios(per_round(kind, "blocked_s"), per_round("single", "blocked_s"))),
            "rank0_extra_rss_mib": statistics.median(r["rank0_extra_rss"] for r in mine if r["rank"] == 0) / MIB,
            "written_mib_per_rank": [
                statistics.median(r["written"] for r in mine if r["rank"] == rank) / MIB for rank in range(WORLD_SIZE)
            ],
        }
    return {"parameters": parameters, "state_mib": state_bytes / MIB, "world_size": WORLD_SIZE, "kinds": kinds}


def checkpoint(
    d_model: Annotated[int, typer.Option(help="Model width (heads of 64).")] = 1024,
    layers: Annotated[int, typer.Option(help="Transformer layers.")] = 10,
    vocab: Annotated[int, typer.Option(help="Vocabulary size.")] = 8192,
    rounds: Annotated[int, typer.Option(min=1, help="Saves of each format.")] = 3,
    directory: Annotated[
        Path | None, typer.Option("--dir", help="Where to write the checkpoints (default: a temporary directory).")
    ] = None,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """Checkpoint cost of 2-process FSDP on the CPU: single file against DCP and async DCP, interleaved."""

    import torch.multiprocessing as mp

    run = harness.start("checkpoint", d_model=d_model, layers=layers, vocab=vocab, rounds=rounds)
    size = {"d_model": d_model, "n_layers": layers, "vocab_size": vocab}
    # glibc otherwise raises its mmap threshold after the first large free and keeps later freed
    # blocks in the heap: the resident size would then hide what a later save allocates. A fixed
    # threshold maps every large block and unmaps it on free (read at start by the spawned workers).
    before = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    root = Path(tempfile.mkdtemp(prefix="dlm-bench-checkpoint-", dir=directory))
    try:
        mp.start_processes(_worker, args=(size, rounds, root), nprocs=WORLD_SIZE, start_method="spawn")
        data = json.loads((root / "results.json").read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if before is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    figures = summarise(data["parameters"], data["records"])
    path = run.save(figures, {"records": data["records"]}, results=results)
    typer.echo(
        f"{figures['parameters'] / 1e6:.1f}M parameters, full state {figures['state_mib']:.0f} MiB "
        f"(float32 weights + AdamW), {WORLD_SIZE} processes, FSDP, gloo, median of {rounds} rounds"
    )
    typer.echo(
        f"{'format':<10} {'blocked s':>10} {'x single':>9} {'complete s':>11} {'rank0 +RSS MiB':>15} "
        f"{'written MiB per rank':>21}"
    )
    for kind, row in figures["kinds"].items():
        written = " / ".join(f"{value:.0f}" for value in row["written_mib_per_rank"])
        typer.echo(
            f"{kind:<10} {row['blocked_s']:>10.2f} {row['blocked_vs_single']['median']:>9.3f} "
            f"{row['complete_s']:>11.2f} {row['rank0_extra_rss_mib']:>15.0f} {written:>21}"
        )
    typer.echo(f"wrote {path}")
