"""Peak FLOP/s: the one table the dashboard, bench and MFU use."""

from __future__ import annotations

import re

import torch

# Dense (no sparsity) datasheet tensor-core TFLOP/s: bf16 and fp16 with fp32 accumulation, and
# TF32 for float32 matmuls. Patterns are matched against torch.cuda.get_device_name() in order,
# so variants come before their family ("H100 PCIe" before "H100"). Word boundaries keep "A10"
# from matching "A100" / "A10G" and "H200" from matching "GH200". None = no such tensor cores.
_PEAK_TFLOPS: tuple[tuple[str, dict[str, float | None]], ...] = (
    (r"\bGH200\b", {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}),
    (r"\bH200 NVL\b", {"bfloat16": 835.5, "float16": 835.5, "float32": 417.5}),
    (r"\bH200\b", {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}),
    (r"\bH100 PCIe\b", {"bfloat16": 756.5, "float16": 756.5, "float32": 378.0}),
    (r"\bH100 NVL\b", {"bfloat16": 835.5, "float16": 835.5, "float32": 417.5}),
    (r"\bH100\b", {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7}),
    (r"\bA100\b", {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0}),
    (r"\bA30\b", {"bfloat16": 165.0, "float16": 165.0, "float32": 82.0}),
    (r"\bA10\b", {"bfloat16": 125.0, "float16": 125.0, "float32": 62.5}),
    (r"\bL40S\b", {"bfloat16": 362.05, "float16": 362.05, "float32": 183.0}),
    (r"\bL40\b", {"bfloat16": 181.05, "float16": 181.05, "float32": 90.5}),
    (r"\bL4\b", {"bfloat16": 121.0, "float16": 121.0, "float32": 60.0}),
    (r"\bRTX 4090\b", {"bfloat16": 165.2, "float16": 165.2, "float32": 82.6}),
    (r"\bRTX 3090\b(?! Ti)", {"bfloat16": 71.0, "float16": 71.0, "float32": 35.6}),
    (r"\bV100S\b", {"bfloat16": None, "float16": 130.0, "float32": None}),
    (r"\bV100-PCIE\b", {"bfloat16": None, "float16": 112.0, "float32": None}),
    (r"\bV100-SXM", {"bfloat16": None, "float16": 125.0, "float32": None}),
    (r"\bT4\b", {"bfloat16": None, "float16": 65.0, "float32": None}),
)


def peak_flops_for_name(device_name: str, precision: str) -> float | None:
    """Datasheet peak FLOP/s of a GPU by its reported name; None when not known for sure."""

    for pattern, table in _PEAK_TFLOPS:
        if re.search(pattern, device_name):
            tflops = table.get(precision)
            return None if tflops is None else tflops * 1e12
    return None


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of `device` at `precision`; None for CPUs, MPS and unknown GPUs ("n/a")."""

    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device), precision)
