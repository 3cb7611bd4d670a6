"""What a benchmark settles before the clock starts: its config and the device's facts.

The config side applies `--batch-size` / `--device` / `--compare` values as validated overrides; the
device side names the device, finds the attention kernel torch will use (and enforces a fused one),
caps and measures memory. Each device helper is guarded: it does nothing, or refuses with a
`UserError`, where the device lacks the feature. The timing itself lives in `dlm.bench`.
"""

from __future__ import annotations

import gc
import itertools
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from dlm.config.schema import ExperimentConfig, ModelConfig, TrainingConfig, with_overrides
from dlm.errors import UserError
from dlm.fileio import GIB
from dlm.model.attention import training_kernel
from dlm.model.denoiser import needs_clean_copy
from dlm.runtime.allocator import give_back_freed_memory
from dlm.runtime.device import synchronize
from dlm.runtime.kernels import sdpa_backend_name
from dlm.runtime.memory import peak_rss_gib as rusage_peak_rss_gib
from dlm.runtime.memory import reset_peak_memory
from dlm.runtime.support import fused_attention_problem

# ---- Config: overrides and --compare ----------------------------------------------------------


def config_key(key: str) -> str:
    """`optimizer` -> `training.optimizer`, `activation_checkpointing` -> `model.activation_checkpointing`."""

    key = key.strip()
    if "." in key:
        return key
    sections = [
        name for name, model in (("model", ModelConfig), ("training", TrainingConfig)) if key in model.model_fields
    ]
    if len(sections) != 1:
        raise UserError(
            f"--compare: {key!r} is not a config field",
            fix="use a field name such as optimizer, precision, batch_size, compile or activation_checkpointing "
            "(`dlm config show CONFIG` lists them all)",
        )
    return f"{sections[0]}.{key}"


def parse_compare(items: list[str]) -> list[tuple[str, list[str]]]:
    """`["optimizer=adamw,adamw8bit", ...]` -> `[("training.optimizer", ["adamw", "adamw8bit"]), ...]`."""

    parsed: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, values = item.partition("=")
        choices = [value.strip() for value in values.split(",") if value.strip()]
        if not sep or not choices:
            raise UserError(
                f"--compare {item!r} is not of the form key=value1,value2",
                fix="for example --compare optimizer=adamw,adamw8bit",
            )
        name = config_key(key)
        if name in (seen[0] for seen in parsed):
            raise UserError(f"--compare names {name} twice", fix="give all its values in one --compare")
        parsed.append((name, choices))
    return parsed


def compare_settings(compare: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
    """The cartesian product of the compared values, first key slowest, as override dicts."""

    keys = [key for key, _ in compare]
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(v for _, v in compare))]


def bench_config(experiment: ExperimentConfig, batch_size: int | None, device: str | None) -> ExperimentConfig:
    overrides = []
    if batch_size is not None:
        overrides.append(f"training.batch_size={batch_size}")
    if device is not None:
        overrides.append(f"training.device={device}")
    return with_overrides(experiment, overrides, "--batch-size / --device")


# ---- Device facts ----------------------------------------------------------------------------


def proc_field(path: str, name: str) -> str | None:
    """The value of `name:` in a /proc text file; None off Linux."""

    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == name:  # /proc/cpuinfo pads keys with tabs
                    return value.strip()
    except OSError:
        pass
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine() or "cpu"
    return device.type


_SDPA_NAMES = {
    "FLASH_ATTENTION": "flash",
    "EFFICIENT_ATTENTION": "mem_efficient",
    "CUDNN_ATTENTION": "cudnn",
    "MATH": "math",
}


def _attention_probe(model: ModelConfig, device: torch.device, precision: str) -> tuple[torch.Tensor, ...]:
    # The model's own layout: [B, L, H, D] projections viewed as [B, H, L, D], in the autocast dtype.
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(precision, torch.float32)
    shape = (1, model.max_seq_len, model.n_heads, model.head_dim)
    return tuple(torch.randn(shape, device=device, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3))


def attention_backend(model: ModelConfig, device: torch.device, precision: str) -> str:
    """The kernel of this model's training attention on `device` (with current flags): the SDPA kernel
    torch picks (causal for an autoregressive model), or for a block model that of its 2L pass, flex or
    SDPA with a boolean mask."""

    mask, causal = None, model.is_autoregressive  # an autoregressive model: SDPA's causal kernel, one pass
    if needs_clean_copy(model) and not causal:
        kernel = training_kernel(device)
        if kernel == "flex":
            return "flex (block mask, 2L)"
        length = 2 * model.max_seq_len
        mask = torch.ones(length, length, dtype=torch.bool, device=device)
        model = model.model_copy(update={"max_seq_len": length, "block_size": 0})
    choose = getattr(torch, "_fused_sdp_choice", None)  # private, but exactly torch's own dispatch
    if choose is None:
        return sdpa_backend_name(device)
    try:
        name = torch.nn.attention.SDPBackend(
            choose(*_attention_probe(model, device, precision), mask, 0.0, causal)
        ).name
    except RuntimeError:
        return "none (no kernel serves this shape)"
    label = _SDPA_NAMES.get(name, name.lower())
    if mask is not None:
        label = f"sdpa-mask: {label}, 2L"
    return label if device.type == "cuda" else f"{label} ({device.type})"


