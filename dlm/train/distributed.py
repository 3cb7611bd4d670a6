"""Multi-process training under torchrun: process groups, DDP / FSDP2 wrapping, full-state I/O.

The model and the loop know nothing of parallelism. The loop asks a `DistributedContext` for its
rank and world size, builds the model with `build_model` (FSDP2 shards it there, before the
optimizer exists, because the optimizer must hold the sharded parameters), wraps it once with
`wrap_model` and brackets each micro-batch with `gradient_sync`. Single-file checkpoints hold the
full, single-process layout (plain state dicts, integer-keyed optimizer state), so a run saved under
any world size or parallelism resumes under any other; under FSDP gathering that state is a
collective every rank joins, and only rank 0 writes it. Sharded checkpoints (each rank its own
shards) are `dlm.train.checkpointing`'s. A single process (no torchrun) gets a context with
world size 1 whose hooks do nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeGuard, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from dlm.config.optimizer_registry import check_fsdp_support
from dlm.config.schema import ExperimentConfig, TrainingConfig
from dlm.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

ModuleT = TypeVar("ModuleT", bound=nn.Module)


@dataclass(frozen=True)
class DistributedContext:
    """Rank and world size of this process, and the collective hooks the loop needs."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    # A gloo group for host-side agreement (stop flags) when the default group is NCCL, so that
    # agreeing on "stop now" costs a CPU message rather than a GPU synchronisation; None = default.
    control_group: Any = None

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
        """Reduce gradients only on the last micro-batch of a step (DDP no_sync, FSDP deferred reduce)."""

        if not self.active:
            yield
        elif is_sharded(model):
            # FSDP2 keeps unsharded gradients between micro-batches while sync is off, then
            # reduce-scatters their sum once: fewer collectives for more memory.
            model.set_requires_gradient_sync(enabled)  # type: ignore[operator]
            yield
        elif not enabled and hasattr(model, "no_sync"):
            with model.no_sync():  # type: ignore[operator]
                yield
        else:
            yield

    def any_rank(self, flags: Sequence[bool]) -> list[bool]:
        """Each flag, true when it is true on any rank: every rank must take the same branch
        (a stop decided by one rank alone would leave the others waiting in a collective)."""

        if not self.active:
            return list(flags)
        values = torch.tensor([int(flag) for flag in flags], dtype=torch.int32)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.control_group)
        return [bool(value) for value in values.tolist()]

    def sum_over_ranks(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Reduced copies (the inputs are left alone); on one process, the inputs themselves."""

        if not self.active:
            return list(tensors)
        reduced = [tensor.detach().clone() for tensor in tensors]
        for tensor in reduced:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return reduced

    def first_flag(self, step: Tensor) -> int:
        """The smallest non-negative value over ranks of a 0-dim long tensor (-1 = none anywhere)."""

        if not self.active:
            return int(step)
        none = torch.iinfo(torch.long).max
        value = torch.where(step < 0, torch.full_like(step, none), step)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return -1 if int(value) == none else int(value)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def joined_process_group() -> bool:
    """Whether this process is (still) a member of a torch.distributed process group."""

    return dist.is_available() and dist.is_initialized()


def end_process(code: int) -> NoReturn:
    """Exit a process that joined a process group: the exit handlers run, interpreter teardown not.

    DDP keeps the gloo process group, and its worker threads, alive past `destroy_process_group`.
    Tearing down the interpreter and the C++ statics under those running threads sometimes aborts
    a finished run (SIGABRT, "terminate called without an active exception"), and torchrun then
    reports the whole job as failed. Everything of the run's own is written and closed by now.
    """

    atexit._run_exitfuncs()  # what a normal exit runs first: our destroy, logging's flush ...
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe changes nothing here
            stream.flush()
    os._exit(code)


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun); known before any process group."""

    return int(os.environ.get("RANK", "0"))


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
        # Leave the group while the interpreter is whole (see `end_process` for what remains).
        atexit.register(_destroy_process_group)
    control_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return DistributedContext(rank=rank, local_rank=local_rank, world_size=world_size, control_group=control_group)


def check_parallelism(training: TrainingConfig) -> None:
    """Refuse the combinations that FSDP cannot run correctly, whatever the world size, so a
    config tried on one process does not fail only once it is launched on many."""

    if training.parallelism != "fsdp":
        return
    check_fsdp_support(training.optimizer)
    if training.precision == "float16":
        raise UserError(
            "training.precision = 'float16' is not supported with training.parallelism = 'fsdp': "
            "the gradient scaler would judge overflow on each rank's shard alone",
            fix="use precision = 'bfloat16' (or 'auto') with fsdp, or parallelism = 'ddp'",
        )
    _fsdp_api()


def check_world_size(checkpoint: Mapping[str, Any], world_size: int, path: str | Path) -> None:
    """Resharding is exact when the consumed micro-batches split evenly over the new ranks: the
    data order and the noise are functions of the global micro-batch index alone."""

    consumed = int(checkpoint["micro_batches_seen"])
    if consumed % world_size:
        saved = checkpoint.get("world_size", "unknown")
        raise UserError(
            f"the checkpoint has consumed {consumed} micro-batches (saved with world size {saved}), which "
            f"{world_size} processes cannot split evenly",
            path=path,
            fix=f"resume with a number of processes that divides {consumed}, e.g. the saved {saved}",
        )


def kept_accumulation(
    checkpoint: Mapping[str, Any],
    batch_size: int,
    accumulation: int,
    world_size: int,
    path: str | Path,
    allow_change: bool = False,
) -> tuple[int, str | None]:
    """The accumulation that keeps a checkpoint's global batch (batch_size x accumulation x processes)
    on `world_size` processes, and a sentence for the start of the run when it is not the config's.

    A recipe continues as it began on another number of processes (torchtitan's global batch): 2 GPUs
    at accumulation 1 continue on 1 at accumulation 2, which also sees the same micro-batches and noise.
    Where the global batch cannot be kept, the resume is refused unless `allow_change` continues with
    the config's accumulation on purpose."""

    saved_world = checkpoint.get("world_size")
    training = (checkpoint.get("config") or {}).get("training") or {}
    saved_batch, saved_accumulation = training.get("batch_size"), training.get("gradient_accumulation_steps", 1)
    if not all(isinstance(value, int) for value in (saved_world, saved_batch, saved_accumulation)):
        return accumulation, None  # written before world sizes were recorded: nothing to keep
    if saved_world == world_size:
        return accumulation, None
    saved_global = saved_batch * saved_accumulation * saved_world
    now = f"{world_size} process{'es' * (world_size != 1)}"
    if saved_global % (batch_size * world_size) == 0:
        kept = saved_global // (batch_size * world_size)
        return kept, (
            f"global batch {saved_global} kept on {now}: gradient accumulation {kept} "
            f"(the run used {saved_accumulation} on {saved_world})"
        )
    changed = batch_size * accumulation * world_size
    if allow_change:
        return accumulation, f"global batch changed from {saved_global} to {changed} on {now} (--allow-batch-change)"
    divisors = [n for n in range(1, saved_global // batch_size + 1) if saved_global % (batch_size * n) == 0]
    raise UserError(
        f"the run's global batch of {saved_global} sequences (batch_size {saved_batch} x accumulation "
        f"{saved_accumulation} x {saved_world} processes) cannot be kept on {now} of batch_size {batch_size}",
        path=path,
        fix=f"resume on {', '.join(map(str, divisors[:6]))} processes, or pass --allow-batch-change to continue "
        f"with a global batch of {changed}",
    )


# ---------------------------------------------------------------------------------------------
# FSDP2 and DTensor imports (public since torch 2.6 / 2.5, under private names in 2.4)
# ---------------------------------------------------------------------------------------------


@functools.cache
def _fsdp_api() -> tuple[Callable[..., Any], type]:
    """`fully_shard` and `FSDPModule`, or a UserError naming the torch version needed."""

    refusal = UserError(
        f"training.parallelism = 'fsdp' needs FSDP2 (torch >= 2.4); this is torch {torch.__version__}",
        fix="upgrade torch, or use training.parallelism = 'ddp'",
    )
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule, fully_shard
        except ImportError:
            raise refusal from None
    # lazy (here and below): torch.distributed.checkpoint takes ~0.4 s to import and only sharded
    # models need it; `dlm bench` and single-process training never do.
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if "broadcast_from_rank0" not in StateDictOptions.__dataclass_fields__:  # the initial weights need it
        raise refusal
    return fully_shard, FSDPModule


@functools.cache
def _dtensor_api() -> tuple[type, Callable[..., Any]]:
    try:
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor, distribute_tensor
    return DTensor, distribute_tensor


def is_sharded(model: nn.Module) -> bool:
    """True for a module that FSDP2 sharded (its class then derives from FSDPModule)."""

    if not dist.is_available() or not dist.is_initialized():
        return False
    try:
        _, fsdp_module = _fsdp_api()
    except UserError:
        return False
    return isinstance(model, fsdp_module)


def _is_dtensor(tensor: Tensor) -> TypeGuard[DTensor]:
    return dist.is_initialized() and isinstance(tensor, _dtensor_api()[0])


# ---------------------------------------------------------------------------------------------
# Building and wrapping the model
# ---------------------------------------------------------------------------------------------


def build_model(
    factory: Callable[[], ModuleT], device: torch.device, world: DistributedContext, parallelism: str
) -> ModuleT:
    """The model this process trains: whole on `device`, or FSDP2-sharded when asked under torchrun.

    Call it right after seeding: the weights are those `factory()` draws on one process, so runs
    of any world size and parallelism start from identical weights.
    """

    if not world.active or parallelism != "fsdp":
        return factory().to(device)
    fully_shard, _ = _fsdp_api()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # Only rank 0 materialises the full model (on the CPU, seeded exactly like a single process);
    # the others build it on the meta device and never hold more than their shard.
    if world.is_main:
        model = factory()
        full_state = model.state_dict()
    else:
        with torch.device("meta"):
            model = factory()
        full_state = {}
    mesh = init_device_mesh(device.type, (world.world_size,))
    # One unit per block: a block's weights are all-gathered just before it runs and freed
    # after; the root unit holds the rest (the tied embedding / head and the final norm).
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not world.is_main:
        model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full_state, options=options)
    # The root returns its logits as a slice (the vocabulary padding dropped). FSDP warns that an
    # in-place op on such a view would skip its backward hook; the loss only reads the logits.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    # Buffers (non-persistent, e.g. rotary tables) are not in the state dict: rank 0 sends them.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    return model


def wrap_model(model: nn.Module, world: DistributedContext, parallelism: str, compile_scope: str | None) -> nn.Module:
    """The module the training step calls: compiled and/or wrapped for data parallelism.

    `compile_scope` None runs eagerly; "blocks" compiles each transformer block (the blocks share
    one graph, so compile time does not grow with depth); "model" compiles the whole forward.
    `compile()` works in place, so state_dict keys stay those of the plain model.
    """

    if compile_scope == "blocks" or (compile_scope == "model" and is_sharded(model)):
        # Under FSDP always per block, inside its FSDP unit: the root's forward gathers the masked
        # positions (a data-dependent shape) and stays eager, as in the torchtitan recipe.
        for block in model.blocks:  # type: ignore[union-attr]
            block.compile()
    elif compile_scope == "model":
        model.compile()
    if is_sharded(model) or not world.active:
        return model

    device_ids = None if next(model.parameters()).device.type == "cpu" else [world.local_rank]
    return DistributedDataParallel(model, device_ids=device_ids)


def replicated(tensor: Tensor) -> Tensor:
    """A plain tensor from a result that FSDP leaves as a DTensor (e.g. the global gradient norm)."""

    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


# ---------------------------------------------------------------------------------------------
# Full (single-process layout) state: gathered for saving, scattered on resume
# ---------------------------------------------------------------------------------------------


def _parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in the order of `optimizer.state_dict()` indices."""

    names = {parameter: name for name, parameter in model.named_parameters()}
    return [names[parameter] for group in optimizer.param_groups for parameter in group["params"]]


def _index_keyed(state: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict (torch.distributed.checkpoint) -> `Optimizer.state_dict()`."""

    index = {name: position for position, name in enumerate(names)}
    groups = [{**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]]
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def _name_keyed(state: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": {names[int(i)]: value for i, value in state["state"].items()}, "param_groups": groups}


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """The plain model's state dict. Under FSDP a collective: every rank calls, rank 0 gets the
    full tensors on the CPU and the other ranks an empty dict."""

    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # A full state dict holds plain tensors, never shards.
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, Tensor], state)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` as one process would have it (collective under FSDP, as above)."""

    if not is_sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    return _index_keyed(state, _parameter_names(model, optimizer)) if state else {}


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Tensor], optimizer_state: dict[str, Any]
) -> None:
    """Restore full (single-process layout) state; under FSDP each rank keeps its shard.

    Every rank passes the whole state (all ranks read the checkpoint), so no broadcast is needed.
    """

    if not is_sharded(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, cast(dict[str, Any], model_state), options=options)
    names = _parameter_names(model, optimizer)
    set_optimizer_state_dict(model, optimizer, _name_keyed(optimizer_state, names), options=options)


def full_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Whole CPU copies of possibly sharded tensors (an all-gather for each DTensor: collective)."""

    return {name: tensor.full_tensor().cpu() if _is_dtensor(tensor) else tensor for name, tensor in tensors.items()}


def shard_like(full: Mapping[str, Tensor], reference: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Each full tensor laid out like the reference tensor of the same name (sharded when it is).

    Names missing from `reference` pass through unchanged, so the caller's own checks report them.
    """

    if not any(_is_dtensor(tensor) for tensor in reference.values()):
        return dict(full)
    _, distribute_tensor = _dtensor_api()
    result: dict[str, Tensor] = {}
    for name, tensor in full.items():
        like = reference.get(name)
        if like is not None and _is_dtensor(like) and tensor.shape == like.shape:
            tensor = distribute_tensor(
                tensor.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements
            )
        result[name] = tensor
    return result


def launch_local(nproc: int, argv: list[str]) -> int:
    """`dlm train --nproc N ...`: the same command under torchrun on this machine (standalone)."""

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
    process = subprocess.Popen(command)
    # Ctrl-C reaches torchrun from the terminal and torchrun passes it to its workers, which finish
    # the step and save: the launcher must outlive them, not kill torchrun on its KeyboardInterrupt.
    # A SIGTERM sent to the launcher alone (a job scheduler) is passed on the same way.
    received: list[int] = []

    def handle(number: int, frame: object) -> None:
        received.append(number)
        if number == signal.SIGTERM:
            process.send_signal(number)

    previous = {number: signal.signal(number, handle) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = process.wait()
        # torchrun exits 1 after a signal; report the stop as a single `dlm train` would (128 + n).
        return 128 + received[0] if received and code else code
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
