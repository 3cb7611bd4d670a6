"""Memory: accelerator allocation and peaks, running out of it, and this process's peak resident memory."""

from __future__ import annotations

import sys

import torch

from dlm.fileio import GIB


def memory_stats(device: torch.device) -> dict[str, float]:
    """Allocated / reserved / peak-allocated accelerator memory in GiB (zeros off CUDA)."""

    if device.type != "cuda":
        return {"allocated_gib": 0.0, "reserved_gib": 0.0, "peak_allocated_gib": 0.0}
    return {
        "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
    }


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is the device running out of memory: the CUDA allocator's OutOfMemoryError, the
    same condition as a plain RuntimeError from cuBLAS / cuDNN workspaces or bitsandbytes, or the CPU
    allocator's "can't allocate memory"."""

    text = str(exc).lower()
    return isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
    )


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (bench measures each configuration separately)."""

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_rss_gib() -> float | None:
    """Peak resident memory of this process in GiB; None where the OS does not report it."""

    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    scale = 1.0 if sys.platform == "darwin" else 1024.0
    return peak * scale / GIB
