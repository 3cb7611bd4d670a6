"""Device, precision, seeding, RNG capture, CUDA backends, the peak FLOP/s table and memory."""

from __future__ import annotations

import getpass
import io
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dlm.errors import UserError, UserNote
from dlm.runtime import device, flops, kernels, memory, rng, threads

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _draw() -> tuple[list[float], list[float], torch.Tensor, float, float]:
    # gauss / normal draws exercise the cached-gaussian fields of python's and numpy's states.
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        torch.rand(3),
        random.gauss(0.0, 1.0),
        float(np.random.normal()),
    )


def _assert_same_draws(a: tuple, b: tuple) -> None:
    assert a[0] == b[0] and a[1] == b[1] and a[3] == b[3] and a[4] == b[4]
    assert torch.equal(a[2], b[2])


def test_seed_everything_repeats_every_generator() -> None:
    rng.seed_everything(123, CPU)
    first = _draw()
    rng.seed_everything(123, CPU)
    _assert_same_draws(first, _draw())
    rng.seed_everything(124, CPU)
    assert _draw()[0] != first[0]


def test_seed_everything_accepts_seeds_beyond_32_bits() -> None:
    rng.seed_everything(2**40 + 5, CPU)
    first = _draw()
    rng.seed_everything(2**40 + 5, CPU)
    _assert_same_draws(first, _draw())


def test_rng_state_survives_weights_only_round_trip() -> None:
    rng.seed_everything(7, CPU)
    # Leave a cached gaussian behind in python and numpy so those fields are non-trivial.
    random.gauss(0.0, 1.0)
    np.random.normal()
    state = rng.capture_rng_state(CPU)
    expected = _draw()
    buffer = io.BytesIO()
    torch.save({"rng": state}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["rng"]
    _draw()  # move every generator on, so restoring has real work to do
    rng.restore_rng_state(loaded)
    _assert_same_draws(expected, _draw())


def test_resolve_device_auto_prefers_cuda_then_mps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "mps_available", lambda: False)
    assert device.resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(device, "mps_available", lambda: True)
    assert device.resolve_device("auto") == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.resolve_device("auto") == torch.device("cuda")


def test_resolve_device_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert device.resolve_device("cpu") == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "mps_available", lambda: False)
    with pytest.raises(UserError, match=r"training\.device: CUDA was requested"):
        device.resolve_device("cuda")
    with pytest.raises(UserError, match="MPS was requested"):
        device.resolve_device("mps")
    with pytest.raises(UserError, match="unknown device"):
        device.resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device.resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(UserError, match=r"cuda:2 does not exist \(2 CUDA"):
        device.resolve_device("cuda:2")


def test_resolve_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    assert device.resolve_precision("auto", CPU) == "float32"
    assert device.resolve_precision("auto", torch.device("mps")) == "float32"
    assert device.resolve_precision("bfloat16", CPU) == "bfloat16"
    with pytest.raises(UserError, match=r"training\.precision: float16 .* CPU"):
        device.resolve_precision("float16", CPU)
    with pytest.raises(UserError, match="unknown precision"):
        device.resolve_precision("int8", CPU)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert device.resolve_precision("auto", cuda) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert device.resolve_precision("auto", cuda) == "float16"
    assert device.resolve_precision("float16", cuda) == "float16"


def test_autocast_context_sets_matmul_dtype() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with device.autocast_context(CPU, "float32"):
        assert (a @ b).dtype == torch.float32
    with device.autocast_context(CPU, "bfloat16"):
        assert (a @ b).dtype == torch.bfloat16


def test_resolve_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "_dynamo_supported", lambda: True)
    assert device.resolve_compile("auto", torch.device("cuda")) is True
    assert device.resolve_compile("auto", CPU) is False
    assert device.resolve_compile("auto", torch.device("mps")) is False
    assert device.resolve_compile(True, CPU) is True
    assert device.resolve_compile(False, torch.device("cuda")) is False
    with pytest.raises(UserError, match=r"training\.compile"):
        device.resolve_compile("yes", CPU)
    monkeypatch.setattr(device, "_dynamo_supported", lambda: False)
    assert device.resolve_compile("auto", torch.device("cuda")) is False
    with pytest.raises(UserError, match="not supported"):
        device.resolve_compile(True, CPU)


