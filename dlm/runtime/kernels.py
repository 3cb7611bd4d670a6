"""CUDA backends: TF32, the fused scaled-dot-product-attention kernels and their order.

Off CUDA these do nothing, except that requiring the fused attention kernels there is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dlm.errors import UserError
from dlm.runtime.support import fused_attention_problem


def configure_cuda_backends(device: torch.device, require_fused_attention: bool) -> None:
    """TF32 matmuls and fused SDPA kernels on; optionally forbid the math attention fallback."""

    problem = fused_attention_problem(str(device))
    if require_fused_attention and problem is not None:
        raise UserError(
            f"training.require_fused_attention: {problem}",
            fix="set training.require_fused_attention = false or train on a CUDA device",
        )
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    # With math disabled an unsupported shape fails fast instead of silently materialising an
    # L x L attention matrix. Set it in both directions so one call in a process (a bench sweep)
    # cannot leak its choice into the next.
    torch.backends.cuda.enable_math_sdp(not require_fused_attention)


@contextlib.contextmanager
def process_settings_restored() -> Iterator[None]:
    """Give back on exit the process-wide settings a run changes: TF32, the CUDA attention kernels it
    enables or forbids, and the CPU's intra-op threads. A program that calls `dlm.train` and then runs
    its own float32 attention (transformers, say) must not find the math kernel switched off."""

    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    sdpa, threads = enabled_sdpa_backends(), torch.get_num_threads()
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.enable_flash_sdp(sdpa["flash"])
        torch.backends.cuda.enable_mem_efficient_sdp(sdpa["mem_efficient"])
        torch.backends.cuda.enable_math_sdp(sdpa["math"])
        if "cudnn" in sdpa:
            torch.backends.cuda.enable_cudnn_sdp(sdpa["cudnn"])
        torch.set_num_threads(threads)


def enabled_sdpa_backends() -> dict[str, bool]:
    """Which CUDA scaled-dot-product-attention backends torch may currently choose from."""

    flags = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
    }
    if hasattr(torch.backends.cuda, "cudnn_sdp_enabled"):
        flags["cudnn"] = torch.backends.cuda.cudnn_sdp_enabled()
    return flags


# enabled_sdpa_backends() name -> torch.nn.attention.SDPBackend member
_SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "mem_efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def attention_kernel_context(device: torch.device, preference: str) -> contextlib.AbstractContextManager[Any]:
    """Try `preference` first among the enabled CUDA attention kernels ("auto": torch's own order).

    Only the order changes: every kernel enabled now stays a fallback, and one disabled now (the
    math kernel under --fused-attention) stays disabled. Torch releases without priority control
    keep their own order.
    """

    if device.type != "cuda" or preference == "auto":
        return contextlib.nullcontext()

    first = "mem_efficient" if preference == "efficient" else preference
    order = [first] + [name for name, on in enabled_sdpa_backends().items() if on and name != first]
    backends = [getattr(SDPBackend, _SDPA_BACKENDS[name]) for name in order]
    try:
        return sdpa_kernel(backends, set_priority=True)
    except TypeError:  # torch < 2.6: no priority argument
        return contextlib.nullcontext()


def sdpa_backend_name(device: torch.device) -> str:
    """A short human description of the attention kernels in use, for dashboards and bench."""

    if device.type != "cuda":
        return f"{device.type} native"
    flags = enabled_sdpa_backends()
    fused = [name for name, on in flags.items() if on and name != "math"]
    text = ", ".join(fused) if fused else "no fused kernel"
    return text + (" + math fallback" if flags["math"] else " (math disabled)")
