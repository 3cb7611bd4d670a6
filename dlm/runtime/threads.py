"""CPU threads: one intra-op thread per free core, measured when a CPU run starts; a resumed run takes
the count its checkpoint recorded, since float sums, and so the weights, depend on it.

"Free" counts only what this process may use: the CPUs of its affinity mask (taskset, a container's
cpuset), capped by its cgroup CPU quota, less the work running on those CPUs; never the whole host."""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from dlm.errors import UserNote

BUSY_SAMPLE_SECONDS = 0.1  # how long `busy_cores` watches the CPUs before a run picks its threads


@dataclass(frozen=True)
class ThreadPlan:
    """How many intra-op threads a CPU run uses, and why (shown when the run starts)."""

    cores: int
    busy: float | None  # cores' worth of other work (`busy_cores`); None when unknown
    threads: int
    source: str  # "measured" or "OMP_NUM_THREADS"

    def describe(self) -> str:
        if self.source != "measured":
            return f"{self.cores} cores, {self.source}: {self.threads} thread{'s' * (self.threads != 1)}"
        busy = "load unknown" if self.busy is None else f"{self.busy:.1f} busy"
        return f"{self.cores} cores, {busy}: {self.threads} thread{'s' * (self.threads != 1)}"


CGROUP_ROOT = Path("/sys/fs/cgroup")


def _affinity() -> set[int] | None:
    """The CPUs this process may run on (containers, taskset); None where the system cannot say."""

    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return None


