"""The measuring primitives every dlm benchmark shares: interleaved rounds, CPU and wall time, a machine stamp.

On a shared machine absolute times say little, so a comparison runs its candidates in rounds, each
round running every candidate once with the order rotated, and reports ratios of what they measured
in the same rounds. Each run records both the process's CPU seconds (all its threads; other work on
the machine disturbs them far less) and wall seconds. `MachineStamp` says where a figure was measured:
the CPU and the instruction sets that change its kernels, the cores, the load, the versions and the
commit, so a result file read months later still says what it is.
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dlm import __version__
from dlm.bench.setup import device_name, proc_field
from dlm.runtime.threads import usable_cores

# The instruction sets that change which CPU kernels run (ATen's AVX2 / AVX-512 paths, oneDNN's
# bfloat16 and AMX paths): a figure from one class of CPU does not carry to another.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma", "neon", "asimd")


@dataclass(frozen=True)
class Timing:
    """One timed run: the process's CPU seconds (every thread) and the wall seconds it took."""

    cpu_s: float
    wall_s: float


@dataclass(frozen=True)
class MachineStamp:
    """Where and when a figure was measured."""

    date: str  # UTC, ISO 8601
    cpu: str
    cpu_flags: list[str]
    cores: int  # usable by this process (its affinity mask and cgroup quota)
    threads: int  # torch's intra-op threads
    load_average: list[float]  # 1, 5 and 15 minutes, when the measurement began
    gpu: str | None
    torch: str
    dlm: str
    python: str
    platform: str
    commit: str | None  # `git describe`-style: the short hash, "+dirty" with uncommitted changes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line for a document: date, commit, CPU, cores and versions."""

        gpu = f", {self.gpu}" if self.gpu else ""
        return (
            f"{self.date[:10]}, commit {self.commit or 'unknown'}, {self.cpu} ({self.cores} cores{gpu}), "
            f"torch {self.torch}, load average {self.load_average[0]:.1f}"
        )


def _cpu_flags() -> list[str]:
    flags = proc_field("/proc/cpuinfo", "flags") or proc_field("/proc/cpuinfo", "Features") or ""  # x86, Arm
    present = set(flags.split())
    return [flag for flag in _CPU_FLAGS if flag in present]


def git_commit(root: Path) -> str | None:
    """The short commit of the checkout at `root`, "+dirty" when tracked files differ; None outside git."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")


def machine_stamp(root: Path | None = None) -> MachineStamp:
    """This machine, now; `root` is the checkout whose commit to record (default: none)."""

    gpu = device_name(torch.device("cuda")) if torch.cuda.is_available() else None
    return MachineStamp(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        cpu=device_name(torch.device("cpu")),
        cpu_flags=_cpu_flags(),
        cores=usable_cores(),
        threads=torch.get_num_threads(),
        load_average=[round(value, 2) for value in os.getloadavg()] if hasattr(os, "getloadavg") else [],
        gpu=gpu,
        torch=torch.__version__,
        dlm=__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        commit=None if root is None else git_commit(root),
    )


def timed(run: Callable[[], object]) -> Timing:
    """Time one call: CPU seconds of this process (every thread) and wall seconds."""

    cpu, wall = time.process_time(), time.perf_counter()
    run()
    return Timing(cpu_s=time.process_time() - cpu, wall_s=time.perf_counter() - wall)


def self_timed(run: Callable[[], object]) -> Timing:
    """The timer for a candidate that times itself and returns its `Timing` (a whole process)."""

    timing = run()
    if not isinstance(timing, Timing):
        raise TypeError(f"a self-timed candidate returns a Timing, not {type(timing).__name__}")
    return timing


def timed_process(
    command: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> tuple[Timing, str]:
    """Run a command to completion: its CPU seconds (user + system, children included), wall seconds, stdout.

    A failing command raises `subprocess.CalledProcessError` with its stderr.
    """

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    completed = subprocess.run(
        list(command), capture_output=True, text=True, env=None if env is None else dict(env), cwd=cwd
    )
    elapsed = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise subprocess.CalledProcessError(completed.returncode, list(command), completed.stdout, completed.stderr)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(cpu_s=cpu, wall_s=elapsed), completed.stdout


def interleaved(
    candidates: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    timer: Callable[[Callable[[], object]], Timing] = timed,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[Timing]]:
    """Time every candidate once per round for `rounds` rounds, after `warmup` untimed calls of each.

    The order rotates every round, so no candidate always follows another's cache pollution, and all
    see the machine's other load at nearly the same moment: the ratio of their figures within a
    round holds where their absolute times do not.
    """

    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    names = list(candidates)
    for _ in range(warmup):
        for name in names:
            candidates[name]()
    timings: dict[str, list[Timing]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            timings[name].append(timer(candidates[name]))
            if progress is not None:
                progress(f"round {round_index + 1}/{rounds}: {name} {timings[name][-1].wall_s:.3f} s")
    return timings


def round_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """Each round's ratio of two candidates' figures (rounds paired by position)."""

    return [a / b for a, b in zip(numerator, denominator, strict=True)]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, least and most of a list of figures: what a result file keeps beside the raw rounds."""

    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def saved_for_backward(model: torch.nn.Module, run: Callable[[], object]) -> int:
    """Bytes of the tensors `run` (a forward, or a whole step) keeps for the backward pass, each storage
    once and the model's own parameters left out: the activations and weight copies, as autograd holds them."""

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(kept.values())
