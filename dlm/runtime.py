"""Where and how the math runs: devices, precision, seeding, RNG capture, CUDA backends, peaks.

Everything here is a small, stateless helper that the training loop, the benchmark and the
evaluator share, so that a device name, a precision or a peak FLOP/s figure is decided in exactly
one place. Functions that touch CUDA are guarded: on a machine without it they either do nothing
(synchronize, memory) or refuse with a `UserError` naming the config field to change.
"""

from __future__ import annotations

import contextlib
import getpass
import math
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from dlm.device_support import FLOAT16_CPU_FIX, fused_attention_problem, precision_problem
from dlm.errors import UserError
from dlm.fileio import GIB

Precision = Literal["float32", "bfloat16", "float16"]
PRECISIONS: tuple[str, ...] = ("float32", "bfloat16", "float16")
BUSY_SAMPLE_SECONDS = 0.1  # how long `busy_cores` watches the CPUs before a run picks its threads
_AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------
# Seeding and RNG state
# ---------------------------------------------------------------------------------------------


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def seed_everything(seed: int, device: torch.device) -> None:
    """Seed python, numpy, torch and the accelerator's generator."""

    random.seed(seed)
    # numpy's legacy global generator only takes 32-bit seeds; fold larger ones instead of failing.
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    if device.type == "mps" and hasattr(torch.mps, "manual_seed"):
        # The MPS runtime starts lazily and its initialisation can overwrite a seed set before the
        # first allocation, so materialise it first.
        torch.empty((), device="mps")
        torch.mps.synchronize()
        torch.mps.manual_seed(seed)


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """Every global generator's state as tensors, ints, floats and strings only.

    The result survives `torch.save` + `torch.load(weights_only=True)`: python's tuple state and
    numpy's array state are unpacked into plain fields instead of being pickled as objects.
    """

    version, mt_words, gauss_next = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {
            "version": int(version),
            "state": torch.tensor(mt_words, dtype=torch.int64),
            "gauss_next": None if gauss_next is None else float(gauss_next),
        },
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64).copy()),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    if device.type == "mps" and hasattr(torch.mps, "get_rng_state"):
        state["mps"] = torch.mps.get_rng_state().cpu()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what `capture_rng_state` recorded (accelerator states only where present)."""

    python = state["python"]
    words = tuple(int(w) for w in python["state"].tolist())
    random.setstate((int(python["version"]), words, python["gauss_next"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["name"],
            numpy_state["keys"].numpy().astype(np.uint32),
            int(numpy_state["pos"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["cached_gaussian"]),
        )
    )
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    if "mps" in state and _mps_available() and hasattr(torch.mps, "set_rng_state"):
        torch.mps.set_rng_state(state["mps"].cpu())


# ---------------------------------------------------------------------------------------------
# Device, precision, compile
# ---------------------------------------------------------------------------------------------


def resolve_device(requested: str, setting: str = "training.device") -> torch.device:
    """`auto` picks cuda, then mps, then cpu; an explicit but unavailable device is refused.

    `setting` names where the value came from (a config field or a CLI option) in error messages.
    """

    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
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
        if not _mps_available():
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


# oneDNN's instruction sets below AVX512_CORE_BF16 (its names, any case): none multiplies bfloat16.
_ONEDNN_BELOW_BFLOAT16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def cpu_kernels_capped_below_bfloat16() -> bool:
    """Whether the process's kernels are kept off the bfloat16 instructions by an instruction-set cap.

    `ONEDNN_MAX_CPU_ISA` (or its old name `DNNL_MAX_CPU_ISA`) caps oneDNN, which runs torch's bfloat16
    matrix products; `ATEN_CPU_CAPABILITY` (`default` or `avx2`, case-sensitive as ATen reads it)
    caps ATen's own kernels below AVX-512. Both are read once when the process starts;
    docs/reproducibility.md uses them to run the kernels of another CPU.
    """

    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    aten_capped = os.environ.get("ATEN_CPU_CAPABILITY") in ("default", "avx2")
    return onednn.strip().upper() in _ONEDNN_BELOW_BFLOAT16 or aten_capped


def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX tiles) and the kernels may.

    There bfloat16 autocast trained configs/cpu.toml's model 1.8x faster than float32 on 2 threads
    (`scripts/cpu_precision.py`, docs/benchmarks.md); without them bfloat16 is emulated, float32 the safer bet.
    Under an instruction-set cap below them (`cpu_kernels_capped_below_bfloat16`) the CPU runs as one
    without them, so the answer is False there too. The probes are private torch functions: a torch
    without them answers False.
    """

    if cpu_kernels_capped_below_bfloat16():
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


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


# ---------------------------------------------------------------------------------------------
# CUDA backends
# ---------------------------------------------------------------------------------------------


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
    from torch.nn.attention import SDPBackend, sdpa_kernel

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


# ---------------------------------------------------------------------------------------------
# Peak FLOP/s: the one table the dashboard, bench and MFU use
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


def memory_stats(device: torch.device) -> dict[str, float]:
    """Allocated / reserved / peak-allocated accelerator memory in GiB (zeros off CUDA)."""

    if device.type != "cuda":
        return {"allocated_gib": 0.0, "reserved_gib": 0.0, "peak_allocated_gib": 0.0}
    return {
        "allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
    }


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


# ---------------------------------------------------------------------------------------------
# CPU threads
# ---------------------------------------------------------------------------------------------


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