def quota_cores(root: Path = CGROUP_ROOT, membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """Whole cores' worth of this process's cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`), the smallest of its cgroup and every parent, at least one; None without a
    quota. A container limited to 4 CPUs on a 64-core host gets 4 here, whatever its affinity says."""

    try:
        lines = membership.read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    own = [
        parts[2]
        for parts in (line.split(":", 2) for line in lines)
        if len(parts) == 3 and (parts[1] == "" or "cpu" in parts[1].split(","))
    ]
    quotas = []
    for path in own or ["/"]:
        for directory in _up_to_root(root, path):  # v2: "max 100000" or "400000 100000"
            fields = _read_fields(directory / "cpu.max")
            if fields and len(fields) == 2 and fields[0] != "max":
                quotas.append(_cores(fields[0], fields[1]))
        for name in ("cpu", "cpu,cpuacct"):  # v1: quota -1 means none
            for directory in _up_to_root(root / name, path):
                quota = _read_fields(directory / "cpu.cfs_quota_us")
                period = _read_fields(directory / "cpu.cfs_period_us")
                if quota and period and not quota[0].startswith("-"):
                    quotas.append(_cores(quota[0], period[0]))
    found = [quota for quota in quotas if quota is not None]
    return min(found) if found else None


def _up_to_root(root: Path, path: str) -> list[Path]:
    """`root / path` and each of its parents up to `root` itself."""

    parts = [part for part in path.split("/") if part and part != ".."]
    return [root.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _read_fields(path: Path) -> list[str] | None:
    try:
        return path.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        return None


def _cores(quota: str, period: str) -> int | None:
    try:
        return max(1, int(quota) // int(period)) if int(period) > 0 else None
    except ValueError:
        return None


def usable_cores() -> int:
    """The CPUs this process may run on, capped by its cgroup quota."""

    cpus = _affinity()
    count = len(cpus) if cpus else (os.cpu_count() or 1)
    quota = quota_cores()
    return count if quota is None else min(count, quota)


def _cpu_times(cpus: set[int] | None = None, stat_path: Path = Path("/proc/stat")) -> tuple[int, int] | None:
    """(idle, total) jiffies summed over `cpus` (all CPUs when None) from /proc/stat (Linux), or None."""

    try:
        with open(stat_path, encoding="ascii") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu")]
    except (OSError, ValueError):
        return None
    idle = total = 0
    for name, *values in lines:
        wanted = name == "cpu" if cpus is None else name[3:].isdigit() and int(name[3:]) in cpus
        if wanted and len(values) >= 8:
            fields = [int(value) for value in values[:8]]
            idle, total = idle + fields[3] + fields[4], total + sum(fields)  # idle + iowait
    return (idle, total) if total else None


def busy_cores(sample_seconds: float = BUSY_SAMPLE_SECONDS) -> float | None:
    """Cores' worth of work running now on the CPUs this process may use: the CPU time used over the
    last `sample_seconds` (/proc/stat, those CPUs' lines only), and where this process may use every
    CPU, no more than the 1-minute load average (which alone lags by a minute: after a job ends it
    still counts it, and a run starting then took one thread on an idle machine). The host's load
    average counts every CPU, so it is left out when this process has only some of them."""

    cpus = _affinity()
    whole_host = cpus is None or len(cpus) >= (os.cpu_count() or 1)
    load: float | None = None
    if whole_host:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this system
            load = None
    mine = None if whole_host else cpus
    before = _cpu_times(mine)
    if before is None:
        return load
    time.sleep(sample_seconds)
    after = _cpu_times(mine)
    if after is None or after[1] <= before[1]:
        return load
    idle, total = after[0] - before[0], after[1] - before[1]
    sampled = (1.0 - idle / total) * (len(cpus) if cpus else (os.cpu_count() or 1))
    return sampled if load is None else min(load, sampled)


def plan_cpu_threads(processes: int = 1, load: float | None = None) -> ThreadPlan:
    """One thread per free core, at least one. Threads beyond the free cores spin against other
    work: a tiny model ran 20x slower on two oversubscribed threads than on one idle one.
    `load` (cores' worth of other work) defaults to `busy_cores()`. `OMP_NUM_THREADS` overrides
    the measurement; `processes` share the cores (CPU data parallel)."""

    cores = usable_cores()
    requested = os.environ.get("OMP_NUM_THREADS", "").strip()
    if requested.isdigit() and int(requested) > 0:
        return ThreadPlan(cores, None, int(requested), "OMP_NUM_THREADS")
    if load is None:
        load = busy_cores()
    cpus = len(_affinity() or ()) or cores
    if cpus > cores:  # a quota narrower than the CPUs it may run on: the load is over all of those CPUs
        busy = None if load is None else min(float(cpus), max(0.0, load))
        free = min(float(cores), cpus - (busy or 0.0))
    else:
        busy = None if load is None else min(float(cores), max(0.0, load))
        free = cores - (busy or 0.0)
    threads = max(1, math.floor(free / max(processes, 1) + 0.5))
    return ThreadPlan(cores, busy, min(threads, cores), "measured")


def configure_cpu_threads(device: torch.device, processes: int = 1) -> ThreadPlan | None:
    """Set torch's intra-op threads for a CPU run (others keep their setting); return the plan."""

    if device.type != "cpu":
        return None
    plan = plan_cpu_threads(processes)
    torch.set_num_threads(plan.threads)
    return plan


def resume_cpu_threads(plan: ThreadPlan | None, recorded: int | None) -> ThreadPlan | None:
    """The threads of a resumed CPU run: the count its checkpoint recorded, whatever the load now,
    because float sums (and so the weights) depend on how the work splits over threads. An explicit
    OMP_NUM_THREADS still wins, with a note that the run then no longer continues bit for bit."""

    if plan is None or recorded is None:
        return plan
    if plan.source != "measured":
        if plan.threads != recorded:
            warnings.warn(
                f"OMP_NUM_THREADS={plan.threads}, where the run used {recorded} threads: it continues, "
                "but no longer bit-identical to an uninterrupted run (unset OMP_NUM_THREADS to reuse "
                f"{recorded})",
                UserNote,
                stacklevel=2,
            )
        return plan
    if recorded > plan.cores:
        warnings.warn(
            f"the run recorded {recorded} CPU threads and this machine gives it {plan.cores} cores: it "
            "continues bit for bit but oversubscribed, which can be many times slower (set "
            "OMP_NUM_THREADS to trade exactness for speed)",
            UserNote,
            stacklevel=2,
        )
    torch.set_num_threads(recorded)
    return ThreadPlan(plan.cores, plan.busy, recorded, "as the checkpoint recorded")