def require_fused_attention(model: ModelConfig, device: torch.device, precision: str) -> str:
    """Fail fast unless a flash / memory-efficient kernel runs this model's attention, math disabled.

    Call after `configure_cuda_backends(device, True)`. Runs one forward and backward of the real
    shape, so head-dim, dtype and GPU-generation limits all surface here rather than mid-benchmark.
    """

    fix = "use bfloat16 or float16 with a head dimension (d_model / n_heads) of 64 or 128, or drop --fused-attention"
    problem = fused_attention_problem(str(device))
    if problem is not None:
        raise UserError(
            f"--fused-attention: {problem}", fix="drop --fused-attention, or run on a CUDA device (--device cuda)"
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            query, key, value = _attention_probe(model, device, precision)
            F.scaled_dot_product_attention(query, key, value).float().sum().backward()
            synchronize(device)
        except RuntimeError as exc:
            reasons = "; ".join(str(w.message).strip() for w in caught) or str(exc).splitlines()[0]
            raise UserError(
                f"--fused-attention: no fused attention kernel serves head dim {model.head_dim}, {precision}, "
                f"seq {model.max_seq_len} on {device_name(device)}: {reasons}",
                fix=fix,
            ) from None
    backend = attention_backend(model, device, precision)
    if backend == "math" or backend.startswith("none"):
        raise UserError(f"--fused-attention: torch would use the {backend} attention kernel", fix=fix)
    return backend


def set_memory_limit(device: torch.device, limit_gib: float | None) -> None:
    if device.type != "cuda":
        if limit_gib is not None:
            raise UserError(
                "--memory-limit applies to CUDA devices only", fix="drop --memory-limit or use --device cuda"
            )
        return
    # The allocator's fraction needs an explicit index: a bare "cuda" means the current device.
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory / GIB
    if limit_gib is None:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        return
    if not 0 < limit_gib <= total:
        raise UserError(
            f"--memory-limit {limit_gib} GiB is not within the device's {total:.1f} GiB",
            fix=f"pass a limit between 0 and {total:.1f}",
        )
    torch.cuda.set_per_process_memory_fraction(limit_gib / total, index)


def reset_peak_rss() -> None:
    # Linux lets a process restart its own peak-RSS counter, so each row of a comparison reports its
    # own peak rather than the largest of all rows so far. Elsewhere the process-wide peak stays.
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError:
        pass


def peak_rss_gib() -> float | None:
    """This process's peak resident memory since the last `reset_peak_rss` (Linux), else since start."""

    high_water = proc_field("/proc/self/status", "VmHWM")  # "123456 kB"
    return int(high_water.split()[0]) * 1024 / GIB if high_water else rusage_peak_rss_gib()


def release_memory(device: torch.device) -> None:
    """Free what the last configuration left: compiled graphs, cached blocks, peaks."""

    dynamo = sys.modules.get("torch._dynamo")  # imported only once something was compiled
    if dynamo is not None:
        dynamo.reset()  # compiled graphs hold their models, and a sweep would hit the recompile limit
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "cpu":
        give_back_freed_memory()  # the heap keeps what a CPU step frees (dlm.runtime.allocator)
    reset_peak_memory(device)


def measure_matmul_peak(device: torch.device, precision: str) -> float:
    """The FLOP/s of one large square matmul in the step's dtype on `device`: the ceiling actually
    reachable here, beside the datasheet figure (clocks, power limits and cooling lower the latter).

    8192^3 on CUDA (large enough to saturate any current GPU), 2048^3 elsewhere (seconds, not
    minutes, on a laptop CPU). The median of 10 timed products after 3 warm-ups, on random data.
    """

    cuda = device.type == "cuda"
    size = 8192 if cuda else 2048
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(precision, torch.float32)
    generator = torch.Generator(device=device).manual_seed(0)
    left = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    right = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    times = []
    for index in range(13):
        synchronize(device)
        started = time.perf_counter()
        torch.mm(left, right)
        synchronize(device)
        if index >= 3:
            times.append(time.perf_counter() - started)
    del left, right
    return 2 * size**3 / statistics.median(times)
