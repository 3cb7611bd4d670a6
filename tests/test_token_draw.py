"""The token draw (`dlm.sampling.tokens`): the nucleus by its definition, every token reachable on
its own interval, draws that follow the filtered distribution, and threshold decoding's tokens.

`THRESHOLD_EXPECTATION` holds token ids that threshold decoding produced with the draw by inverse
distribution function (regenerate only for a deliberate change: `python tests/test_token_draw.py`).
The model runs in float64, so the recorded tokens hold on CPUs with and without AVX-512 (no choice
along the way is a tie within float64 rounding).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dlm.config.schema import ModelConfig
from dlm.model.transformer import DiffusionTransformer
from dlm.sampling import tokens as token_draw
from dlm.sampling.dispatch import denoise
from dlm.sampling.options import SamplingOptions
from dlm.sampling.tokens import (
    _MAX_TRIALS,
    _BlockMass,
    _nucleus,
    draws_per_row,
    filter_logits,
    inverse_cdf,
    sample_tokens,
    sample_with_probabilities,
    trials,
)

THRESHOLD_EXPECTATION = Path(__file__).parent / "data" / "threshold_expectation.json"
# Vocabulary 2048: an untrained model gives ~1/2048 to a token, so 0.0006 commits some by threshold.
THRESHOLD_CASES: dict[str, dict[str, Any]] = {
    "threshold": {"threshold": 0.0006, "steps": 12},
    "threshold_margin_blocks": {"threshold": 0.0002, "remasking": "margin", "block_length": 8, "steps": 8},
    "threshold_temperature": {"threshold": 0.0006, "temperature": 0.7, "top_k": 300, "top_p": 0.8, "steps": 6},
    "threshold_greedy": {"threshold": 0.9, "temperature": 0, "steps": 10},
    "confidence_full_nucleus": {"remasking": "confidence", "top_p": None, "steps": 8},
}


def threshold_tokens() -> dict[str, list[list[int]]]:
    config = ModelConfig(vocab_size=2048, max_seq_len=24, d_model=32, n_layers=2, n_heads=2, pad_vocab_multiple=64)
    torch.manual_seed(0)
    model = DiffusionTransformer(config).double().eval()
    tokens = torch.tensor([[5, 9, 14, *[config.mask_token_id] * 21]] * 3)
    fill = tokens[0] == config.mask_token_id
    results = {}
    with torch.inference_mode():
        for name, case in THRESHOLD_CASES.items():
            generator = torch.Generator().manual_seed(7)
            results[name] = denoise(model, tokens, fill, SamplingOptions(**case), generator=generator)[0].tolist()
    return results


def test_threshold_tokens_are_those_recorded_before_the_cheaper_cut() -> None:
    assert threshold_tokens() == json.loads(THRESHOLD_EXPECTATION.read_text())


def bfloat16_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Logits as a bfloat16 model gives them: spread over several units, with many exact ties."""

    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * 3).bfloat16().float()


