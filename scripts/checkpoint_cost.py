"""What a checkpoint costs a 2-process FSDP run on the CPU (gloo): single file against DCP, interleaved.

usage: python scripts/checkpoint_cost.py [--d-model 1024] [--layers 10] [--vocab 8192] [--rounds 3]
                                         [--dir DIR] [--json]

Two spawned processes build the same FSDP2-sharded model and AdamW state (float32; the optimizer
state is initialised by torch's zero-gradient step), then save it round after round in three ways,
their order rotated every round so that all three see the same load from other work:

- single: dlm's `checkpoint_format = "single"` path: the full state gathered to rank 0
  (`get_model_state_dict(..., full_state_dict=True, cpu_offload=True)`) and written as one file;
- dcp: `checkpoint_format = "dcp"`: each rank writes its shards (torch.distributed.checkpoint),
  hashes them, rank 0 writes the marker;
- dcp async: the same with `async_checkpoint = true`: each rank stages a CPU copy of its shards and
  the rest runs in a background thread.

Per save: the wall time training is blocked (until the call returns on the slower rank; for async
also the time until the checkpoint is complete), rank 0's peak resident memory above its level
before the save (sampled every 2 ms from /proc/self/statm until the save is complete; glibc's
mmap threshold is fixed at 1 MiB so that freed blocks leave the resident set) and the bytes each
rank wrote. Printed: the median of each over rounds, and the ratios to the single file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("single", "dcp", "dcp async")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3, help="saves of each kind")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


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


def _worker(rank: int, world_size: int, args: argparse.Namespace, root: Path) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    from dlm.artifacts.checkpoint import save_training_checkpoint
    from dlm.config.schema import ExperimentConfig
    from dlm.model.transformer import DiffusionTransformer
    from dlm.train.checkpointing import ShardedCheckpointer, training_tensors
    from dlm.train.distributed import DistributedContext, build_model, full_model_state, full_optimizer_state
    from dlm.train.optimizer import build_optimizer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=(root / "rendezvous").as_uri(),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=10),
    )
    experiment = ExperimentConfig.from_dict(
        {
            "model": {
                "vocab_size": args.vocab,
                "mask_token_id": 1,
                "max_seq_len": 64,
                "d_model": args.d_model,
                "n_layers": args.layers,
                "n_heads": args.d_model // 64,
            },
            "training": {"device": "cpu", "precision": "float32", "parallelism": "fsdp", "output_dir": str(root)},
        }
    )
    world = DistributedContext(rank=rank, local_rank=rank, world_size=world_size)
    device = torch.device("cpu")
    model = build_model(lambda: DiffusionTransformer(experiment.model), device, world, "fsdp")
    optimizer = build_optimizer(model, experiment.training, device)
    training_tensors(model, optimizer, None)  # AdamW's moments exist from here on
    savers = {
        "dcp": ShardedCheckpointer(world, root / "dcp", keep_last=0, asynchronous=False),
        "dcp async": ShardedCheckpointer(world, root / "dcp async", keep_last=0, asynchronous=True),
    }
    parameters = sum(p.numel() for p in model.parameters())
    records: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for offset in range(len(KINDS)):
            kind = KINDS[(round_index + offset) % len(KINDS)]
            folder = root / kind
            step = round_index + 1
            world.barrier()
            rss = PeakRss() if rank == 0 else None
            started = time.perf_counter()
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
            complete = time.perf_counter() - started
            extra = rss.stop() if rss is not None else 0
            world.barrier()
            records.append(
                {
                    "kind": kind,
                    "round": round_index,
                    "rank": rank,
                    "blocked_s": blocked,
                    "complete_s": complete,
                    "rank0_extra_rss": extra,
                    "written": _written(folder, rank, kind),
                }
            )
            world.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            world.barrier()
    gathered: list[list[dict[str, Any]] | None] = [None] * world_size
    dist.all_gather_object(gathered, records)
    if rank == 0:
        everything = [record for part in gathered if part for record in part]
        (root / "results.json").write_text(json.dumps({"parameters": parameters, "records": everything}))
    dist.destroy_process_group()


def summarise(parameters: int, records: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    state_bytes = parameters * 12  # float32 weights + AdamW's two float32 moments
    rounds = sorted({record["round"] for record in records})
    kinds: dict[str, Any] = {}
    for kind in KINDS:
        mine = [record for record in records if record["kind"] == kind]
        per_round = [[record for record in mine if record["round"] == r] for r in rounds]
        kinds[kind] = {
            "blocked_s": statistics.median(max(r["blocked_s"] for r in group) for group in per_round),
            "complete_s": statistics.median(max(r["complete_s"] for r in group) for group in per_round),
            "rank0_extra_rss_bytes": statistics.median(r["rank0_extra_rss"] for r in mine if r["rank"] == 0),
            "written_bytes_per_rank": [
                statistics.median(r["written"] for r in mine if r["rank"] == rank) for rank in range(world_size)
            ],
        }
    # Ratios within each round (all three saw the same load), then their median.
    for kind in KINDS:
        ratios = []
        for r in rounds:
            this = max(x["blocked_s"] for x in records if x["round"] == r and x["kind"] == kind)
            single = max(x["blocked_s"] for x in records if x["round"] == r and x["kind"] == "single")
            ratios.append(this / single)
        kinds[kind]["blocked_vs_single"] = statistics.median(ratios)
    return {"parameters": parameters, "state_bytes": state_bytes, "world_size": world_size, "kinds": kinds}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch.multiprocessing as mp

    world_size = 2
    # glibc otherwise raises its mmap threshold after the first large free and keeps later freed
    # blocks in the heap: the resident size would then hide what a later save allocates. A fixed
    # threshold maps every large block and unmaps it on free (read at start by the spawned workers).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    root = Path(tempfile.mkdtemp(prefix="checkpoint-cost-", dir=args.dir))
    try:
        mp.start_processes(_worker, args=(world_size, args, root), nprocs=world_size, start_method="spawn")
        data = json.loads((root / "results.json").read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarise(data["parameters"], data["records"], world_size)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    mib = float(1 << 20)
    print(
        f"{summary['parameters'] / 1e6:.1f}M parameters, full state {summary['state_bytes'] / mib:.0f} MiB "
        f"(float32 weights + AdamW), {world_size} processes, FSDP, gloo, median of {args.rounds} rounds"
    )
    print(
        f"{'format':<10} {'blocked s':>10} {'x single':>9} {'complete s':>11} {'rank0 +RSS MiB':>15} "
        f"{'written MiB per rank':>22}"
    )
    for kind, figures in summary["kinds"].items():
        written = " / ".join(f"{value / mib:.0f}" for value in figures["written_bytes_per_rank"])
        print(
            f"{kind:<10} {figures['blocked_s']:>10.2f} {figures['blocked_vs_single']:>9.3f} "
            f"{figures['complete_s']:>11.2f} {figures['rank0_extra_rss_bytes'] / mib:>15.0f} {written:>22}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
