"""Device, precision, compile: where the math runs and in which number format, decided in one place.

Includes whether this CPU multiplies bfloat16 natively (under any instruction-set cap), the autocast
context for a precision, whether to `torch.compile` (and its per-cap kernel cache) and `synchronize`.
An explicit device or precision that cannot run is refused with a `UserError` naming the setting.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Literal

import torch

from dlm.choices import ComputeDtype
from dlm.errors import UserError
from dlm.runtime.support import FLOAT16_CPU_FIX, precision_problem

Precision = Literal["float32", "bfloat16", "float16"]
PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "float16")
_AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def mps_available() -> bool:
    """Whether this torch has the MPS backend and this machine can run it (Apple silicon)."""

    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def resolve_device(requested: str, setting: str = "training.device") -> torch.device:
    """`auto` picks cuda, then mps, then cpu; an explicit but unavailable device is refused.

    `setting` names where the value came from (a config field or a CLI option) in error messages.
    """

    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError):
        raise UserError(
            f"{setting}: unknown device {requested!r}",
            fix="use auto, cpu, mps, cuda or cuda:N",
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                f"{setting}: CUDA was requested but no CUDA device is available",
                fix="use auto or cpu, or install a CUDA build of torch",
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UserError(
                f"{setting}: {requested} does not exist ({count} CUDA device(s) visible)",
                fix=f"use cuda:0 .. cuda:{count - 1}",
            )
    elif device.type == "mps":
        if not mps_available():
            raise UserError(
                f"{setting}: MPS was requested but is unavailable",
                fix="use auto or cpu",
            )
    elif device.type != "cpu":
        raise UserError(
            f"{setting}: unsupported device type {device.type!r}",
            fix="use auto, cpu, mps, cuda or cuda:N",
        )
    return device


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """`auto` is bfloat16 on CUDA when supported (else float16) and float32 elsewhere."""

    if requested == "auto":
        if device.type == "cuda":
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        # float32 is the dependable default on CPU and Apple silicon.
        return "float32"
    if requested not in PRECISIONS:
        raise UserError(
            f"training.precision: unknown precision {requested!r}",
            fix="use auto, float32, bfloat16 or float16",
        )
    problem = precision_problem(requested, str(device))
    if problem is not None:
        raise UserError(f"training.precision: {problem}", fix=FLOAT16_CPU_FIX)
    return requested  # type: ignore[return-value]


def resolve_training_precision(requested: str, device: torch.device) -> Precision:
    """The precision a training step runs in: `resolve_precision`'s, except that `auto` on a CPU with
    native bfloat16 (`cpu_has_native_bfloat16`) is bfloat16 autocast.

    There bfloat16 trains configs/cpu.toml's model faster per step (docs/benchmarks.md, "bfloat16 on the
    CPU", has today's ratio; 1.78x at d_model 256 in the 0.11 lab notes) and scored the same as float32
    at equal steps (0.11 lab notes, "Ten minutes' worth of steps: the clipped masking range and
    bfloat16": git show cece22c:docs/benchmarks.md). Evaluation keeps
    `resolve_precision`'s float32 on the CPU: it is a small share of a run's time, and its figures are
    the ones compared across runs.
    """

    if requested == "auto" and device.type == "cpu" and cpu_has_native_bfloat16():
        return "bfloat16"
    return resolve_precision(requested, device)


# oneDNN's instruction sets below AVX512_CORE_BF16 (its names, any case): none multiplies bfloat16.
_ONEDNN_BELOW_BFLOAT16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def cpu_kernels_capped_below_bfloat16() -> bool:
    """Whether the process's kernels are kept off the bfloat16 instructions by an instruction-set cap.

    `ONEDNN_MAX_CPU_ISA` (or its old name `DNNL_MAX_CPU_ISA`) caps oneDNN, which runs torch's bfloat16
    matrix products; `ATEN_CPU_CAPABILITY` (`default` or `avx2`, case-sensitive as ATen reads it)
    caps ATen's own kernels below AVX-512. Both are read once when the process starts;
    docs/reproducibility.md uses them to run the kernels of another CPU.
    """

    onednn, aten_capped = _kernel_caps()
    return onednn in _ONEDNN_BELOW_BFLOAT16 or aten_capped


def _kernel_caps() -> tuple[str, bool]:
    """oneDNN's instruction-set cap as set (upper case; "" unset) and whether ATen's kernels are capped
    below AVX-512 (`default` or `avx2`, case-sensitive as ATen reads it)."""

    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return onednn.strip().upper(), os.environ.get("ATEN_CPU_CAPABILITY") in ("default", "avx2")


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX tiles) and the kernels may.

    There bfloat16 autocast trains configs/cpu.toml's model faster than float32 (`python -m benchmarks
    cpu-precision` measures by how much); without them bfloat16 is emulated, float32 the safer bet.
    Under an instruction-set cap below them (`cpu_kernels_capped_below_bfloat16`) the CPU runs as one
    without them, so the answer is False there too. The probes are private torch functions: a torch
    without them answers False.
    """

    if cpu_kernels_capped_below_bfloat16():
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


# The largest model a CPU without native bfloat16 upcasts to float32 on load (`inference_dtype`): 4 GiB
# of float32 weights. Past it the memory matters more than the speed, and the model keeps its dtype. A
# fixed count, not the free memory of the moment, so that the same command computes in the same dtype.
CPU_FLOAT32_MAX_PARAMETERS = 1 << 30


# What `--dtype` asks a loaded model to compute in; "auto" (None) leaves it to `inference_dtype`.
COMPUTE_DTYPES: dict[ComputeDtype, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as `--dtype` and the result files name it (`bfloat16`, not `torch.bfloat16`)."""

    return str(dtype).removeprefix("torch.")


def compute_dtype(name: str) -> torch.dtype | None:
    """The torch dtype `--dtype NAME` asks for (None: auto), or a UserError naming the choices."""

    if name not in COMPUTE_DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(COMPUTE_DTYPES)} (got {name!r})")
    return COMPUTE_DTYPES[name]


def inference_dtype(stored: torch.dtype, device: torch.device, parameters: int) -> torch.dtype:
    """The dtype a model stored in `stored` computes in on `device` when none is asked for: its own,
    except a 16-bit dtype on a CPU that only emulates it (bfloat16 without `cpu_has_native_bfloat16`,
    float16 without `cpu_has_native_float16`), where a model of up to `CPU_FLOAT32_MAX_PARAMETERS`
    computes in float32. There emulated 16-bit matrix products cost more than float32's (`python -m
    benchmarks cpu-inference` measures bfloat16's; float16's is larger still)."""

    if device.type != "cpu" or parameters > CPU_FLOAT32_MAX_PARAMETERS:
        return stored
    if stored == torch.bfloat16 and not cpu_has_native_bfloat16():
        return torch.float32
    if stored == torch.float16 and not cpu_has_native_float16():
        return torch.float32
    return stored


def cpu_has_native_float16() -> bool:
    """Whether this CPU multiplies float16 in hardware (AMX-FP16 tiles) and the kernels may: never under
    an instruction-set cap (the caps of docs/reproducibility.md run an older CPU's kernels). A torch
    without the private probe answers False."""

    onednn, aten_capped = _kernel_caps()
    capped = onednn not in ("", "ALL") or aten_capped  # AMX-FP16 is oneDNN's top set: any other cap is below it
    return not capped and bool(getattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)())


def cpu_precision_note(device: torch.device, precision: str) -> str | None:
    """A warning for a CPU run in bfloat16 on a CPU that only emulates it; None otherwise."""

    if device.type != "cpu" or precision != "bfloat16" or cpu_has_native_bfloat16():
        return None
    return "bfloat16 on a CPU without AVX512-BF16 or AMX is emulated: --set training.precision=float32 is likely faster"


def autocast_context(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """Mixed-precision autocast for bf16 / fp16; float32 runs without autocast."""

    if precision == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPES[precision])


def separate_compile_cache_per_cpu_cap() -> Path | None:
    """Give torch.compile's on-disk kernel cache a folder of its own under an ATen instruction-set cap.

    Inductor's cache key leaves `ATEN_CPU_CAPABILITY` out (torch 2.13): CPU kernels compiled for
    AVX-512 and then served to a process capped at `avx2`, or the reverse, gave NaN losses and
    corrupted the heap. A capped process therefore caches in torch's default folder suffixed with
    the cap. A `TORCHINDUCTOR_CACHE_DIR` the user chose is kept; importing `torch._dynamo` sets the
    variable to the default folder, which counts as unset. Inductor reads the variable each time it
    compiles. Returns the folder chosen, None when the variable is left as it is.
    """

    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    default = _default_compile_cache()
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not capability or (chosen is not None and os.path.abspath(chosen) != str(default)):
        return None
    folder = default.with_name(f"{default.name}_{capability}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def _default_compile_cache() -> Path:
    """The folder inductor caches in when `TORCHINDUCTOR_CACHE_DIR` is unset (its own rule)."""

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):  # no name for this uid (containers)
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return Path(os.path.abspath(tempfile.gettempdir())) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def resolve_compile(setting: bool | str, device: torch.device) -> bool:
    """`auto` compiles on CUDA only: CPU / MPS compile times rarely pay back on short runs. A CPU
    run that compiles keeps its kernels apart per instruction-set cap (`separate_compile_cache_per_cpu_cap`)."""

    if setting == "auto":
        wanted = device.type == "cuda"
    elif isinstance(setting, bool):
        wanted = setting
    else:
        raise UserError(f'training.compile: {setting!r} is not true, false or "auto"')
    if wanted and device.type == "cpu":
        separate_compile_cache_per_cpu_cap()
    if wanted and not _dynamo_supported():
        if setting == "auto":
            return False
        raise UserError(
            "training.compile: torch.compile is not supported on this Python / platform",
            fix="set training.compile = false",
        )
    return wanted


def _dynamo_supported() -> bool:
    try:
        import torch._dynamo

        return bool(torch._dynamo.is_dynamo_supported())
    except Exception:  # an unsupported interpreter can fail inside the import itself
        return False


def synchronize(device: torch.device) -> None:
    """Wait for queued accelerator work (timing needs it; CPU work is already synchronous)."""

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