def nucleus_reference(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens the top-p nucleus keeps, by its definition: the strictly more likely tokens
    hold less than top_p of the probability (float64, token by token)."""

    probs = logits.double().softmax(dim=-1)
    ahead = torch.stack([(probs * (logits > logits[:, [k]])).sum(dim=-1) for k in range(logits.shape[1])], -1)
    return ahead < top_p


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.9, 0.999])
def test_the_nucleus_is_every_token_whose_more_likely_tokens_hold_less_than_top_p(top_p: float) -> None:
    logits = bfloat16_logits(32, 300)
    logits[:, :5] = -math.inf
    kept = torch.isfinite(filter_logits(logits, top_p=top_p))
    assert torch.equal(kept, nucleus_reference(logits, top_p))
    assert kept.sum(dim=-1).min() >= 1
    # The draw's own cut (its fallback) works on the weights, exp(x - max): the same tokens.
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    assert torch.equal(_nucleus(weights, top_p) > 0, kept)


def test_tokens_tied_at_the_cut_are_all_kept() -> None:
    # Probabilities 0.25 each: 0.6 is reached inside the tie, and every tied token stays.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, -math.inf]])
    assert torch.isfinite(filter_logits(logits, top_p=0.6)).tolist() == [[True] * 4 + [False]]
    # 2.0 alone holds less than top_p, so the four tokens tied at 0.0 all join it; -1.0 is cut.
    shuffled = torch.tensor([[-1.0, 0.0, 2.0, 0.0, 0.0, 0.0]])
    top_p = float(shuffled.softmax(dim=-1)[0, 2]) + 0.01
    assert torch.isfinite(filter_logits(shuffled, top_p=top_p)).tolist() == [[False, True, True, True, True, True]]


def test_every_token_with_weight_is_drawn_exactly_on_its_own_interval() -> None:
    # Weights from 3 down to 1e-300 across several blocks of 64 and a ragged last block: the
    # uniform at the middle of a token's interval of the distribution function draws that token,
    # however small its weight, down to float64's resolution of the weight before it in its block
    # (1e-16 relative; 32-bit Gumbel noise loses tokens below ~1e-7).
    weights = torch.zeros(1, 150, dtype=torch.float64)
    chosen = [0, 3, 63, 64, 65, 127, 128, 140, 149]
    weights[0, chosen] = torch.tensor([1.0, 1e-9, 0.5, 1e-300, 2.0, 1e-12, 0.25, 3.0, 1e-5], dtype=torch.float64)
    ends = weights[0].cumsum(dim=0)
    total = float(ends[-1])
    for token in chosen:
        middle = (float(ends[token]) - float(weights[0, token]) / 2) / total
        assert inverse_cdf(weights, torch.tensor([middle], dtype=torch.float64)).item() == token
    # The extremes of the draws, 0 and the largest float64 below 1, land on tokens with weight.
    for u in (0.0, 1 - 2**-53):
        assert inverse_cdf(weights, torch.tensor([u], dtype=torch.float64)).item() in (0, 149)


def test_no_draw_lands_on_a_token_without_weight() -> None:
    logits = bfloat16_logits(256, 200, seed=4)
    logits[:, ::3] = -math.inf
    uniform = torch.rand(256, draws_per_row(0.9), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    uniform[:8] = 1 - 2**-53  # rounding u x total up to the total must not step past the last token
    uniform[8:16] = 0.0
    tokens = sample_tokens(logits, top_p=0.9, uniform=uniform)
    assert bool(torch.isfinite(logits.gather(1, tokens[:, None])).all())


def test_a_target_past_its_block_by_rounding_still_lands_on_a_token_with_weight() -> None:
    # The blocks' float64 cumulative masses can round past a block's own (float32-summed) mass, so
    # the target inside the block can reach its whole mass: the draw then takes the block's last
    # token with weight, never the zero-weight entries after it.
    entries = torch.zeros(1, 2, 64)
    entries[0, 0, 0] = entries[0, 1, :3] = 1.0
    mass = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    ends = torch.tensor([[1.0, 4.5]], dtype=torch.float64)  # rounded up past 1 + 3
    for u in (0.95, 0.99, 1 - 2**-53):
        assert (
            _BlockMass(entries.view(1, 128), mass, ends).draw(torch.tensor([u], dtype=torch.float64)).item() == 64 + 2
        )


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, None), (1.0, None, 0.9), (0.7, None, 0.8), (1.3, 5, 0.95), (1.0, None, 0.2)],
)
def test_draws_follow_the_filtered_distribution(temperature: float, top_k: int | None, top_p: float | None) -> None:
    logits = bfloat16_logits(1, 70, seed=5) / 2
    target = filter_logits(logits.double() / temperature, top_k=top_k, top_p=top_p).softmax(dim=-1)[0]
    draws = 40_000
    generator = torch.Generator().manual_seed(6)
    tokens = sample_tokens(
        logits.expand(draws, -1), temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
    )
    frequencies = torch.bincount(tokens, minlength=70).double() / draws
    assert bool((frequencies[target == 0] == 0).all())  # nothing outside the filtered support
    # Total variation of 40,000 draws from a distribution over ~30-70 tokens: ~0.01 by chance alone.
    assert float((frequencies - target).abs().sum() / 2) < 0.03


def test_rows_that_refuse_every_trial_are_drawn_from_the_nucleus_with_their_last_uniform() -> None:
    # top_p 0.05 keeps only the most likely token here; the trials' uniforms all propose the last one.
    logits = torch.tensor([[3.0, 1.0, 0.5, 0.4, 0.3]]).expand(4, -1)
    width = draws_per_row(0.05)
    assert width == trials(0.05) + 1 == _MAX_TRIALS + 1  # 0.95 ** 16: most rows need no fallback
    uniform = torch.full((4, width), 1 - 1e-9, dtype=torch.float64)
    uniform[:, -1] = torch.tensor([0.0, 0.3, 0.6, 0.99])
    assert sample_tokens(logits, top_p=0.05, uniform=uniform).tolist() == [0, 0, 0, 0]


def test_draws_have_the_documented_shape_and_leave_the_callers_alone() -> None:
    logits = bfloat16_logits(6, 130)
    uniform = torch.rand(6, draws_per_row(0.9), dtype=torch.float64)
    before_logits, before_uniform = logits.clone(), uniform.clone()
    sample_tokens(logits, top_p=0.9, uniform=uniform, temperature=0.8)
    assert torch.equal(logits, before_logits) and torch.equal(uniform, before_uniform)
    assert draws_per_row(None) == draws_per_row(1.0) == 1
    with pytest.raises(ValueError, match="uniform draws of shape"):
        sample_tokens(logits, top_p=0.9, uniform=uniform[:, :2])


def test_float64_logits_are_sampled_in_float64() -> None:
    # A float64 model's batched and one-by-one logits agree to ~1e-16; drawn in float32 they would
    # round apart. Two tokens 1e-12 apart in probability keep their exact split.
    logits = torch.tensor([[0.0, 1e-12]], dtype=torch.float64)
    split = 0.5 - 2.5e-13  # the first token's probability
    for u, token in ((split - 1e-14, 0), (split + 1e-14, 1)):
        assert sample_tokens(logits, uniform=torch.tensor([[u]], dtype=torch.float64)).item() == token


def test_only_picks_light_enough_to_be_cut_are_tested_against_the_nucleus(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rows whose first token holds 0.95 of the mass: a pick of it is in the 0.9 nucleus by itself
    # (the tokens heavier than it hold nothing), so only the rows that drew another token are tested.
    logits = torch.tensor([[5.0, 1.0, 0.5, 0.0, -1.0]]).expand(40, -1).contiguous()
    assert float(logits[0].softmax(dim=-1)[0]) > 0.95
    uniform = torch.rand(40, draws_per_row(0.9), dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    uniform[:, 0] = torch.linspace(0, 0.999, 40, dtype=torch.float64)  # the last few pass the first token
    tested: list[int] = []
    real = token_draw._mass_ahead

    def counted(weights: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
        tested.append(weights.shape[0])
        return real(weights, picks)

    monkeypatch.setattr(token_draw, "_mass_ahead", counted)
    tokens = sample_tokens(logits, top_p=0.9, uniform=uniform)
    light = int((uniform[:, 0] * float(logits[0].exp().sum()) >= float(logits[0, 0].exp())).sum())
    assert 0 < light < 40 and tested[0] == light
    assert set(tokens.tolist()) == {0}  # the nucleus here is the first token alone


def test_a_pick_holding_more_than_one_less_top_p_stays_whatever_the_test_would_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Token 1 holds 0.15 of the mass, so it is in the 0.9 nucleus (0.6 ahead of it) on its own; a
    # test whose float sum rounds up to top_p x total must not take it out, whether the batch tests
    # every row (two flat rows besides: two thirds doubtful) or copies the doubtful ones (alone).
    heavy = F.pad(torch.tensor([[0.6, 0.15, 0.1, 0.05, 0.05, 0.05]]), (0, 14)).log()
    batch = torch.cat((heavy, torch.zeros(2, 20)))  # flat: every pick holds 0.05, all doubtful
    uniform = torch.full((3, draws_per_row(0.9)), 0.99, dtype=torch.float64)
    uniform[:, 0], uniform[:, -1] = 0.65, 0.0  # token 1 first; the sorted fallback would give token 0
    monkeypatch.setattr(token_draw, "_mass_ahead", lambda weights, picks: weights.sum(dim=-1))  # refuse all
    assert sample_tokens(batch, top_p=0.9, uniform=uniform)[0] == 1
    assert sample_tokens(heavy, top_p=0.9, uniform=uniform[:1])[0] == 1


@pytest.mark.parametrize("top_p", [0.5, 0.9, None])
def test_each_row_draws_the_same_token_in_any_batch_and_with_its_buffer_overwritten(top_p: float | None) -> None:
    # Rows of every kind (confident, flat, cut by -inf) in one batch, alone, and with `overwrite`:
    # whether the nucleus test runs on all rows or a copy of some, each row's arithmetic is its own.
    logits = bfloat16_logits(48, 300, seed=8)
    logits[:16, 7] += 12  # confident rows, whose picks need no test
    logits[40:, ::2] = -math.inf
    uniform = torch.rand(48, draws_per_row(top_p), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    batch = sample_tokens(logits, top_p=top_p, uniform=uniform)
    alone = [int(sample_tokens(logits[i : i + 1], top_p=top_p, uniform=uniform[i : i + 1])) for i in range(48)]
    assert batch.tolist() == alone
    for subset in (slice(0, 16), slice(8, 48)):  # mostly confident rows, then mostly doubtful ones
        assert sample_tokens(logits[subset], top_p=top_p, uniform=uniform[subset]).tolist() == alone[subset]
    buffer = logits.clone()
    assert torch.equal(sample_tokens(buffer, top_p=top_p, uniform=uniform, overwrite=True), batch)
    assert not torch.equal(buffer, logits)  # the weights were made in it


def test_overwriting_draws_leave_logits_they_cannot_reuse_alone_and_rank_by_the_untempered_model() -> None:
    logits = bfloat16_logits(6, 130)
    uniform = torch.rand(6, draws_per_row(0.9), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    expected = sample_tokens(logits, top_p=0.9, uniform=uniform)
    for other in (logits.bfloat16(), torch.cat((logits, logits), dim=1)[:, :130]):  # another dtype, strided
        before = other.clone()
        assert torch.equal(sample_tokens(other, top_p=0.9, uniform=uniform, overwrite=True), expected)
        assert torch.equal(other, before)
    buffer = logits.clone()
    options: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9, "uniform": uniform}
    tokens, probabilities = sample_with_probabilities(buffer, overwrite=True, **options)
    assert torch.equal(tokens, sample_tokens(logits, **options))
    assert torch.allclose(probabilities, logits.softmax(dim=-1))  # the model's own, before the buffer was reused


@pytest.mark.parametrize("vocab", [300, 320])  # a ragged last block of 64, and none
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, None, 0.9), (1.0, None, None), (0.7, 40, 0.8), (1.3, None, 0.5)]
)
def test_a_draw_split_into_parts_of_rows_gives_the_tokens_and_probabilities_of_one_whole_pass(
    monkeypatch: pytest.MonkeyPatch, vocab: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    # On a CPU the draw goes through its rows a few at a time (the cache holds them); each row's
    # arithmetic is its own, so the split changes nothing: not the tokens, nor the probabilities.
    logits = bfloat16_logits(45, vocab, seed=9)
    logits[:9, 3] += 12  # confident rows, whose picks need no test
    logits[30:, ::2] = -math.inf
    logits = logits.bfloat16().float()  # 12 more is not always a bfloat16: the widened copy below must be exact
    uniform = torch.rand(45, draws_per_row(top_p), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    options: dict[str, Any] = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "uniform": uniform}
    whole = sample_with_probabilities(logits, **options)
    monkeypatch.setattr(token_draw, "_CACHED_BYTES", 4 * vocab * 4)  # 4 rows of float32 weights a part
    assert len(token_draw._row_parts(logits.shape, 4, logits.device)) == 12  # 45 rows: 12 parts of 3 or 4
    for source in (logits, logits.bfloat16(), logits.clone()):  # widened a part at a time; overwritten
        tokens, probabilities = sample_with_probabilities(source, overwrite=source is not logits, **options)
        assert torch.equal(tokens, whole[0]) and torch.equal(probabilities, whole[1])


def test_rows_are_split_into_nearly_equal_parts_within_the_cached_bytes_on_a_cpu_only() -> None:
    cpu, size = torch.device("cpu"), torch.Size((130, 8192))
    parts = token_draw._row_parts(size, 4, cpu)  # 130 rows of 32 KiB: 9 parts of 14 or 15 rows
    assert [part.stop - part.start for part in parts] == [14, 14, 15, 14, 15, 14, 15, 14, 15]
    assert parts[0].start == 0 and parts[-1].stop == 130
    assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
    assert token_draw._row_parts(torch.Size((32, 8192)), 4, cpu) == [slice(0, 32)]  # 1 MiB: one part is cheaper
    assert token_draw._row_parts(torch.Size((3, 1 << 20)), 4, cpu) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    assert token_draw._row_parts(size, 4, torch.device("meta")) == [slice(0, 130)]  # another device: whole


if __name__ == "__main__":
    THRESHOLD_EXPECTATION.write_text(json.dumps(threshold_tokens()) + "\n")
