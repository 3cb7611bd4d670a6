"""Block diffusion (`[model] block_size`): the BD3 attention pattern, the ELBO, training and eval."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_same_weights, check_resume_is_exact, tiny_experiment, train_losses
from test_distributed import PER_PROCESS, SINGLE, assert_close_runs, tiny

import dlm
from dlm.artifacts.events import Event, ValidationEvent
from dlm.artifacts.export import export_model
from dlm.bench.throughput import run_benchmark
from dlm.config.schema import ModelConfig, load_config
from dlm.diffusion.objective import accumulation_mask_probabilities, corrupt_tokens, diffusion_cross_entropy, elbo_nll
from dlm.diffusion.schedules import LinearSchedule
from dlm.errors import UserError
from dlm.evaluation.evaluate import evaluate_model, evaluate_source
from dlm.model.attention import (
    AttentionMask,
    _bd3_bool,
    _bd3_flex,
    attend,
    bd3_allowed,
    block_causal_mask,
    flex_attention,
)
from dlm.model.transformer import DiffusionTransformer
from dlm.sampling.block_model import denoise_blocks
from dlm.sampling.options import SamplingOptions
from dlm.sampling.reverse import cut_after_stop
from dlm.train.distributed import end_process
from dlm.train.loop import train

MASK_ID = 1
ROOT = Path(__file__).resolve().parents[1]


def small_model(block_size: int, seq_len: int = 16, seed: int = 0) -> DiffusionTransformer:
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=64,
        mask_token_id=MASK_ID,
        max_seq_len=seq_len,
        d_model=32,
        n_layers=2,
        n_heads=4,
        pad_vocab_multiple=64,
        block_size=block_size,
    )
    return DiffusionTransformer(config).eval()


def test_bd3_pattern_is_the_one_of_the_paper() -> None:
    length, block_size = 8, 2
    index = torch.arange(2 * length)
    allowed = bd3_allowed(index[:, None], index[None, :], length, block_size)
    for query in range(2 * length):
        for key in range(2 * length):
            q_block, k_block = (query % length) // block_size, (key % length) // block_size
            if query < length:  # noisy: its own noisy block and the clean earlier blocks
                want = (key < length and k_block == q_block) or (key >= length and k_block < q_block)
            else:  # clean: the clean blocks up to its own
                want = key >= length and k_block <= q_block
            assert bool(allowed[query, key]) == want, (query, key)


def test_block_causal_mask_within_one_block_is_unmasked() -> None:
    assert block_causal_mask(4, 8, 4, torch.device("cpu")).mask is None
    mask = block_causal_mask(2, 8, 4, torch.device("cpu")).mask
    assert mask.shape == (6, 8) and bool(mask[0, 3]) and not bool(mask[0, 4]) and bool(mask[-1].all())


def test_noisy_logits_of_the_2l_pass_are_each_block_given_the_clean_prefix() -> None:
    model, block_size = small_model(4), 4
    clean = torch.randint(2, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    noisy = clean.masked_fill(torch.rand(3, 16, generator=torch.Generator().manual_seed(2)) < 0.5, MASK_ID)
    with torch.no_grad():
        joint = model(noisy, clean_tokens=clean)
        for start in range(0, 16, block_size):
            context = torch.cat((clean[:, :start], noisy[:, start : start + block_size]), dim=1)
            alone = model(context)[:, start:]
            torch.testing.assert_close(joint[:, start : start + block_size], alone, atol=1e-5, rtol=0)


def test_block_size_one_eval_is_the_exact_left_to_right_likelihood() -> None:
    model = small_model(1)
    data = torch.randint(2, 64, (6, 16), generator=torch.Generator().manual_seed(3))
    report = evaluate_model(model, data, batches=2, mc_samples=4, batch_size=3)
    total = 0.0
    with torch.no_grad():  # log p(x_i | x_<i), one position at a time under the causal mask
        for i in range(16):
            prefix = data[:, : i + 1].clone()
            prefix[:, i] = MASK_ID
            log_probs = model(prefix)[:, i].double().log_softmax(-1)
            total -= float(log_probs.gather(1, data[:, i : i + 1]).sum())
    assert report.nll == pytest.approx(total / data.numel(), abs=1e-5)
    assert report.nll_mc_stderr == 0.0
    assert report.fixed_noise_loss == pytest.approx(report.nll, abs=1e-5)


def test_block_size_one_corruption_masks_everything_with_weight_one() -> None:
    clean = torch.randint(2, 64, (2, 8))
    corruption = corrupt_tokens(clean, MASK_ID, torch.tensor([0.01, 0.7]), 1e-3, block_size=1)
    assert bool(corruption.mask.all()) and bool((corruption.noisy_tokens == MASK_ID).all())
    assert torch.equal(corruption.mask_rate / corruption.mask_probability, torch.ones(2, 8))


def test_block_corruption_weights_each_token_by_its_block() -> None:
    clean = torch.randint(2, 64, (1, 8))
    corruption = corrupt_tokens(clean, MASK_ID, torch.tensor([[0.25, 1.0]]), 1e-3, block_size=4)
    assert bool(corruption.mask[0, 4:].all())
    logits = torch.zeros(int(corruption.mask.sum()), 64)  # uniform: every masked token costs log 64
    loss = diffusion_cross_entropy(logits, clean, corruption)
    ce = torch.log(torch.tensor(64.0))
    first = corruption.mask[0, :4].sum() * ce / 0.25
    torch.testing.assert_close(loss.loss, (first + 4 * ce) / 8)
    torch.testing.assert_close(loss.per_block_nll, torch.stack([first / 4, ce])[None])


def test_a_row_that_is_not_whole_blocks_weights_its_short_last_block_by_its_own_time() -> None:
    # Block size 4 on 6 tokens: blocks [0, 4) at t = 0.5 and [4, 6) at t = 1, everything masked, so
    # with uniform logits over 10 tokens the loss is (4 / 0.5 + 2 / 1) x log 10 / 6, not the
    # (3 / 0.5 + 3 / 1) x log 10 / 6 of blocks of ceil(6 / 2) = 3.
    clean = torch.tensor([[2, 3, 4, 5, 6, 7]])
    drawn = corrupt_tokens(clean, MASK_ID, torch.tensor([[0.5, 1.0]], dtype=torch.float64), 1e-3, block_size=4)
    everything = torch.ones_like(clean, dtype=torch.bool)
    corruption = replace(drawn, noisy_tokens=torch.full_like(clean, MASK_ID), mask=everything)
    loss = diffusion_cross_entropy(torch.zeros(6, 10, dtype=torch.float64), clean, corruption)
    log10 = math.log(10)
    assert loss.loss.item() == pytest.approx((4 / 0.5 + 2 / 1) * log10 / 6, rel=1e-6)
    assert loss.loss.item() == pytest.approx(3.8376, abs=5e-5)
    # Per token of each block: the short block divides by its own 2 tokens.
    torch.testing.assert_close(loss.per_block_nll, torch.tensor([[2 * log10, log10]], dtype=torch.float32))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_elbo_of_a_uniform_model_is_log_vocab_within_its_standard_error(block_size: int) -> None:
    # Each block is weighted by its own time: were a block's weight off, a uniform model (log V per
    # masked token whatever it sees) would not score log V on average.
    clean = torch.randint(2, 64, (32, 32), generator=torch.Generator().manual_seed(4))

    def uniform(noisy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(int(mask.sum()), 64)

    nll, stderr = elbo_nll(uniform, clean, MASK_ID, 8, 1e-3, torch.Generator().manual_seed(5), block_size=block_size)
    if block_size == 1:  # every token masked with weight 1: exact, no Monte Carlo error
        assert torch.allclose(nll, torch.full((32,), math.log(64))) and torch.equal(stderr, torch.zeros(32))
        return
    combined = stderr.pow(2).sum().sqrt() / 32
    assert combined.item() > 0 and abs(nll.mean().item() - math.log(64)) < 4 * combined.item()


@pytest.mark.parametrize("estimator", ["bernoulli", "exact-count"])
def test_one_token_blocks_take_one_pass_for_any_number_of_samples(estimator: str) -> None:
    # Every sample of a one-token block's ELBO is the exact likelihood: K samples would be K equal
    # passes, so one is made, and the Monte Carlo error is exactly 0 (none for K = 1).
    clean = torch.randint(2, 64, (4, 16), generator=torch.Generator().manual_seed(6))
    weights = torch.randn(64, 64, generator=torch.Generator().manual_seed(7))
    calls = []

    def model(noisy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        calls.append(int(mask.sum()))
        return torch.nn.functional.one_hot(noisy.roll(1, dims=1), 64).float()[mask] @ weights

    one, none = elbo_nll(
        model, clean, MASK_ID, 1, 1e-3, torch.Generator().manual_seed(1), block_size=1, estimator=estimator
    )
    eight, zero = elbo_nll(
        model, clean, MASK_ID, 8, 1e-3, torch.Generator().manual_seed(2), block_size=1, estimator=estimator
    )
    assert calls == [64, 64]
    assert torch.equal(one, eight) and torch.equal(zero, torch.zeros(4)) and bool(none.isnan().all())


def test_block_times_split_across_ranks_like_accumulation() -> None:
    single = [accumulation_mask_probabilities(2, m, 4, 0.3, 1e-3, "cpu", blocks=3) for m in range(4)]
    for m in range(2):
        for rank in range(2):
            two = accumulation_mask_probabilities(2, m, 2, 0.3, 1e-3, "cpu", rank, 2, blocks=3)
            assert torch.equal(two, single[2 * m + rank])
    grid = torch.cat(single).flatten().sort().values  # 24 slots evenly spread over [eps, 1]
    torch.testing.assert_close(grid.diff(), torch.full((23,), (1 - 1e-3) / 24))
    plain = accumulation_mask_probabilities(2, 1, 4, 0.3, 1e-3, "cpu")
    assert torch.equal(accumulation_mask_probabilities(2, 1, 4, 0.3, 1e-3, "cpu", blocks=1), plain)


def test_block_size_of_the_whole_sequence_trains_exactly_as_today(tiny_data_dir: Path, tmp_path: Path) -> None:
    settings = (
        "training.max_steps=3",
        "training.warmup_steps=1",
        "training.log_interval=1",
        "training.eval_interval=3",
    )
    runs = {}
    for name, extra in (("today", ()), ("full", ("model.block_size=64",))):
        events: list[Event] = []
        result = train(tiny_experiment(tiny_data_dir, tmp_path / name, *settings, *extra), sink=events.append)
        validations = [e.loss for e in events if isinstance(e, ValidationEvent)]
        runs[name] = (result.checkpoint, train_losses(events), validations)
    assert runs["today"][1:] == runs["full"][1:]
    assert_same_weights(runs["today"][0], runs["full"][0])


def test_block_model_resume_is_bit_identical(tiny_data_dir: Path, tmp_path: Path) -> None:
    settings = (
        "model.block_size=16",
        "training.max_steps=8",
        "training.log_interval=2",
        "training.warmup_steps=2",
        "training.gradient_accumulation_steps=2",
        "training.eval_interval=4",
        "training.save_interval=100",
    )
    losses = check_resume_is_exact(tiny_data_dir, tmp_path, settings, pause_at=4)
    assert all(loss is not None and loss < 7 for loss in losses)


BLOCK_PARALLEL = {
    "ddp": (),
    "fsdp": ("training.parallelism=fsdp", "model.activation_checkpointing=true", "training.checkpoint_format=single"),
}


def _parallel_worker(rank: int, world_size: int, data_dir: Path, root: Path) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=(root / "rendezvous").as_uri(),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=300),
    )
    try:
        for name, extra in BLOCK_PARALLEL.items():
            result = train(tiny(data_dir, root / name, PER_PROCESS, "model.block_size=16", *extra))
            assert result.status == "complete"
    finally:
        dist.destroy_process_group()
    end_process(0)


@pytest.fixture(scope="module")
def parallel_block_runs(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-process reference with accumulation 4, and 2 processes with accumulation 2 under DDP, then FSDP."""

    root = tmp_path_factory.mktemp("parallel-block")
    train(tiny(tiny_data_dir, root / "reference", SINGLE, "model.block_size=16"))
    context = mp.start_processes(
        _parallel_worker, args=(2, tiny_data_dir, root), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 900
    try:
        while not context.join(timeout=5):
            assert time.monotonic() < deadline, "the spawned training processes did not finish in time"
    finally:
        for process in context.processes:
            with contextlib.suppress(Exception):
                if process.is_alive():
                    process.kill()
                    process.join()
    return root


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", sorted(BLOCK_PARALLEL))
def test_parallel_block_model_equals_one_process_with_twice_the_accumulation(
    parallel_block_runs: Path, parallelism: str
) -> None:
    # FSDP runs with activation checkpointing: the recomputed 2L pass must give the same gradients.
    run_dir = parallel_block_runs / parallelism
    assert_close_runs(run_dir, parallel_block_runs / "reference")
    start = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert start["world_size"] == 2 and start["parallelism"] == parallelism


@pytest.mark.parametrize("remasking", ["confidence", "random", "dilated"])
def test_cached_block_sampling_equals_the_uncached_reference(remasking: str) -> None:
    model = small_model(4, seq_len=32)
    tokens = torch.randint(2, 64, (3, 32), generator=torch.Generator().manual_seed(4))
    fill = torch.zeros(32, dtype=torch.bool)
    fill[6:29] = True  # a prompt ending inside a block, and fixed text after the generated span
    options = SamplingOptions(steps=12, remasking=remasking)
    outputs = []
    with torch.inference_mode():
        for cached in (True, False):
            generator = torch.Generator().manual_seed(7)
            outputs.append(
                denoise_blocks(
                    model, tokens, fill, options, generator=generator, schedule=LinearSchedule(), kv_cache=cached
                )
            )
    (cached_tokens, cached_passes), (reference, reference_passes) = outputs
    assert torch.equal(cached_tokens, reference)
    assert not bool((cached_tokens == MASK_ID).any()) and torch.equal(cached_tokens[:, ~fill], tokens[:, ~fill])
    # Each block's first step also stores the blocks before it; only a random step that leaves some
    # rows out needs a pass of its own for that.
    if remasking != "random":  # every row reveals at every step
        assert cached_passes == reference_passes
    else:
        assert cached_passes >= reference_passes


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_block_size_one_samples_one_forward_pass_per_token(temperature: float) -> None:
    model = small_model(1, seq_len=24)
    tokens = torch.randint(2, 64, (2, 24), generator=torch.Generator().manual_seed(8))
    fill = torch.zeros(24, dtype=torch.bool)
    fill[5:20] = True  # 15 tokens after a prompt of 5
    options = SamplingOptions(steps=15, temperature=temperature)
    outputs = []
    with torch.inference_mode():
        for cached in (True, False):
            generator = torch.Generator().manual_seed(9)
            outputs.append(
                denoise_blocks(
                    model, tokens, fill, options, generator=generator, schedule=LinearSchedule(), kv_cache=cached
                )
            )
    (cached_tokens, passes), (reference, reference_passes) = outputs
    assert torch.equal(cached_tokens, reference)  # the reference recomputes the whole prefix every pass
    assert passes == reference_passes == 15  # the prompt and each new token are stored by the next pass


def test_block_sampling_reads_only_the_prefix() -> None:
    # Changing the text after a block must not change it: attention is causal across blocks.
    model = small_model(4, seq_len=16)
    tokens = torch.randint(2, 64, (1, 16), generator=torch.Generator().manual_seed(5))
    fill = torch.zeros(16, dtype=torch.bool)
    fill[4:8] = True
    later = tokens.clone()
    later[:, 8:] = torch.randint(2, 64, (1, 8), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        runs = [
            denoise_blocks(
                model,
                t,
                fill,
                SamplingOptions(steps=4),
                generator=torch.Generator().manual_seed(1),
                schedule=LinearSchedule(),
            )[0]
            for t in (tokens, later)
        ]
    assert torch.equal(runs[0][:, :8], runs[1][:, :8])


def test_block_sampling_stops_at_the_end_of_document() -> None:
    stop = 5

    class FavoursStop(torch.nn.Module):  # the end-of-document token is the most likely everywhere
        def __init__(self, inner: DiffusionTransformer) -> None:
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
            logits = self.inner(*args, **kwargs)
            logits[..., stop] += 100.0
            return logits

    tokens = torch.full((2, 16), MASK_ID)
    tokens[:, 0] = 9
    fill = torch.ones(16, dtype=torch.bool)
    fill[0] = False
    with torch.inference_mode():
        result, _ = denoise_blocks(
            FavoursStop(small_model(4)),
            tokens,
            fill,
            SamplingOptions(steps=4, temperature=0),
            generator=torch.Generator().manual_seed(0),
            schedule=LinearSchedule(),
            stop_token_id=stop,
        )
    assert bool((result[:, 1:4] == stop).all())
    assert bool((result[:, 4:] == MASK_ID).all())  # later blocks were never generated
    assert cut_after_stop(result.tolist(), fill.tolist(), stop) == [[9, stop]] * 2


def test_block_model_trains_evaluates_exports_loads_and_samples(tiny_data_dir: Path, tmp_path: Path) -> None:
    settings = (
        "model.block_size=8",
        "training.max_steps=4",
        "training.warmup_steps=1",
        "training.eval_interval=4",
        "training.save_interval=4",
    )
    run = tmp_path / "run"
    train(tiny_experiment(tiny_data_dir, run, *settings))
    report = evaluate_source(run, batches=1, mc_samples=2, batch_size=2)
    assert report.bits_per_byte is not None and 0 < report.nll < 10  # an ELBO bound after 4 steps
    exported = export_model(run, tmp_path / "model", dtype="float32")
    model, tokenizer = dlm.load(exported)
    assert model.config.block_size == 8 and model.config.is_block_model
    assert evaluate_source(exported, tiny_data_dir, batches=1, mc_samples=2, batch_size=2).nll == report.nll
    result = dlm.sample(model, tokenizer, prompt="ROMEO:", length=20, steps=6, seed=3, stop_at_end=True)
    again = dlm.sample(model, tokenizer, prompt="ROMEO:", length=20, steps=6, seed=3, stop_at_end=True)
    assert result.texts == again.texts and result.texts[0].startswith("ROMEO:")
    assert "<|mask|>" not in result.texts[0]


def test_bench_times_the_block_step_and_counts_its_2l_pass(tmp_path: Path) -> None:
    overrides = (
        f"training.tokenizer={tmp_path / 'tokenizer.json'}",
        f"training.train_data={tmp_path / 'x.bin'}",
        "training.val_data=none",
    )
    plain = load_config(ROOT / "configs" / "tiny.toml", list(overrides))
    block = load_config(ROOT / "configs" / "tiny.toml", [*overrides, "model.block_size=16"])
    result = run_benchmark(block, steps=2, warmup=1, batch_size=4)
    assert result.attention_backend.startswith("sdpa-mask") and "2L" in result.attention_backend
    model, reference = DiffusionTransformer(block.model), DiffusionTransformer(plain.model)
    n, attention = model.num_parameters, 12 * 2 * 64 * 64  # 12 x layers x width x seq_len
    assert result.flops_per_token == model.flops_per_token(64) == 2 * 6 * n + 4 * attention
    assert reference.flops_per_token(64) == 6 * n + attention
    assert math.isfinite(result.loss) and result.tokens_per_second > 0


def test_the_ar_baseline_config_differs_from_the_diffusion_one_only_in_its_variant() -> None:
    diffusion = load_config(ROOT / "configs" / "shakespeare.toml").model_dump()
    autoregressive = load_config(ROOT / "configs" / "shakespeare-ar.toml").model_dump()
    assert autoregressive["model"] == {**diffusion["model"], "block_size": 1, "attention": "causal"}
    run_dir = autoregressive["training"]["output_dir"]
    assert run_dir.name == "shakespeare-ar"
    assert autoregressive["training"] == {**diffusion["training"], "output_dir": run_dir}
    assert autoregressive["diffusion"] == diffusion["diffusion"]


def test_clipped_training_range_keeps_block_times_inside_it(tiny_data_dir: Path, tmp_path: Path) -> None:
    times = accumulation_mask_probabilities(4, 0, 2, 0.7, 0.3, "cpu", blocks=4, high=0.8)
    assert bool(((times >= 0.3) & (times <= 0.8)).all())
    grid = torch.cat([times, accumulation_mask_probabilities(4, 1, 2, 0.7, 0.3, "cpu", blocks=4, high=0.8)])
    torch.testing.assert_close(grid.flatten().sort().values.diff(), torch.full((31,), 0.5 / 32))
    seen = []
    original = corrupt_tokens

    def spy(*args: object, **kwargs: object):  # records the times the training step draws
        seen.append(args[2])
        return original(*args, **kwargs)

    experiment = tiny_experiment(
        tiny_data_dir,
        tmp_path / "run",
        "model.block_size=16",
        "training.max_steps=2",
        "training.warmup_steps=1",
        "training.clip_mask_min=0.3",
        "training.clip_mask_max=0.8",
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("dlm.train.step.corrupt_tokens", spy)
        train(experiment)
    assert seen and all(bool(((t >= 0.3) & (t <= 0.8)).all()) for t in seen)
    with pytest.raises(UserError, match="clip_mask_min"):
        tiny_experiment(tiny_data_dir, tmp_path / "bad", "training.clip_mask_min=0.8", "training.clip_mask_max=0.3")
    with pytest.raises(UserError, match="linear"):
        tiny_experiment(tiny_data_dir, tmp_path / "bad", "training.clip_mask_min=0.3", "diffusion.schedule=cosine")


@pytest.mark.skipif(flex_attention is None, reason="this torch has no flex attention")
def test_the_flex_block_mask_selects_the_same_keys_as_the_boolean_mask() -> None:
    # CUDA trains with the flex kernel; its block mask must be the BD3 pattern. Eager flex (no
    # backward on the CPU) is enough to compare the two masks' outputs here.
    length, block_size = 16, 4
    q, k, v = (torch.randn(2, 2, 2 * length, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    block_mask = _bd3_flex(length, block_size, torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is a slow reference
        flex = flex_attention(q, k, v, block_mask=block_mask)
    boolean = attend(q, k, v, AttentionMask("sdpa-mask", _bd3_bool(length, block_size, torch.device("cpu"))))
    torch.testing.assert_close(flex, boolean, atol=1e-5, rtol=0)
    # The training pass's last layer: the noisy queries only, against every key.
    noisy_only = _bd3_flex(length, block_size, torch.device("cpu"), length)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = flex_attention(q[:, :, :length], k, v, block_mask=noisy_only)
    torch.testing.assert_close(flex, boolean[:, :, :length], atol=1e-5, rtol=0)