def test_require_fused_attention_is_refused_off_cuda() -> None:
    before = kernels.enabled_sdpa_backends()
    with pytest.raises(UserError, match="require_fused_attention"):
        kernels.configure_cuda_backends(CPU, require_fused_attention=True)
    kernels.configure_cuda_backends(CPU, require_fused_attention=False)
    # Off CUDA nothing global may change.
    assert kernels.enabled_sdpa_backends() == before
    assert kernels.sdpa_backend_name(CPU) == "cpu native"


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H200", "bfloat16", 989.4),
        ("NVIDIA H200 NVL", "bfloat16", 835.5),
        ("NVIDIA GH200 480GB", "bfloat16", 989.4),
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4),
        ("NVIDIA H100 80GB HBM3", "float32", 494.7),
        ("NVIDIA H100 PCIe", "float16", 756.5),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312.0),
        ("NVIDIA A100 80GB PCIe", "float32", 156.0),
        ("NVIDIA A10", "bfloat16", 125.0),
        ("NVIDIA L40S", "bfloat16", 362.05),
        ("NVIDIA L4", "bfloat16", 121.0),
        ("NVIDIA GeForce RTX 4090", "bfloat16", 165.2),
        ("NVIDIA GeForce RTX 3090", "float16", 71.0),
        ("Tesla V100-SXM2-16GB", "float16", 125.0),
        ("Tesla V100-PCIE-32GB", "float16", 112.0),
    ],
)
def test_peak_flops_known_gpus(name: str, precision: str, tflops: float) -> None:
    assert flops.peak_flops_for_name(name, precision) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize(
    ("name", "precision"),
    [
        ("NVIDIA A10G", "bfloat16"),  # a cut-down A10 with its own figures: unknown, not A10's
        ("NVIDIA GeForce RTX 3090 Ti", "bfloat16"),
        ("Tesla V100-SXM2-16GB", "bfloat16"),  # no bf16 tensor cores
        ("Some Future GPU", "bfloat16"),
    ],
)
def test_peak_flops_unknown_is_none(name: str, precision: str) -> None:
    assert flops.peak_flops_for_name(name, precision) is None


def test_peak_flops_is_none_off_cuda() -> None:
    assert flops.peak_flops(CPU, "float32") is None
    assert flops.peak_flops(torch.device("mps"), "bfloat16") is None


def test_memory_stats_off_cuda_and_peak_rss() -> None:
    stats = memory.memory_stats(CPU)
    assert stats == {"allocated_gib": 0.0, "reserved_gib": 0.0, "peak_allocated_gib": 0.0}
    memory.reset_peak_memory(CPU)
    rss = memory.peak_rss_gib()
    # A process that imported torch holds well over 50 MiB and (here) far less than 1 TiB.
    assert rss is not None and 0.05 < rss < 1024


@pytest.mark.gpu
@needs_cuda
def test_cuda_backends_rng_memory_and_peak() -> None:
    cuda = torch.device("cuda")
    kernels.configure_cuda_backends(cuda, require_fused_attention=True)
    flags = kernels.enabled_sdpa_backends()
    assert flags["flash"] and flags["mem_efficient"] and not flags["math"]
    assert "math disabled" in kernels.sdpa_backend_name(cuda)
    kernels.configure_cuda_backends(cuda, require_fused_attention=False)
    assert kernels.enabled_sdpa_backends()["math"]
    assert torch.backends.cuda.matmul.allow_tf32

    rng.seed_everything(3, cuda)
    state = rng.capture_rng_state(cuda)
    expected = torch.rand(4, device=cuda)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    torch.rand(4, device=cuda)
    rng.restore_rng_state(torch.load(buffer, weights_only=True))
    assert torch.equal(torch.rand(4, device=cuda), expected)

    memory.reset_peak_memory(cuda)
    block = torch.empty(64 << 20, dtype=torch.uint8, device=cuda)
    device.synchronize(cuda)
    stats = memory.memory_stats(cuda)
    assert stats["peak_allocated_gib"] >= 64 / 1024 and stats["reserved_gib"] >= stats["allocated_gib"]
    del block
    name = torch.cuda.get_device_name(cuda)
    assert flops.peak_flops(cuda, "bfloat16") == flops.peak_flops_for_name(name, "bfloat16")


def test_attention_kernel_preference_is_a_no_op_off_cuda() -> None:
    from dlm.runtime.kernels import attention_kernel_context

    for preference in ("auto", "cudnn", "flash", "efficient"):
        with attention_kernel_context(torch.device("cpu"), preference):
            out = torch.nn.functional.scaled_dot_product_attention(*(torch.ones(1, 1, 4, 8) for _ in range(3)))
        assert torch.equal(out, torch.ones(1, 1, 4, 8))


