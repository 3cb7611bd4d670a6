"""The ELBO's two Monte Carlo estimators: the same bound (by enumeration and by sampling), the
exact-count one with less variance, loss masks, block models, seeding and `dlm eval --estimator`."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import train_tiny_run
from torch import Tensor

from benchmarks.elbo_variance import elbo_variance
from dlm.config.schema import ModelConfig
from dlm.diffusion.objective import corrupt_exact_count, diffusion_cross_entropy, elbo_nll
from dlm.errors import UserError
from dlm.evaluation.evaluate import evaluate_model
from dlm.model.transformer import DiffusionTransformer

VOCAB, MASK_ID, LENGTH = 6, 1, 5


class ContextLogits:
    """Deterministic logits at each masked position that depend on which tokens are masked around it
    (within `block` positions' block, or the whole sequence), so the bound is not trivial."""

    def __init__(self, length: int, block: int = 0) -> None:
        generator = torch.Generator().manual_seed(7)
        self.weight = torch.randn(length * (VOCAB + 1), length, VOCAB, generator=generator, dtype=torch.float64)
        self.length, self.block = length, block or length

    def __call__(self, noisy: Tensor, mask: Tensor) -> Tensor:
        features = torch.nn.functional.one_hot(noisy, VOCAB + 1).double()  # [B, L, V+1]
        position = torch.arange(self.length)
        rows = []
        for i in range(self.length):  # position i sees only its own block
            seen = (position // self.block == i // self.block).double()[None, :, None]
            rows.append(torch.einsum("bf,fv->bv", (features * seen).flatten(1), self.weight[:, i]))
        return torch.stack(rows, dim=1)[mask].float()


def masked_ce_sum(logits_fn: ContextLogits, clean: Tensor, mask: Tensor) -> float:
    """The plain cross-entropy sum over the masked positions of one corruption."""

    logits = logits_fn(clean.masked_fill(mask, MASK_ID), mask)
    return float(torch.nn.functional.cross_entropy(logits.double(), clean[mask], reduction="sum"))


def continuous_elbo(logits_fn: ContextLogits, clean: Tensor, segments: list[list[int]], scored: int) -> float:
    """The negative ELBO per scored token from its definition: for each segment (block) of maskable
    positions, E_t[(1 / t) x CE of the masked ones] with each position masked with probability t,
    the integral over t of t^k (1 - t)^(n - k) / t being the Beta function B(k, n - k + 1)."""

    total = 0.0
    for segment in segments:
        n = len(segment)
        for k in range(1, n + 1):
            beta = math.gamma(k) * math.gamma(n - k + 1) / math.gamma(n + 1)
            for chosen in itertools.combinations(segment, k):
                mask = torch.zeros_like(clean, dtype=torch.bool)
                mask[0, list(chosen)] = True
                total += beta * masked_ce_sum(logits_fn, clean, mask)
    return total / scored


def exact_count_expectation(
    logits_fn: ContextLogits, clean: Tensor, block: int, loss_mask: Tensor | None, counts: list[int]
) -> float:
    """The mean of the exact-count estimator over every count and every permutation of the keys."""

    blocks = len(counts)
    values = []
    for order in itertools.permutations(range(LENGTH)):
        keys = torch.tensor([order], dtype=torch.float32) / LENGTH
        for picks in itertools.product(*(range(n) for n in counts)):
            units = torch.tensor([[(pick + 0.5) / n for pick, n in zip(picks, counts, strict=True)]])
            corruption = corrupt_exact_count(
                clean, MASK_ID, units if blocks > 1 else units[:, 0], keys, block_size=block, loss_mask=loss_mask
            )
            logits = logits_fn(corruption.noisy_tokens, corruption.mask)
            values.append(float(diffusion_cross_entropy(logits, clean, corruption).per_sequence_nll[0]))
    return sum(values) / len(values)


CLEAN = torch.tensor([[2, 3, 4, 5, 3]])


def test_exact_count_has_the_bound_as_its_exact_expectation() -> None:
    logits_fn = ContextLogits(LENGTH)
    expected = continuous_elbo(logits_fn, CLEAN, [list(range(LENGTH))], LENGTH)
    assert exact_count_expectation(logits_fn, CLEAN, 0, None, [LENGTH]) == pytest.approx(expected, rel=1e-6)


def test_exact_count_masks_and_scores_only_the_loss_positions() -> None:
    logits_fn = ContextLogits(LENGTH)
    loss_mask = torch.tensor([[False, False, True, True, True]])  # a prompt of two tokens
    expected = continuous_elbo(logits_fn, CLEAN, [[2, 3, 4]], 3)
    assert exact_count_expectation(logits_fn, CLEAN, 0, loss_mask, [3]) == pytest.approx(expected, rel=1e-6)
    corruption = corrupt_exact_count(CLEAN, MASK_ID, torch.tensor([0.99]), torch.rand(1, LENGTH), loss_mask=loss_mask)
    assert corruption.mask.tolist() == [[False, False, True, True, True]]  # l = n = 3, never the prompt


def test_exact_count_of_a_block_model_is_the_sum_of_its_blocks_bounds() -> None:
    logits_fn = ContextLogits(LENGTH, block=2)  # blocks [0, 1], [2, 3], [4]
    expected = continuous_elbo(logits_fn, CLEAN, [[0, 1], [2, 3], [4]], LENGTH)
    assert exact_count_expectation(logits_fn, CLEAN, 2, None, [2, 2, 1]) == pytest.approx(expected, rel=1e-6)


def test_a_count_of_l_masks_exactly_l_positions_with_weight_n_over_l() -> None:
    clean = torch.randint(2, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    units = torch.tensor([0.0, 0.3, 0.5, 0.999999])
    corruption = corrupt_exact_count(clean, MASK_ID, units, torch.rand(4, 16, generator=torch.Generator()))
    assert corruption.mask.sum(dim=1).tolist() == [1, 5, 9, 16]
    assert torch.equal(corruption.mask_probability, torch.tensor([1, 5, 9, 16]) / 16)
    assert torch.equal(corruption.noisy_tokens, clean.masked_fill(corruption.mask, MASK_ID))


def tiny_model(seed: int = 0, block_size: int = 0) -> DiffusionTransformer:
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=64,
        mask_token_id=MASK_ID,
        max_seq_len=32,
        d_model=32,
        n_layers=2,
        n_heads=4,
        pad_vocab_multiple=64,
        block_size=block_size,
    )
    return DiffusionTransformer(config).eval()


def sample_estimates(model: DiffusionTransformer, clean: Tensor, estimator: str, draws: int) -> Tensor:
    """`draws` independent one-sample estimates per sequence, [draws, B]."""

    def logits(noisy: Tensor, mask: Tensor) -> Tensor:
        return model(noisy, output_positions=mask)

    generator = torch.Generator().manual_seed(11)
    return torch.stack(
        [elbo_nll(logits, clean, MASK_ID, 1, 1e-3, generator, estimator=estimator)[0] for _ in range(draws)]
    )


def test_both_estimators_agree_and_exact_count_has_the_smaller_error() -> None:
    model = tiny_model()
    # Repetitive sequences: the model's loss then depends on how much of the context is masked.
    clean = torch.tensor([[2, 3, 4, 5] * 8, [6, 7] * 16, [8, 9, 10, 11, 12, 13, 14, 15] * 4, [20] * 32])
    with torch.no_grad():
        bernoulli = sample_estimates(model, clean, "bernoulli", 400)
        exact = sample_estimates(model, clean, "exact-count", 400)
    for b in range(clean.shape[0]):
        error = math.sqrt(float(bernoulli[:, b].var() + exact[:, b].var()) / 400)
        assert abs(float(bernoulli[:, b].mean() - exact[:, b].mean())) < 4 * error
        assert float(exact[:, b].std()) < float(bernoulli[:, b].std())


@pytest.mark.parametrize("estimator", ["bernoulli", "exact-count"])
def test_the_elbo_does_not_depend_on_the_batch_size(estimator: str) -> None:
    model = tiny_model()
    data = torch.randint(2, 64, (8, 32), generator=torch.Generator().manual_seed(2))
    reports = [
        evaluate_model(model, data, batches=8, batch_size=size, mc_samples=3, estimator=estimator) for size in (2, 8)
    ]
    assert reports[0].nll == pytest.approx(reports[1].nll, abs=1e-6)
    assert reports[0].nll_mc_stderr == pytest.approx(reports[1].nll_mc_stderr, abs=1e-6)
    assert reports[0].estimator == estimator


def test_block_size_one_estimators_give_the_same_exact_likelihood() -> None:
    model = tiny_model(block_size=1)
    data = torch.randint(2, 64, (4, 32), generator=torch.Generator().manual_seed(3))
    reports = [
        evaluate_model(model, data, batches=1, batch_size=4, mc_samples=2, estimator=name)
        for name in ("bernoulli", "exact-count")
    ]
    assert reports[0].nll == reports[1].nll and reports[1].nll_mc_stderr == 0.0


@pytest.fixture(scope="module")
def tiny_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_data_dir, tmp_path_factory.mktemp("estimators") / "run")


def test_cli_eval_estimator_option(
    tiny_run: Path, run_cli, narrow_console: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tiny_run
    result = run_cli(
        "eval", str(run_dir), "--estimator", "exact-count", "--batches", "1", "--mc-samples", "2", "--json"
    )
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["estimator"] == "exact-count" and report["nll"] > 0
    monkeypatch.setattr("dlm.cli.eval_cmd.wants_json", lambda flag: False)
    human = run_cli("eval", str(run_dir), "--estimator", "exact-count", "--batches", "1", "--mc-samples", "2")
    assert "counts" in human.stdout and "times" not in human.stdout  # the note names what K draws
    wrong = run_cli("eval", str(run_dir), "--estimator", "poisson")
    assert wrong.exit_code == 2 and "poisson" in wrong.stderr and "Traceback" not in wrong.stderr
    with pytest.raises(UserError, match="--estimator must be one of bernoulli, exact-count"):
        evaluate_model(tiny_model(), torch.zeros(1, 32, dtype=torch.long), estimator="poisson")


def test_the_variance_benchmark_compares_the_estimators_on_one_model(
    tiny_run: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    elbo_variance(tiny_run, tiny_data_dir, sequences=4, repeats=3, mc_samples="1,2", results=tmp_path)
    result = json.loads((tmp_path / "elbo-variance.json").read_text())["figures"]
    assert (result["sequences"], result["repeats"], result["step"]) == (4, 3, 4)
    assert [key for key in result if key.startswith("mc_samples_")] == ["mc_samples_1", "mc_samples_2"]
    for row in (result["mc_samples_1"], result["mc_samples_2"]):
        variance = row["mc_variance"]
        assert row["variance_ratio"] == pytest.approx(variance["bernoulli"] / variance["exact_count"])
        assert row["variance_ratio"] > 1  # a 4-step model's loss hardly depends on the context
