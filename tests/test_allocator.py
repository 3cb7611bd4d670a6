"""CPU runs keep freed memory for the next step (`dlm.runtime.allocator`): fewer page faults, the
same numbers, and nothing done where the C library is not glibc."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from helpers import ROOT

from dlm.runtime import allocator

GLIBC = allocator._glibc() is not None
CPU = torch.device("cpu")

# Minor page faults and the losses of training steps 3-8 of configs/cpu.toml's model (batch 16),
# in a fresh process, with or without the allocator setting.
_STEPS = """
import json, resource, sys, torch
from dlm.bench.throughput import synthetic_batches
from dlm.config.schema import load_config, with_overrides
from dlm.runtime.allocator import keep_freed_memory
from dlm.train.distributed import DistributedContext
from dlm.train.step import LogWindow, TrainingStep
if sys.argv[2] == "keep":
    assert keep_freed_memory(torch.device("cpu"))
torch.manual_seed(0)
experiment = with_overrides(load_config(sys.argv[1]), ["training.batch_size=16"], "test")
cpu = torch.device("cpu")
step = TrainingStep(experiment, cpu, "float32", DistributedContext())
step.prepare()
batches = synthetic_batches(experiment.model, 16, cpu, 0)
window = LogWindow(cpu)
for _ in range(3):
    step.optimizer_step(batches, window)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step.optimizer_step(batches, window)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"faults": faults, "loss": float(window.loss)}))
"""


@pytest.fixture
def fresh_allocator() -> Iterator[None]:
    allocator._glibc.cache_clear()
    allocator._keep_freed_memory.cache_clear()
    yield
    allocator._glibc.cache_clear()
    allocator._keep_freed_memory.cache_clear()


def _steps(setting: str) -> dict[str, float]:
    command = [sys.executable, "-c", _STEPS, str(ROOT / "configs" / "cpu.toml"), setting]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=None, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_kept_memory_saves_the_page_faults_of_every_step_and_changes_no_number() -> None:
    default, kept = _steps("default"), _steps("keep")
    # Each step allocates and frees its large tensors; glibc unmapped and trimmed them, so the next
    # step faulted their pages in again. Kept, the steps reuse them.
    assert kept["faults"] < default["faults"] / 4, (default, kept)
    assert kept["loss"] == default["loss"]  # where memory comes from changes no float


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_the_setting_is_made_once_per_process(fresh_allocator: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    libc = allocator._glibc()
    assert libc is not None
    real = libc.mallopt

    def counted(parameter: int, value: int) -> int:
        calls.append((parameter, value))
        return real(parameter, value)

    monkeypatch.setattr(libc, "mallopt", counted)
    assert allocator.keep_freed_memory(torch.device("meta")) is False and calls == []  # only a CPU run
    assert allocator.keep_freed_memory(CPU) and allocator.keep_freed_memory(CPU)
    assert calls == [(-3, allocator.MMAP_THRESHOLD), (-1, allocator.TRIM_THRESHOLD)]
    allocator.give_back_freed_memory()  # malloc_trim: the heap's free memory back to the OS


def test_without_glibc_nothing_is_set(fresh_allocator: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # macOS's libc has no mallopt; Windows finds no "c" library at all.
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: "/nonexistent/libc.so")
    assert allocator._glibc() is None and allocator.keep_freed_memory(CPU) is False
    allocator.give_back_freed_memory()  # does nothing, raises nothing