@pytest.mark.parametrize(
    ("cores", "load", "expected", "text"),
    [
        (2, 1.3, 1, "2 cores, 1.3 busy: 1 thread"),
        (2, 0.2, 2, "2 cores, 0.2 busy: 2 threads"),
        (4, 9.0, 1, "4 cores, 4.0 busy: 1 thread"),  # never below one thread
        (8, 2.0, 6, "8 cores, 2.0 busy: 6 threads"),
    ],
)
def test_cpu_threads_follow_the_free_cores(
    cores: int, load: float, expected: int, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    plan = threads.plan_cpu_threads(load=load)
    assert plan.threads == expected and plan.describe() == text


def test_omp_num_threads_overrides_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    plan = threads.plan_cpu_threads(load=0.0)
    assert plan.threads == 3 and plan.describe() == "2 cores, OMP_NUM_THREADS: 3 threads"
    previous = torch.get_num_threads()
    try:
        assert threads.configure_cpu_threads(torch.device("cpu")) == plan and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(previous)
    assert threads.configure_cpu_threads(torch.device("meta")) is None  # only CPU runs are changed


@pytest.mark.parametrize(
    ("load", "idle_share", "expected"),
    [
        (1.8, 0.9, 0.2),  # a job just ended: the load average still counts it, the CPUs are idle
        (1.1, 0.5, 1.0),  # one busy core all along: both agree
        (0.3, 0.0, 0.3),  # a burst while sampling: the load average is the calmer figure
    ],
)
def test_busy_cores_is_the_lower_of_the_load_average_and_a_short_sample(
    load: float, idle_share: float, expected: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = iter([(1000, 10_000), (1000 + int(1000 * idle_share), 11_000)])  # (idle, total) jiffies
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: next(samples))
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads, "_affinity", lambda: {0, 1})  # every CPU of the host
    slept: list[float] = []
    monkeypatch.setattr(threads.time, "sleep", slept.append)
    assert threads.busy_cores() == pytest.approx(expected) and slept == [threads.BUSY_SAMPLE_SECONDS]


def test_busy_cores_without_proc_stat_is_the_load_average(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: None)
    monkeypatch.setattr(threads, "_affinity", lambda: None)  # a system that cannot say: the whole host
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.25, 0.0, 0.0))
    assert threads.busy_cores() == 1.25
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "busy_cores", lambda: 0.2)  # what a run starting on an idle machine sees
    assert threads.plan_cpu_threads().describe() == "2 cores, 0.2 busy: 2 threads"


STAT = """cpu  400 0 400 800 0 0 0 0 0 0
cpu0 100 0 100 200 0 0 0 0 0 0
cpu1 100 0 100 200 0 0 0 0 0 0
cpu2 190 0 0 10 0 0 0 0 0 0
cpu3 10 0 200 390 0 0 0 0 0 0
intr 1
"""


def test_busy_cores_counts_only_the_cpus_this_process_may_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert threads._cpu_times(None, stat) == (800, 1600)  # the "cpu" line: the whole host
    assert threads._cpu_times({2, 3}, stat) == (400, 800)  # cpu2 and cpu3 alone
    # On 2 of a busy host's 4 CPUs, only those two count, and the host's load average not at all.
    later = iter(
        [STAT, STAT.replace("cpu2 190 0 0 10", "cpu2 290 0 0 10").replace("cpu3 10 0 200 390", "cpu3 10 0 200 490")]
    )
    monkeypatch.setattr(threads, "_affinity", lambda: {2, 3})
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (30.0, 0.0, 0.0))
    monkeypatch.setattr(threads.time, "sleep", lambda seconds: stat.write_text(next(later)))
    stat.write_text(next(later))
    read = threads._cpu_times
    monkeypatch.setattr(threads, "_cpu_times", lambda cpus: read(cpus, stat))
    assert threads.busy_cores() == pytest.approx(1.0)  # cpu2 fully busy, cpu3 idle over the sample


