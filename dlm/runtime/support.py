"""What a kind of device can run, decided in one place.

Three callers ask: the config validators (about the device a config names, where `auto` may still
become anything), the rest of `dlm.runtime` (about the resolved device) and `dlm bench` (about its --device
option). Each phrases the setting to change in its own terms and takes the reason from here.

This module imports no torch: `dlm.config` uses it and must stay importable without torch.
"""

from __future__ import annotations

FLOAT16_CPU_FIX = "use float32 or bfloat16 on the CPU"


def _kind(device: str) -> str:
    """`cuda:1` -> `cuda`; works on a config string and on `str(torch.device(...))` alike."""

    return device.partition(":")[0]


def precision_problem(precision: str, device: str) -> str | None:
    """Why `precision` cannot train on `device`, or None when it can (or, for `auto`, might)."""

    if precision == "float16" and _kind(device) == "cpu":
        return "float16 training is not supported on the CPU"
    return None


def fused_attention_problem(device: str) -> str | None:
    """Why the fused (flash / memory-efficient) attention kernels cannot run on `device`, or None."""

    if _kind(device) not in ("cuda", "auto"):
        return f"the flash and memory-efficient attention kernels exist only on CUDA, the device is {device}"
    return None
