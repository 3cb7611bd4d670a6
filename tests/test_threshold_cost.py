"""Threshold decoding's sampling cost: the cheaper top-p cut equals the sorted one, tokens unchanged.

`THRESHOLD_EXPECTATION` holds token ids that threshold decoding produced before its top-p cut
stopped sorting with indices (regenerate only for a deliberate change: `python
tests/test_threshold_cost.py`). The model runs in float64, so the recorded tokens hold on CPUs with
and without AVX-512 (no choice along the way is a tie within float64 rounding).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dlm.config.schema import ModelConfig
from dlm.model.transformer import DiffusionTransformer
from dlm.sampling.dispatch import denoise
from dlm.sampling.options import SamplingOptions
from dlm.sampling.tokens import _nucleus_cut, _sorted_drop, filter_logits, sample_tokens

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


def rows_with_ties() -> torch.Tensor:
    """Logits with exact ties (and -inf) everywhere, so that some rows tie at the nucleus cut."""

    generator = torch.Generator().manual_seed(1)
    logits = torch.randint(-4, 4, (64, 40), generator=generator).double() / 2
    logits[:, :5] = float("-inf")
    return logits


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.9, 0.999])
def test_nucleus_cut_equals_the_sorted_cut(top_p: float) -> None:
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(32, 2048, dtype=torch.float64, generator=generator) * torch.linspace(0.1, 8, 32)[:, None]
    fast = _nucleus_cut(spread, top_p)
    assert fast is not None  # distinct values: no tie at the cut, the fast path decides
    assert torch.equal(fast, _sorted_drop(spread, top_p))
    assert 0 < int(fast.sum()) < fast.numel()
    ties = rows_with_ties()
    tied_fast = _nucleus_cut(ties, top_p)
    assert tied_fast is not None and torch.equal(tied_fast, _sorted_drop(ties, top_p))
    assert torch.equal(filter_logits(ties, top_p=top_p), ties.masked_fill(_sorted_drop(ties, top_p), -math.inf))


def test_a_tie_at_the_cut_keeps_the_lowest_ids_on_the_fast_path() -> None:
    # Sorted probabilities 0.25 each: 0.75 is reached before the fourth, which ties with the third.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, -math.inf]], dtype=torch.float64)
    fast = _nucleus_cut(logits, 0.6)
    assert fast is not None and fast.tolist() == [[False, False, False, True, True]]
    assert torch.equal(fast, _sorted_drop(logits, 0.6))
    shuffled = torch.tensor([[-1.0, 0.0, 2.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    # 2.0 is kept, then two of the four tokens tied at 0.0 fill the nucleus: ids 1 and 3, not 4 and 5.
    probabilities = shuffled.softmax(dim=-1)[0]
    top_p = float(probabilities[2] + 1.5 * probabilities[1])
    assert _nucleus_cut(shuffled, top_p).tolist() == [[True, False, False, False, True, True]]
    assert torch.equal(_nucleus_cut(shuffled, top_p), _sorted_drop(shuffled, top_p))
    # Without the tie the fast path decides: probabilities 0.64, 0.24, 0.09, 0.03 keep two for 0.7.
    distinct = torch.tensor([[3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    assert torch.equal(_nucleus_cut(distinct, 0.7), torch.tensor([[False, False, True, True]]))


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.9, 0.95])
def test_bfloat16_valued_logits_take_the_fast_path_and_equal_the_stable_sort(top_p: float) -> None:
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 2048, generator=generator) * 2).bfloat16().double()
    fast = _nucleus_cut(logits, top_p)
    assert fast is not None
    assert torch.equal(fast, _sorted_drop(logits, top_p))


def test_rows_without_a_distribution_keep_every_token_as_before() -> None:
    logits = torch.tensor([[0.0, math.nan, 1.0], [math.inf, 0.0, 1.0], [2.0, 1.0, 0.0]], dtype=torch.float64)
    fast = _nucleus_cut(logits, 0.5)
    assert fast is not None and torch.equal(fast, _sorted_drop(logits, 0.5))
    assert fast.tolist() == [[False, False, False], [False, False, False], [False, True, True]]


def test_sampling_draws_the_same_tokens_as_the_out_of_place_gumbel() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 512, dtype=torch.float64, generator=generator) * 3
    uniform = torch.rand(logits.shape, dtype=torch.float64, generator=generator)
    before = uniform.clone()
    for temperature in (1.0, 0.7):
        filtered = filter_logits(logits / temperature, top_p=0.9)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float64).tiny)))
        expected = (filtered + gumbel).argmax(dim=-1)
        assert torch.equal(sample_tokens(logits, temperature=temperature, top_p=0.9, uniform=uniform), expected)
    assert torch.equal(uniform, before)  # the caller's draws are left as they were


if __name__ == "__main__":
    THRESHOLD_EXPECTATION.write_text(json.dumps(threshold_tokens()) + "\n")