@pytest.mark.parametrize(
    ("files", "membership", "expected"),
    [
        ({"cpu.max": "max 100000"}, "0::/", None),
        ({"cpu.max": "400000 100000"}, "0::/", 4),
        ({"job/cpu.max": "150000 100000", "cpu.max": "max 100000"}, "0::/job", 1),  # never below one core
        ({"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}, "2:cpu,cpuacct:/", 3),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, "2:cpu,cpuacct:/", None),
        ({}, "0::/", None),  # no cgroup files: no quota
        ({"slice/cpu.max": "200000 100000", "slice/job/cpu.max": "max 100000"}, "0::/slice/job", 2),  # a parent's
        ({"cpu.max": "300000 100000"}, "garbage\n0::/", 3),  # a malformed line is skipped
    ],
)
def test_the_cgroup_quota_caps_the_cores(
    files: dict[str, str], membership: str, expected: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    (tmp_path / "self-cgroup").write_text(membership + "\n")
    assert threads.quota_cores(tmp_path, tmp_path / "self-cgroup") == expected
    monkeypatch.setattr(threads, "quota_cores", lambda: expected)
    monkeypatch.setattr(threads, "_affinity", lambda: set(range(64)))  # a 64-core host's full mask
    assert threads.usable_cores() == (64 if expected is None else expected)


def test_a_quota_narrower_than_a_busy_host_still_gets_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    # A container with a 4-CPU quota whose affinity spans a 64-core host, 8 of those cores busy with
    # others' work: 4 threads, not one.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "quota_cores", lambda: 4)
    monkeypatch.setattr(threads, "_affinity", lambda: set(range(64)))
    assert threads.plan_cpu_threads(load=8.0).threads == 4
    assert threads.plan_cpu_threads(load=62.0).threads == 2


def test_a_resume_takes_the_recorded_threads_unless_omp_num_threads_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    previous = torch.get_num_threads()
    try:
        measured = threads.ThreadPlan(2, 1.2, 1, "measured")
        plan = threads.resume_cpu_threads(measured, 2)
        assert plan is not None and plan.threads == 2 == torch.get_num_threads()
        assert plan.describe() == "2 cores, as the checkpoint recorded: 2 threads"
        assert threads.resume_cpu_threads(measured, None) is measured  # an older checkpoint: as measured
        assert threads.resume_cpu_threads(None, 2) is None  # not a CPU run
        with pytest.warns(UserNote, match="recorded 8 CPU threads and this machine gives it 2 cores"):
            assert threads.resume_cpu_threads(measured, 8) is not None and torch.get_num_threads() == 8
        explicit = threads.ThreadPlan(2, None, 1, "OMP_NUM_THREADS")
        with pytest.warns(UserNote, match="OMP_NUM_THREADS=1, where the run used 2 threads.*no longer bit-identical"):
            assert threads.resume_cpu_threads(explicit, 2) is explicit
    finally:
        torch.set_num_threads(previous)


def test_cpu_times_reads_this_machine() -> None:
    times = threads._cpu_times()
    if times is None:
        pytest.skip("no /proc/stat on this system")
    idle, total = times
    assert 0 <= idle <= total and total > 0
    assert threads.busy_cores(0.01) is not None


ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def test_cpu_bfloat16_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Native bfloat16 is AVX512-BF16 or AMX; a torch without the private probes answers False."""

    for name in ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert device.cpu_has_native_bfloat16() is False
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert device.cpu_has_native_bfloat16() is True


@pytest.mark.parametrize("native", [False, True])
def test_inference_dtype_upcasts_bfloat16_only_where_the_cpu_emulates_it(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """A bfloat16 model computes in float32 on a CPU without native bfloat16, up to the size cap; every
    other dtype, device and size keeps what was stored."""

    monkeypatch.setattr(device, "cpu_has_native_bfloat16", lambda: native)
    monkeypatch.setattr(device, "cpu_has_native_float16", lambda: not native)  # each alone
    cpu, cap = torch.device("cpu"), device.CPU_FLOAT32_MAX_PARAMETERS
    expected = torch.bfloat16 if native else torch.float32
    assert device.inference_dtype(torch.bfloat16, cpu, 1000) == expected
    assert device.inference_dtype(torch.bfloat16, cpu, cap) == expected
    assert device.inference_dtype(torch.bfloat16, cpu, cap + 1) == torch.bfloat16  # its float32 copy: too big
    assert device.inference_dtype(torch.float16, cpu, 1000) == (torch.float32 if native else torch.float16)
    assert device.inference_dtype(torch.float16, cpu, cap + 1) == torch.float16
    for kept in (torch.float32, torch.float64):
        assert device.inference_dtype(kept, cpu, 1000) == kept
    for other in ("cuda", "mps", "meta"):
        assert device.inference_dtype(torch.bfloat16, torch.device(other), 1000) == torch.bfloat16
        assert device.inference_dtype(torch.float16, torch.device(other), 1000) == torch.float16


def test_the_float16_probe_is_amx_fp16_and_never_under_a_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_fp16_supported", raising=False)
    assert device.cpu_has_native_float16() is False  # a torch without the probe
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: True, raising=False)
    assert device.cpu_has_native_float16() is True
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "all")  # oneDNN's "no cap", in any case
    assert device.cpu_has_native_float16() is True
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert device.cpu_has_native_float16() is False


@pytest.mark.parametrize(
    ("caps", "native"),
    [
        ({}, True),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "avx2"}, False),  # oneDNN reads its cap in any case
        ({"DNNL_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, False),  # the old name; AVX-512 without bfloat16
        ({"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI_2"}, False),
        ({"ATEN_CPU_CAPABILITY": "default"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True),  # a cap at or above the instructions
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX", "ATEN_CPU_CAPABILITY": "avx512"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
        ({"ATEN_CPU_CAPABILITY": "AVX2"}, True),  # ATen ignores a value it does not know (it is lower case)
        ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, True),  # MKL multiplies float32 only here, not bfloat16
    ],
)
def test_cpu_bfloat16_probe_honours_instruction_set_caps(
    monkeypatch: pytest.MonkeyPatch, caps: dict[str, str], native: bool
) -> None:
    """Under a cap the kernels cannot use AVX512-BF16 or AMX, so the CPU recipe must not pick bfloat16."""

    for name in ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    for name, value in caps.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert device.cpu_kernels_capped_below_bfloat16() is not native
    assert device.cpu_has_native_bfloat16() is native


@pytest.mark.parametrize("capped", [False, True])
def test_the_cpu_recipe_picks_float32_under_an_avx2_cap(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capped: bool
) -> None:
    """On an AVX512-BF16 CPU the demo's recipe trains in bfloat16; capped to AVX2, as that CPU class, in float32."""

    from dlm.demo.run import demo_experiment
    from dlm.runtime import device

    for name in ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    if capped:
        for name, value in (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")):
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    experiment, _ = demo_experiment(tmp_path / "demo", None, "cpu")
    resolved = device.resolve_training_precision(experiment.training.precision, torch.device("cpu"))
    assert resolved == ("float32" if capped else "bfloat16")
    # evaluation keeps float32 on the CPU whatever it has
    assert device.resolve_precision(experiment.training.precision, torch.device("cpu")) == "float32"


@pytest.mark.parametrize(
    ("device_name", "precision", "native", "warned"),
    [
        ("cpu", "bfloat16", False, True),
        ("cpu", "bfloat16", True, False),
        ("cpu", "float32", False, False),
        ("cuda", "bfloat16", False, False),
    ],
)
def test_cpu_precision_note(
    monkeypatch: pytest.MonkeyPatch, device_name: str, precision: str, native: bool, warned: bool
) -> None:
    monkeypatch.setattr(device, "cpu_has_native_bfloat16", lambda: native)
    note = device.cpu_precision_note(torch.device(device_name), precision)
    assert (note is not None) == warned
    if warned:
        assert note is not None and "training.precision=float32" in note


def test_a_capped_cpu_compiles_into_a_cache_of_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert device.resolve_compile(True, CPU)
    default = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # set by torch._dynamo's import, if at all
    assert default in (None, str(tmp_path / f"torchinductor_{getpass.getuser()}"))
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert not device.resolve_compile(False, CPU)
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == default  # nothing compiles, nothing changes
    assert device.resolve_compile(True, CPU)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / f"torchinductor_{getpass.getuser()}_avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert device.separate_compile_cache_per_cpu_cap() is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")  # the user's choice is kept


COMPILED_LOSS = """
import json, sys
from dlm.bench.throughput import run_benchmark
from dlm.config.schema import load_config
folder = sys.argv[1]
overrides = [f"training.tokenizer={folder}/missing/tokenizer.json", f"training.train_data={folder}/missing/train.bin",
             "training.val_data=none", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
             "model.max_seq_len=32", "training.compile=true", "training.compile_scope=model"]
result = run_benchmark(load_config(sys.argv[2], overrides), steps=1, warmup=1, batch_size=2)
print(json.dumps(result.loss))
"""


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the instruction-set caps are x86-64's")
def test_compiled_kernels_of_one_cap_are_never_served_to_another(tmp_path: Path) -> None:
    # One shared temporary folder, as on a machine that runs the suite with and without the caps:
    # the kernels compiled first must not be loaded by the process of the other cap.
    environment = {
        key: value for key, value in os.environ.items() if key not in ("TORCHINDUCTOR_CACHE_DIR", "ATEN_CPU_CAPABILITY")
    }
    environment["TMPDIR"] = str(tmp_path)
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
    losses = []
    for cap in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        run = subprocess.run(
            [sys.executable, "-c", COMPILED_LOSS, str(tmp_path), str(config)],
            env=environment | cap,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        losses.append(json.loads(run.stdout.strip().splitlines()[-1]))
    assert all(math.isfinite(loss) for loss in losses), losses  # AVX-512 kernels under the cap: NaN
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)  # AVX2 kernels: the same step up to rounding
