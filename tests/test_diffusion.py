"""The diffusion objective against its mathematics: expectations, weights, coverage, determinism."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from dlm.diffusion.objective import (
    Corruption,
    accumulation_mask_probabilities,
    corrupt_tokens,
    diffusion_cross_entropy,
    elbo_nll,
    masked_token_losses,
    noise_generator,
    noise_seed,
    step_time_offset,
    stratified_times,
)

VOCAB, MASK_ID, EPS = 50, 1, 1e-3


def perfect_logits(clean: torch.Tensor, mask: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    """Logits at masked positions putting (numerically) all probability on the clean token."""

    logits = torch.full((int(mask.sum()), vocab), -1e4)
    logits[torch.arange(logits.shape[0]), clean[mask]] = 0.0
    return logits


@pytest.mark.parametrize("probability", [0.0, 0.05, 0.3, 0.9])
def test_uniform_model_loss_has_mean_log_vocab_for_any_mask_probability(probability: float) -> None:
    # With uniform logits every masked token costs log V, and E[#masked] = t x B x L, so the
    # 1/t weighting makes the expected per-token loss exactly log V whatever t is.
    batch, length, draws = 8, 64, 200
    generator = torch.Generator().manual_seed(0)
    clean = torch.randint(VOCAB, (batch, length), generator=generator)
    losses = []
    for _ in range(draws):
        corruption = corrupt_tokens(clean, MASK_ID, torch.full((batch,), probability), EPS, generator)
        logits = torch.zeros(int(corruption.mask.sum()), VOCAB)
        losses.append(diffusion_cross_entropy(logits, clean, corruption).loss)
    t = max(probability, EPS)
    # loss = log V x M / (t B L) with M ~ Binomial(B L, t): its standard deviation, averaged over draws.
    sigma = math.log(VOCAB) * math.sqrt((1 - t) / (t * batch * length * draws))
    assert abs(torch.stack(losses).mean().item() - math.log(VOCAB)) < 5 * sigma


def test_fully_masked_uniform_model_loss_is_exactly_log_vocab() -> None:
    clean = torch.randint(VOCAB, (3, 10))
    corruption = corrupt_tokens(clean, MASK_ID, torch.ones(3), EPS)
    assert bool(corruption.mask.all())
    result = diffusion_cross_entropy(torch.zeros(30, VOCAB), clean, corruption)
    assert result.loss.item() == pytest.approx(math.log(VOCAB), rel=1e-6)
    assert torch.allclose(result.per_sequence_nll, torch.full((3,), math.log(VOCAB)))


def test_model_with_all_mass_on_the_truth_has_zero_loss() -> None:
    clean = torch.randint(VOCAB, (4, 32))
    corruption = corrupt_tokens(clean, MASK_ID, torch.tensor([0.2, 0.5, 0.8, 1.0]), EPS)
    result = diffusion_cross_entropy(perfect_logits(clean, corruption.mask), clean, corruption)
    assert result.loss.item() == 0.0
    assert result.masked_accuracy.item() == 1.0
    assert torch.equal(result.per_sequence_nll, torch.zeros(4))


def test_loss_weights_each_masked_token_by_its_sequences_inverse_mask_probability() -> None:
    # Sequence 0 (t = 0.5): two masked tokens predicted uniformly, each costing log V.
    # Sequence 1 (t = 0.25): one masked token predicted perfectly, one with p(truth) = 1/2.
    clean = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[True, False, True, False], [False, True, False, True]])
    times = torch.tensor([0.5, 0.25])  # linear: mask probability t, loss weight 1 / t
    corruption = Corruption(clean.masked_fill(mask, MASK_ID), mask, times, times, torch.ones(2))
    logits = torch.zeros(4, VOCAB)
    logits[2] = -1e4
    logits[2, 10] = 0.0  # perfect on token 10
    logits[3] = -1e4
    logits[3, 12] = logits[3, 13] = 0.0  # half the mass on the truth 12
    result = diffusion_cross_entropy(logits, clean, corruption)
    nll0 = 2 * math.log(VOCAB) / 0.5
    nll1 = math.log(2) / 0.25
    assert result.loss.item() == pytest.approx((nll0 + nll1) / 8, rel=1e-6)
    assert result.per_sequence_nll.tolist() == pytest.approx([nll0 / 4, nll1 / 4], rel=1e-6)
    assert result.masked_tokens.dtype == torch.long and result.masked_tokens.dim() == 0
    assert result.masked_tokens.item() == 4
    # Argmax: uniform rows pick token 0 (wrong), row 2 is right, row 3 ties 12 / 13 -> 12 (right).
    assert result.masked_accuracy.item() == pytest.approx(0.5)


def test_no_masked_tokens_gives_zero_loss_that_still_backpropagates() -> None:
    clean = torch.randint(VOCAB, (2, 8))
    mask = torch.zeros(2, 8, dtype=torch.bool)
    corruption = Corruption(clean.clone(), mask, torch.full((2,), EPS), torch.full((2,), EPS), torch.ones(2))
    weight = torch.randn(VOCAB, 16, requires_grad=True)
    logits = torch.zeros(0, 16) @ weight.T
    result = diffusion_cross_entropy(logits, clean, corruption)
    result.loss.backward()  # every process must reach backward, even with nothing masked
    assert result.loss.item() == 0.0 and result.masked_tokens.item() == 0
    assert result.masked_accuracy.item() == 0.0
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_cross_entropy_runs_in_float32_under_autocast() -> None:
    clean = torch.randint(VOCAB, (2, 16))
    corruption = corrupt_tokens(clean, MASK_ID, torch.full((2,), 0.5), EPS, torch.Generator().manual_seed(1))
    logits = torch.randn(int(corruption.mask.sum()), VOCAB).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = diffusion_cross_entropy(logits, clean, corruption)
    assert result.loss.dtype == torch.float32
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    expected = -(log_probs[torch.arange(len(logits)), clean[corruption.mask]] / 0.5).sum() / 32
    assert result.loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_corruption_masks_at_the_requested_rate_and_only_writes_the_mask_id() -> None:
    generator = torch.Generator().manual_seed(2)
    clean = torch.randint(2, VOCAB, (3, 20_000), generator=generator)
    probability = torch.tensor([0.0, 0.3, 1.5])  # clamped to [eps, 1]
    corruption = corrupt_tokens(clean, MASK_ID, probability, EPS, generator)
    assert torch.equal(corruption.mask_probability, torch.tensor([EPS, 0.3, 1.0]))
    rates = corruption.mask.float().mean(dim=1)
    for rate, t in zip(rates.tolist(), corruption.mask_probability.tolist(), strict=True):
        assert abs(rate - t) <= 5 * math.sqrt(t * (1 - t) / 20_000) + 1e-12
    assert torch.equal(corruption.noisy_tokens == MASK_ID, corruption.mask)
    assert torch.equal(corruption.noisy_tokens[~corruption.mask], clean[~corruption.mask])


@pytest.mark.parametrize("offset", [0.0, 0.37, 0.999999])
def test_stratified_sampler_puts_one_time_in_each_equal_bin_of_eps_to_one(offset: float) -> None:
    batch, accumulation = 4, 3
    times = torch.cat(
        [accumulation_mask_probabilities(batch, m, accumulation, offset, EPS, "cpu") for m in range(accumulation)]
    )
    assert times.min() >= EPS and times.max() <= 1.0
    slots = batch * accumulation
    bins = torch.floor((times - EPS) / (1 - EPS) * slots).long()
    assert sorted(bins.tolist()) == list(range(slots))
    # Evenly spaced: consecutive sorted times (cyclically) are exactly (1 - eps) / slots apart.
    gaps = torch.diff(torch.sort(times).values)
    assert torch.allclose(gaps, torch.full_like(gaps, (1 - EPS) / slots), atol=1e-6)


def test_two_ranks_see_the_times_of_one_rank_with_twice_the_accumulation() -> None:
    batch, accumulation, offset = 3, 2, 0.61
    for m in range(accumulation):
        for rank in range(2):
            two_ranks = accumulation_mask_probabilities(batch, m, accumulation, offset, EPS, "cpu", rank, 2)
            one_rank = accumulation_mask_probabilities(batch, 2 * m + rank, 2 * accumulation, offset, EPS, "cpu")
            assert torch.equal(two_ranks, one_rank)
    with pytest.raises(ValueError):
        accumulation_mask_probabilities(batch, 0, accumulation, offset, EPS, "cpu", rank=2, world_size=2)


def test_every_slot_time_is_uniform_over_eps_to_one_for_a_uniform_offset() -> None:
    offsets = torch.rand(20_000, generator=torch.Generator().manual_seed(3))
    times = stratified_times(offsets, torch.full_like(offsets, 5), 8, EPS)
    # U[eps, 1]: mean (1 + eps) / 2, variance (1 - eps)^2 / 12.
    assert abs(times.mean().item() - (1 + EPS) / 2) < 5 * math.sqrt(1 / 12 / 20_000)
    assert times.var().item() == pytest.approx((1 - EPS) ** 2 / 12, rel=0.05)


def test_noise_generators_depend_only_on_seed_and_index() -> None:
    first = torch.rand(64, generator=noise_generator(7, 3, "cpu"))
    torch.manual_seed(12345)  # global RNG history must not matter
    torch.rand(10)
    assert torch.equal(first, torch.rand(64, generator=noise_generator(7, 3, "cpu")))
    assert not torch.equal(first, torch.rand(64, generator=noise_generator(7, 4, "cpu")))
    assert not torch.equal(first, torch.rand(64, generator=noise_generator(8, 3, "cpu")))


def test_noise_seeds_are_distinct_order_sensitive_and_unambiguous() -> None:
    seeds = {noise_seed(s, i) for s in range(30) for i in range(30)}
    assert len(seeds) == 900
    assert noise_seed(1, 2) != noise_seed(2, 1)
    assert noise_seed(5) != noise_seed(5, 0)  # a trailing zero index is a different stream
    assert noise_seed(2**32) != noise_seed(0, 1)  # a large seed is not two small indices
    assert all(0 <= seed < 2**63 for seed in seeds)
    with pytest.raises(ValueError):
        noise_seed(-1)


def test_noise_seed_is_identical_in_a_fresh_interpreter() -> None:
    # A fresh process has a different str-hash salt: this fails if mixing used hash().
    code = (
        "from dlm.diffusion.objective import noise_seed, step_time_offset; "
        "print(noise_seed(1337, 42), step_time_offset(1, 9))"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(output[0]) == noise_seed(1337, 42)
    assert float(output[1]) == step_time_offset(1, 9)


def test_step_time_offsets_are_deterministic_and_uniform_on_the_unit_interval() -> None:
    offsets = torch.tensor([step_time_offset(11, step) for step in range(4000)], dtype=torch.float64)
    assert offsets.min() >= 0.0 and offsets.max() < 1.0
    assert abs(offsets.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / 4000)
    assert step_time_offset(11, 5) == offsets[5].item()
    assert len(set(offsets.tolist())) == 4000


def test_elbo_of_a_uniform_model_is_log_vocab_within_its_standard_error() -> None:
    clean = torch.randint(VOCAB, (16, 32), generator=torch.Generator().manual_seed(4))

    def uniform(noisy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(int(mask.sum()), VOCAB)

    nll, stderr = elbo_nll(uniform, clean, MASK_ID, 16, EPS, torch.Generator().manual_seed(5))
    assert nll.shape == stderr.shape == (16,)
    assert bool((stderr > 0).all())
    # Averaging the 16 independent sequences: the error of the mean is sqrt(sum se^2) / 16.
    combined = stderr.pow(2).sum().sqrt() / 16
    assert abs(nll.mean().item() - math.log(VOCAB)) < 5 * combined.item()


def test_elbo_of_a_perfect_model_is_zero_with_zero_error() -> None:
    clean = torch.randint(VOCAB, (4, 16), generator=torch.Generator().manual_seed(6))
    nll, stderr = elbo_nll(lambda noisy, mask: perfect_logits(clean, mask), clean, MASK_ID, 4, EPS)
    assert torch.equal(nll, torch.zeros(4)) and torch.equal(stderr, torch.zeros(4))


def test_the_loss_uses_the_given_token_losses() -> None:
    # Training passes a compiled copy of masked_token_losses; any callable with its contract serves.
    torch.manual_seed(0)
    clean = torch.randint(3, 50, (2, 8))
    corruption = corrupt_tokens(clean, 1, torch.tensor([0.5, 0.9]), 1e-3, torch.Generator().manual_seed(1))
    logits = torch.randn(int(corruption.mask.sum()), 50)
    reference = diffusion_cross_entropy(logits, clean, corruption)
    calls = []

    def doubled(rows: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(rows.shape)
        ce, hits = masked_token_losses(rows, targets)
        return 2 * ce, hits

    custom = diffusion_cross_entropy(logits, clean, corruption, doubled)
    assert calls == [logits.shape]
    assert torch.equal(custom.loss, 2 * reference.loss)
    assert torch.equal(custom.masked_accuracy, reference.masked_accuracy)
