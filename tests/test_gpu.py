"""GPU-only checks (`pytest -m gpu`): fused attention, bf16 / fp16 steps, adamw8bit, compile, batch search.

Every test skips cleanly without CUDA, so the CPU test run stays green; scripts/gpu_check.sh runs
them on a machine with a GPU. Models are small: the whole file takes about a minute on an H200.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from dlm.bench.throughput import find_max_batch, run_benchmark, synthetic_batches
from dlm.config.schema import ExperimentConfig, ModelConfig
from dlm.errors import UserError
from dlm.runtime.kernels import configure_cuda_backends, enabled_sdpa_backends
from dlm.train.distributed import DistributedContext
from dlm.train.step import LogWindow, TrainingStep

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FUSED = {"flash", "mem_efficient", "cudnn"}


@pytest.fixture(autouse=True)
def math_attention_restored() -> Iterator[None]:
    # --fused-attention disables the math kernel process-wide; later tests must get it back.
    yield
    configure_cuda_backends(torch.device("cuda"), require_fused_attention=False)


def small(**fields: object) -> ExperimentConfig:
    """A ~3M-parameter model with a 64-wide head, on CUDA, eager unless `compile` is given."""

    model = {"vocab_size": 2048, "max_seq_len": 256, "d_model": 256, "n_layers": 2, "n_heads": 4}
    training = {"device": "cuda", "precision": "bfloat16", "compile": False, "batch_size": 8}
    for name, value in fields.items():
        (model if name in ModelConfig.model_fields else training)[name] = value
    return ExperimentConfig.model_validate({"model": model, "training": training})


def test_fused_attention_serves_a_64_wide_head_with_math_disabled() -> None:
    result = run_benchmark(small(), steps=3, warmup=1, fused_attention=True)
    assert result.attention_backend in FUSED
    assert not enabled_sdpa_backends()["math"]
    assert math.isfinite(result.loss) and result.tokens_per_second > 0


def test_fused_attention_fails_fast_where_no_fused_kernel_serves() -> None:
    # float32 rules out flash and cuDNN; a head dimension of 6 breaks the memory-efficient kernel's
    # alignment. Without --fused-attention the same config quietly runs on the math kernel.
    config = small(d_model=12, n_heads=2, precision="float32")
    with pytest.raises(UserError, match="--fused-attention"):
        run_benchmark(config, steps=1, warmup=0, fused_attention=True)
    configure_cuda_backends(torch.device("cuda"), require_fused_attention=False)
    assert run_benchmark(config, steps=1, warmup=0).attention_backend == "math"


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_half_precision_steps_match_float32(precision: str) -> None:
    reference = run_benchmark(small(precision="float32"), steps=3, warmup=1)
    half = run_benchmark(small(precision=precision), steps=3, warmup=1)
    assert half.precision == precision
    # Same seed, same noise: the mean loss of the same three steps agrees to autocast accuracy.
    assert half.loss == pytest.approx(reference.loss, rel=0.02)
    assert half.peak_allocated_gib is not None and 0 < half.peak_allocated_gib <= half.peak_reserved_gib
    if half.peak_flops_per_second is not None:  # a GPU in the peak table
        assert half.mfu is not None and 0 < half.mfu < 1


def test_adamw8bit_keeps_8bit_state_except_for_the_embedding() -> None:
    pytest.importorskip("bitsandbytes")
    experiment = small(optimizer="adamw8bit")
    device = torch.device("cuda")
    step = TrainingStep(experiment, device, "bfloat16", DistributedContext())
    step.prepare()
    batches, window = synthetic_batches(experiment.model, 8, device, seed=0), LogWindow(device)
    for _ in range(2):
        step.optimizer_step(batches, window)
    state = step.optimizer.state
    matrix = step.model.blocks[0].mlp.gate_up.weight
    assert state[matrix]["state1"].dtype == torch.uint8
    assert state[step.model.token_embedding.weight]["state1"].dtype == torch.float32  # the 32-bit override
    assert math.isfinite(float(window.loss))


def test_compiled_step_matches_eager() -> None:
    # Three warmup steps let the compiled graph settle (the masked-token count changes every step);
    # both runs time the same steps 4-6, so their losses are comparable.
    eager = run_benchmark(small(precision="float32"), steps=3, warmup=3)
    compiled = run_benchmark(small(precision="float32", compile=True), steps=3, warmup=3)
    assert compiled.compile and not eager.compile
    assert compiled.loss == pytest.approx(eager.loss, rel=0.01)


def test_activation_checkpointing_saves_memory_at_the_same_loss() -> None:
    plain = run_benchmark(small(n_layers=4, batch_size=32), steps=2, warmup=1)
    checkpointed = run_benchmark(small(n_layers=4, batch_size=32, activation_checkpointing=True), steps=2, warmup=1)
    assert checkpointed.peak_allocated_gib < plain.peak_allocated_gib
    assert checkpointed.loss == pytest.approx(plain.loss, rel=1e-3)


def test_find_max_batch_within_a_memory_limit_recovers_from_oom() -> None:
    config = small(max_seq_len=1024, d_model=512, n_layers=4, n_heads=8, vocab_size=8192, batch_size=4)
    search = find_max_batch(config, memory_limit_gib=2.0, limit=4096)
    assert 1 <= search.batch_size < 4096
    assert any(not fits for _, fits in search.probes)  # the limit was actually hit, and survived
    result = run_benchmark(config, steps=1, warmup=1, batch_size=search.batch_size, memory_limit_gib=2.0)
    assert result.peak_reserved_gib is not None and result.peak_reserved_gib <= 2.0
    # The fraction is released afterwards: a larger batch runs without the limit.
    larger = search.batch_size + 1
    assert run_benchmark(config, steps=1, warmup=0, batch_size=larger).batch_size == larger


def test_attention_kernel_preference_picks_the_kernel_at_the_same_loss() -> None:
    if not hasattr(torch.backends.cuda, "cudnn_sdp_enabled"):
        pytest.skip("this torch has no cuDNN attention")
    flash = run_benchmark(small(attention_kernel="flash"), steps=3, warmup=1, fused_attention=True)
    cudnn = run_benchmark(small(attention_kernel="cudnn"), steps=3, warmup=1, fused_attention=True)
    assert (flash.attention_backend, cudnn.attention_backend) == ("flash", "cudnn")
    assert cudnn.loss == pytest.approx(flash.loss, rel=0.02)
    assert not enabled_sdpa_backends()["math"]  # a preference never re-enables the math kernel


def test_compiled_blocks_and_whole_model_agree() -> None:
    blocks = run_benchmark(small(precision="float32", compile=True), steps=3, warmup=3)
    whole = run_benchmark(small(precision="float32", compile=True, compile_scope="model"), steps=3, warmup=3)
    assert blocks.loss == pytest.approx(whole.loss, rel=1e-4)
