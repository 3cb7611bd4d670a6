"""Sharded checkpoints through torch.distributed.checkpoint (DCP), synchronous or asynchronous.

Each rank hands DCP its own view of the state: under FSDP2 the DTensor shards of the model, the
optimizer (`get_model_state_dict` / `get_optimizer_state_dict`) and the EMA; on one process or under
DDP the whole tensors (which DCP writes once, from one rank). DCP records where every piece of
every tensor lives, so a load into another world size reads exactly the pieces each rank now owns:
resharding 2 -> 1 or 1 -> 2 processes is DCP's planner, not dlm's code.

Only tensors go into DCP (its non-tensor values would be pickled): the optimizer's per-parameter
state, and each rank's RNG and data-order state, whose plain values (Python's, numpy's) travel as
JSON bytes in a uint8 tensor. The run's plain values go into the marker that
`dlm.artifacts.sharded_checkpoint` writes last. The optimizer's param_groups are not saved: the
config's hyperparameters win on resume anyway.

Once DCP has written every rank's files, each rank hashes its own shards and rank 0 gathers the
digests and writes the marker. Asynchronous saves (`training.async_checkpoint`) stage a CPU copy of
this rank's shards, then do all of that in a background thread, on a process group of their own
(so its collectives never interleave with training's). At most one save is in flight: the next
save, the end of the run, a stop signal or an exception waits for it first.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dlm.artifacts.run_dir import check_resumable, check_same_data
from dlm.artifacts.sharded_checkpoint import (
    EMA_PREFIX,
    MODEL_PREFIX,
    complete_checkpoint,
    complete_checkpoints,
    hash_files,
    rank_files,
    read_marker,
    sharded_step,
    single_process_quiet,
    step_directory_name,
)
from dlm.artifacts.sharded_checkpoint import check_files as check_checkpoint_files
from dlm.config.optimizer_registry import optimizer_spec
from dlm.config.schema import TrainingConfig
from dlm.errors import UserError
from dlm.runtime.rng import capture_rng_state, restore_rng_state
from dlm.train.distributed import DistributedContext, check_world_size
from dlm.train.optimizer import configured_hyperparameters_kept
from dlm.train.step import RunCounters

if TYPE_CHECKING:
    from dlm.train.trainer import Trainer

OPTIMIZER_PREFIX = "optim."
_JSON_KEY = "json"
_TENSOR_TAG = "__tensor__"


def rank_prefix(rank: int) -> str:
    return f"rank{rank}."


# ---------------------------------------------------------------------------------------------
# Nested plain state <-> flat tensors (RNG and data-order state)
# ---------------------------------------------------------------------------------------------


def flatten_rank_state(state: Mapping[str, Any], prefix: str) -> dict[str, Tensor]:
    """Each tensor under `prefix + its path`; the structure and the other leaves in one JSON
    document (a tensor leaf there names its key), stored as uint8 bytes under `prefix + "json"`."""

    tensors: dict[str, Tensor] = {}

    def visit(value: Any, path: str) -> Any:
        if isinstance(value, Tensor):
            tensors[prefix + path] = value.detach().cpu()
            return {_TENSOR_TAG: prefix + path}
        if isinstance(value, Mapping):
            return {str(key): visit(item, f"{path}.{key}" if path else str(key)) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [visit(item, f"{path}.{index}") for index, item in enumerate(value)]
        return value

    document = json.dumps(visit(state, "")).encode()
    tensors[prefix + _JSON_KEY] = torch.frombuffer(bytearray(document), dtype=torch.uint8)
    return tensors


def unflatten_rank_state(tensors: Mapping[str, Tensor], prefix: str) -> dict[str, Any]:
    """The inverse of `flatten_rank_state` (lists and tuples both come back as lists)."""

    def rebuild(node: Any) -> Any:
        if isinstance(node, dict) and set(node) == {_TENSOR_TAG}:
            return tensors[node[_TENSOR_TAG]]
        if isinstance(node, dict):
            return {key: rebuild(item) for key, item in node.items()}
        if isinstance(node, list):
            return [rebuild(item) for item in node]
        return node

    document = json.loads(bytes(tensors[prefix + _JSON_KEY].tolist()).decode())
    return cast(dict[str, Any], rebuild(document))


# ---------------------------------------------------------------------------------------------
# The tensors of one rank
# ---------------------------------------------------------------------------------------------


def _optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(the FQN-keyed optimizer state dict, its per-parameter tensors under flat keys)."""

    state = cast(dict[str, Any], get_optimizer_state_dict(model, optimizer))  # initialises an empty state first
    flat: dict[str, Tensor] = {}
    per_parameter = cast(dict[str, dict[str, Any]], state["state"])
    for name, values in per_parameter.items():
        for key, value in values.items():
            if not isinstance(value, Tensor):
                raise ValueError(f"optimizer state {name}.{key} is a {type(value).__name__}, not a tensor")
            flat[f"{OPTIMIZER_PREFIX}{name}.{key}"] = value
    return state, flat


