"""CPU threads: one intra-op thread per free core, measured when a CPU run starts."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

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


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may run on (containers, taskset)
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat (Linux), or None."""

    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[3] + fields[4], sum(fields[:8])) if len(fields) >= 8 else None  # idle + iowait


def busy_cores(sample_seconds: float = BUSY_SAMPLE_SECONDS) -> float | None:
    """Cores' worth of work running now: the lower of the 1-minute load average and the CPU time
    used over the last `sample_seconds` (/proc/stat). The load average alone lags by a minute: after
    a job ends it still counts it, and a run starting then took one thread on an idle machine."""

    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this system
        load = None
    before = _cpu_times()
    if before is None:
        return load
    time.sleep(sample_seconds)
    after = _cpu_times()
    if after is None or after[1] <= before[1]:
        return load
    idle, total = after[0] - before[0], after[1] - before[1]
    sampled = (1.0 - idle / total) * (os.cpu_count() or 1)
    return sampled if load is None else min(load, sampled)


def plan_cpu_threads(processes: int = 1, load: float | None = None) -> ThreadPlan:
    """One thread per free core, at least one. Threads beyond the free cores spin against other
    work: a tiny model ran 20x slower on two oversubscribed threads than on one idle one.
    `load` (cores' worth of other work) defaults to `busy_cores()`. `OMP_NUM_THREADS` overrides
    the measurement; `processes` share the cores (CPU data parallel)."""

    cores = _usable_cores()
    requested = os.environ.get("OMP_NUM_THREADS", "").strip()
    if requested.isdigit() and int(requested) > 0:
        return ThreadPlan(cores, None, int(requested), "OMP_NUM_THREADS")
    if load is None:
        load = busy_cores()
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
