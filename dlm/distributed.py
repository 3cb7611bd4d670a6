"""Multi-process training under torchrun: process-group setup and model wrapping.

The model and the loop know nothing of parallelism: the loop asks a `DistributedContext` for its rank
and world size, wraps the model once with `wrap_model`, and brackets each micro-batch with
`gradient_sync` (DDP's `no_sync` on all but the last micro-batch of an optimizer step). A single
process (no torchrun) gets a context with world size 1 whose hooks do nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dlm.config import ExperimentConfig
from dlm.errors import UserError


@dataclass(frozen=True)
class DistributedContext:
    """Rank and world size of this process, and the collective hooks the loop needs."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def device_name(self, requested: str) -> str:
        """Under torchrun each process drives the GPU of its local rank."""

        if requested in ("auto", "cuda") and torch.cuda.is_available():
            return f"cuda:{self.local_rank}"
        return "cpu" if requested == "auto" else requested

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    @contextlib.contextmanager
    def gradient_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on micro-batches that are not the last of a step."""

        if self.active and not enabled and hasattr(model, "no_sync"):
            with model.no_sync():
                yield
        else:
            yield


def current_context(experiment: ExperimentConfig) -> DistributedContext:
    """Join the torchrun process group when launched by torchrun, else a single process."""

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DistributedContext()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        use_nccl = torch.cuda.is_available() and experiment.training.device in ("auto", "cuda")
        if use_nccl:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl" if use_nccl else "gloo")
    return DistributedContext(rank=rank, local_rank=local_rank, world_size=world_size)


def wrap_model(model: nn.Module, world: DistributedContext, parallelism: str, compile_model: bool) -> nn.Module:
    """The module the training step calls: compiled and/or wrapped for data parallelism.

    `model.compile()` compiles in place, so state_dict keys stay those of the plain model.
    """

    if compile_model:
        model.compile()
    if not world.active:
        return model
    if parallelism == "fsdp":
        raise UserError(
            "training.parallelism = 'fsdp' is not available in this version",
            fix="use training.parallelism = 'ddp'",
        )
    from torch.nn.parallel import DistributedDataParallel

    device_ids = None if next(model.parameters()).device.type == "cpu" else [world.local_rank]
    return DistributedDataParallel(model, device_ids=device_ids)


def launch_local(nproc: int, argv: list[str]) -> int:
    """`dlm train --nproc N ...`: the same command under torchrun on this machine (standalone)."""

    import subprocess
    import sys

    forwarded: list[str] = []
    skip_next = False
    for argument in argv:
        if skip_next:
            skip_next = False
        elif argument == "--nproc":
            skip_next = True
        elif not argument.startswith("--nproc="):
            forwarded.append(argument)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "dlm",
        *forwarded,
    ]
    return subprocess.call(command)
