"""The C allocator under CPU work: keep freed memory for the next step instead of giving it back.

glibc's malloc serves each allocation above its mmap threshold (128 KB, rising to at most 32 MB as
such blocks are freed) with a fresh mapping, unmaps it when it is freed, and trims the top of its
heap whenever more than 128 KB is free there. A training step on the CPU allocates and frees the
same large tensors every step (the logits at the masked positions alone are tens of MB), so every
step faulted all their pages in again, zeroed by the kernel. On `configs/cpu.toml`'s model on 2
cores a training step took 1.5x (float32) to 1.65x (bfloat16) the time it takes with the memory
kept, which costs peak resident memory: 6% more in float32, half again in bfloat16, at 0.7 (0.11 lab
notes, "The CPU allocator": git show cece22c:docs/benchmarks.md; `git show cece22c:scripts/cpu_allocator.py`
measures it).

`keep_freed_memory` raises both thresholds for the process. Only glibc has them: on macOS, Windows
and other C libraries it does nothing. The CPU runs call it (training, `dlm bench` and the time
budget's calibration, evaluation, serving), so that a timing and the run it plans see the same
allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

# mallopt parameters (malloc.h) and the values set: a 1 GiB mmap threshold keeps every tensor a
# small model's step allocates in the heap, and a trim threshold of 2 GiB - 1 (the largest an int
# holds) keeps the freed heap for reuse.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it has glibc's mallopt and malloc_trim, else None."""

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    except (OSError, AttributeError, TypeError):  # no C library by that name, or not glibc's functions
        return None
    return libc


def keep_freed_memory(device: torch.device) -> bool:
    """For a run on `device`: on the CPU, make glibc's malloc keep freed memory for reuse (once per
    process). False off the CPU and where the C library is not glibc."""

    return device.type == "cpu" and _keep_freed_memory()


@functools.cache
def _keep_freed_memory() -> bool:
    libc = _glibc()
    if libc is None:
        return False
    kept = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return bool(kept) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def give_back_freed_memory() -> None:
    """Return the free memory the heap kept to the OS now (between the configurations of a benchmark,
    so that each one's peak resident memory is its own)."""

    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