def training_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, ema: Any
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(optimizer state dict, the model's, optimizer's and EMA's tensors of this rank by DCP key)."""

    model_state = cast(dict[str, Tensor], get_model_state_dict(model))
    tensors = {MODEL_PREFIX + name: value for name, value in model_state.items()}
    optimizer_state, flat = _optimizer_tensors(model, optimizer)
    tensors.update(flat)
    if ema is not None:
        tensors.update({EMA_PREFIX + name: value for name, value in zip(ema.names, ema.shadow, strict=True)})
    return optimizer_state, tensors


def rank_share(tensors: Mapping[str, Tensor], rank: int, world_size: int) -> dict[str, Tensor]:
    """This rank's part of replicated tensors: every tensor goes to exactly one rank, the largest first
    to the rank with the fewest bytes so far (the same split on every rank: names and sizes only)."""

    loads = [0] * world_size
    mine: dict[str, Tensor] = {}
    for name in sorted(tensors, key=lambda key: (-tensors[key].numel() * tensors[key].element_size(), key)):
        owner = min(range(world_size), key=lambda index: (loads[index], index))
        loads[owner] += tensors[name].numel() * tensors[name].element_size()
        if owner == rank:
            mine[name] = tensors[name]
    return mine


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    directory: Path
    future: Future[Any]


def reusing_stager() -> Any | None:
    """torch's stager for asynchronous saves, kept for the whole run: it copies each tensor into the CPU
    buffer it staged that tensor in last time, so a save allocates (and page-faults) nothing new. None
    on a torch without it (before 2.9), where every save stages into fresh memory."""

    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import async_save
    except ImportError:
        return None
    if "async_stager" not in inspect.signature(async_save).parameters:
        return None
    # Staged in the calling thread (training then changes the originals), into plain memory: pinned
    # or shared pages would only pay off with a CUDA stream or a separate writer process.
    return DefaultStager(StagingOptions(False, False, False, False))


class ShardedCheckpointer:
    """Writes `step-N/` directories with DCP; one per run, built on every rank at the same point."""

    def __init__(self, world: DistributedContext, run_dir: Path, keep_last: int, asynchronous: bool) -> None:
        self.world, self.run_dir, self.keep_last, self.asynchronous = world, run_dir, keep_last, asynchronous
        # Collective: every rank builds its checkpointer at the same point of the run.
        self.group = dist.new_group(backend="gloo") if asynchronous and world.active else None
        self.stager = reusing_stager() if asynchronous else None
        self._pending: _Pending | None = None
        self._no_dist = not dist.is_initialized()  # one process: DCP then needs no process group

    def failed_here(self) -> bool:
        """Whether this rank's save in flight has failed (the loop agrees on it over ranks)."""

        pending = self._pending
        return pending is not None and pending.future.done() and pending.future.exception() is not None

    def stop_after_failure(self) -> None:
        """Some rank's save failed: every rank raises, this one with its own reason if it has one."""

        directory = self._pending.directory if self._pending is not None else self.run_dir
        self.wait()
        raise self._failure(directory, RuntimeError("another process could not write its shards"))

    def save(self, tensors: dict[str, Tensor], step: int, record: Mapping[str, Any]) -> Path:
        """Write `tensors` (this rank's) into `step-N/`; rank 0 completes it with `record`.

        Synchronous: complete when this returns. Asynchronous: returns once this rank's shards are
        staged in CPU memory; training may then change the originals.
        """

        if self._pending is not None:
            raise RuntimeError("a save is still in flight: wait() for it first")
        directory = self.run_dir / step_directory_name(step)
        if self.world.is_main and directory.exists():
            # A step saved again after resuming from an older checkpoint: the abandoned one goes.
            shutil.rmtree(directory)
        self.world.barrier()
        writer = dcp.FileSystemWriter(str(directory), sync_files=True, thread_count=1)
        if self.asynchronous:
            reuse = {} if self.stager is None else {"async_stager": self.stager}
            with single_process_quiet():
                future = cast(
                    Future[Any],  # a Future unless a zero-overhead stager is passed (none is)
                    dcp.async_save(
                        tensors, storage_writer=writer, process_group=self.group, no_dist=self._no_dist, **reuse
                    ),
                )
            done: Future[Any] = Future()
            future.add_done_callback(lambda finished: self._complete(finished, directory, record, done))
            self._pending = _Pending(directory, done)
        else:
            finished: Future[Any] = Future()
            try:
                with single_process_quiet():
                    finished.set_result(dcp.save(tensors, storage_writer=writer, no_dist=self._no_dist))
            except (Exception, CheckpointException) as exc:  # reported by `wait`, as an async failure is
                finished.set_exception(exc)
            done = Future()
            self._complete(finished, directory, record, done)
            self._pending = _Pending(directory, done)
        return directory

    def _complete(self, finished: Future[Any], directory: Path, record: Mapping[str, Any], done: Future[Any]) -> None:
        """After DCP wrote every rank's files (its `.metadata` comes last): each rank hashes its own
        shards, rank 0 gathers the digests and writes the marker. In the background thread of an
        asynchronous save this collective runs on the save's own group, after DCP's."""

        try:
            finished.result()  # DCP failed on every rank or on none (it agrees over ranks)
            try:
                part: dict[str, str] | str = hash_files(rank_files(directory, self.world.rank))
            except OSError as exc:  # still joins the gather below, so that no rank waits forever
                part = f"cannot read its own shards: {exc.strerror or exc}"
            parts: list[dict[str, str] | str | None] = [part]
            if self.world.active:
                parts = [None] * self.world.world_size
                dist.all_gather_object(parts, part, group=self.group)
            if failed := next((item for item in parts if isinstance(item, str)), None):
                raise OSError(failed)
            hashes = {name: digest for item in parts if isinstance(item, dict) for name, digest in item.items()}
            if self.world.is_main:
                complete_checkpoint(directory, record, hashes, self.keep_last)
            done.set_result(directory)
        except BaseException as exc:
            done.set_exception(exc)

    def collect(self) -> Path | None:
        """The directory of the save in flight once it has completed (then it is no longer in
        flight); None while it runs, when it failed (see `failed_here`) or when there is none."""

        pending = self._pending
        if pending is None or not pending.future.done() or pending.future.exception() is not None:
            return None
        self._pending = None
        return pending.directory

    def wait(self) -> Path | None:
        """Wait for the save in flight and return its directory (None without one); a failed one
        stops the run with the last complete checkpoint kept."""

        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.future.result()
        except (Exception, CheckpointException) as exc:
            raise self._failure(pending.directory, exc) from None
        return pending.directory

    def close(self) -> None:
        """At exit, whatever the reason: the save in flight completes (or fails) before the process ends."""

        pending, self._pending = self._pending, None
        if pending is not None:
            # The run is already ending with its own error; a failed save simply never gets its marker.
            with contextlib.suppress(Exception, CheckpointException):
                pending.future.result()
        if self.stager is not None:
            self.stager.close()  # its CPU copies of the state go with the run
            self.stager = None

    def _failure(self, directory: Path, exc: BaseException) -> UserError:
        reason = _os_reason(exc)
        kept = [path for _, path in complete_checkpoints(self.run_dir)]
        last = f"the last complete checkpoint {kept[-1]} is kept" if kept else "no complete checkpoint was written yet"
        return UserError(
            f"could not write the checkpoint {directory.name}: {reason}; training stopped and {last} "
            f"(the incomplete {directory.name} is removed by the next run)",
            path=self.run_dir,
            fix=f"free some disk space, then continue with: dlm resume {self.run_dir}",
        )


def _os_reason(exc: BaseException) -> str:
    """The OSError behind a failed save, which DCP wraps (per rank) in its own exception."""

    seen: list[BaseException] = [exc]
    while seen:
        error = seen.pop()
        if isinstance(error, OSError):
            return error.strerror or str(error)
        if isinstance(error, CheckpointException):  # {rank: (exception, traceback)}
            seen += [value[0] for value in error.failures.values()]
        seen += [item for item in (error.__cause__, error.__context__) if item is not None]
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def verify_checkpoint(directory: Path, world: DistributedContext) -> dict[str, Any]:
    """The marker, once every file matched its sha256: the files are split over the ranks and
    any rank's refusal is raised on every rank (all take the same branch)."""

    record = read_marker(directory)
    names = sorted(record["files"])[world.rank :: world.world_size]
    problem: str | None = None
    try:
        check_checkpoint_files(directory, record, names)
    except UserError as exc:
        problem = str(exc)
    if world.active:
        problems: list[str | None] = [None] * world.world_size
        dist.all_gather_object(problems, problem)
        problem = next((item for item in problems if item is not None), None)
    if problem is not None:
        raise UserError(problem)
    return record


def load_training_tensors(
    directory: Path,
    record: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: Any,
    world: DistributedContext,
) -> dict[str, Any]:
    """Load the model, optimizer and EMA in place (resharded to this world size); returns this
    rank's RNG and data-order state (rank 0's when the saving run had fewer ranks)."""

    entries = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    source = world.rank if f"{rank_prefix(world.rank)}{_JSON_KEY}" in entries else 0
    optimizer_state, tensors = training_tensors(model, optimizer, ema if record.get("ema") else None)
    missing = sorted(key for key in tensors if key not in entries)
    if missing:
        raise UserError(
            f"the checkpoint lacks {len(missing)} tensors this model needs (e.g. {missing[0]})",
            path=directory,
            fix="resume with the model and optimizer config the run was saved with",
        )
    prefix = rank_prefix(source)
    for key, meta in entries.items():
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
            tensors[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with single_process_quiet():
        dcp.load(tensors, storage_reader=FileSystemReader(str(directory)), no_dist=not dist.is_initialized())
    model_state = {
        key.removeprefix(MODEL_PREFIX): value for key, value in tensors.items() if key.startswith(MODEL_PREFIX)
    }
    set_model_state_dict(model, cast(dict[str, Any], model_state))
    set_optimizer_state_dict(model, optimizer, optimizer_state)
    if ema is not None and record.get("ema"):
        ema.num_updates = int(record["ema"]["num_updates"])
    return unflatten_rank_state(tensors, prefix)


# ---------------------------------------------------------------------------------------------
# The trainer's sharded save and resume
# ---------------------------------------------------------------------------------------------


def sharded_checkpointer(training: TrainingConfig, world: DistributedContext) -> ShardedCheckpointer | None:
    """The run's checkpointer when its checkpoints are sharded (`checkpoint_format` resolved), else None."""

    if training.resolved_checkpoint_format(world.world_size) != "dcp":
        return None
    return ShardedCheckpointer(world, training.output_dir, training.keep_last_checkpoints, training.async_checkpoint)


def save_trainer(trainer: Trainer, checkpointer: ShardedCheckpointer) -> Path:
    """Hand every rank's shards of the trainer's state to `checkpointer` (a collective). Its
    `checkpoint` event comes once it is complete: at once, or for an asynchronous save when the
    loop finds it finished (`report_saves`)."""

    step = trainer.step
    _, tensors = training_tensors(step.model, step.optimizer, step.ema)
    if trainer.world.active and trainer.config.parallelism != "fsdp":
        # DDP's tensors are whole on every rank: each rank hands DCP only its share, so that an
        # asynchronous save stages 1 / W of the state per rank, not all of it on every rank.
        tensors = rank_share(tensors, trainer.world.rank, trainer.world.world_size)
    rank_state = {"rng": capture_rng_state(trainer.device), "data_generator": trainer.data_generator.get_state()}
    tensors.update(flatten_rank_state(rank_state, rank_prefix(trainer.world.rank)))
    ema = None if step.ema is None else {"decay": step.ema.decay, "num_updates": step.ema.num_updates}
    record = {**trainer.record(), "scaler": step.scaler.state_dict(), "ema": ema}
    report_saves(trainer, block=True)  # at most one save in flight
    path = checkpointer.save(tensors, trainer.counters.step, record)
    if not checkpointer.asynchronous:
        report_saves(trainer, block=True)
        trainer.world.barrier()  # no rank returns before the marker exists
    trainer.checkpoint_path = path
    return path


def report_saves(trainer: Trainer, block: bool) -> None:
    """Report the save in flight once complete (rank 0's sink, from the training thread): at
    once when `block` (waiting for it), else only if it has completed already."""

    checkpointer = trainer.checkpointer
    if checkpointer is None:
        return
    path = checkpointer.wait() if block else checkpointer.collect()
    if path is not None and trainer.world.is_main:
        trainer.announce_checkpoint(sharded_step(path) or 0, path)


def load_trainer(trainer: Trainer, directory: Path, allow_data_change: bool, allow_batch_change: bool = False) -> None:
    """Resume the trainer from a sharded checkpoint, on this world size whatever the saved one."""

    directory = directory.resolve()  # `latest` is a link
    record = verify_checkpoint(directory, trainer.world)
    check_resumable(record, trainer.experiment, trainer.tokenizer_sha256, directory, warn=trainer.world.is_main)
    trainer.data_changed = check_same_data(record, trainer.data_sha256, directory, allow_data_change)
    check_world_size(record, trainer.world.world_size, directory)
    trainer.keep_global_batch(record, directory, allow_batch_change)
    step = trainer.step
    resumable = optimizer_spec(trainer.config.optimizer).resumable_hyperparameters
    with configured_hyperparameters_kept(step.optimizer, resumable):
        rank_state = load_training_tensors(directory, record, step.model, step.optimizer, step.ema, trainer.world)
    step.scaler.load_state_dict(record.get("scaler") or {})
    trainer.data_generator.set_state(rank_state["data_generator"])
    restore_rng_state(rank_state["rng"])
    step.counters = RunCounters(
        step=int(record["step"]),
        tokens_seen=int(record["tokens_seen"]),
        micro_batches_seen=int(record["micro_batches_seen"]),
    )
    trainer.recorded_threads = record.get("cpu_threads")


def inference_weights(state: dict[str, Any]) -> dict[str, Tensor]:
    """The weights evaluation should use: the EMA's when there is one (it tracks every parameter).

    Taken from the gathered state rather than by loading the EMA into the model, which would need
    a second gather under FSDP.
    """

    model, ema = state["model"], state["ema"]
    if ema is None:
        return model
    return {name: ema["shadow"].get(name, tensor).to(tensor.dtype) for name, tensor in model.items()}
