"""Fast sampling: confidence-threshold decoding, stopping at the end of a document, approximate KV caches.

The exactness tests compare against token ids recorded from the plain sampler
(`data/sampler_expectation.json`, last re-recorded when the token draw became an inverse of the
distribution function), so the default path stays bit-identical for a seed.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import test_sampling
import torch
from test_sampling import MASK, PAD, TableModel, recorded_generate
from tokenizers import Tokenizer
from typer.testing import CliRunner

from dlm.cli import app
from dlm.config.schema import ModelConfig
from dlm.diffusion.schedules import LinearSchedule
from dlm.errors import UserError
from dlm.model.transformer import DiffusionTransformer
from dlm.sampling.dispatch import denoise
from dlm.sampling.fast import _FastReverse, _Window, denoise_fast
from dlm.sampling.generation import generate
from dlm.sampling.options import SamplingOptions
from dlm.sampling.reverse import cut_after_stop

END = 0  # <|endoftext|>

EXPECTATION = Path(__file__).parent / "data" / "sampler_expectation.json"
# Settings of the plain sampler, whose outputs the fast paths must keep.
CASES: dict[str, dict[str, Any]] = {
    "random": {},
    "confidence": {"remasking": "confidence", "steps": 8},
    "margin_blocks": {"remasking": "margin", "block_length": 4, "steps": 8},
    "random_blocks_temperature": {"block_length": 8, "steps": 6, "temperature": 0.7, "top_k": 20},
    "greedy": {"temperature": 0, "remasking": "confidence", "steps": 16},
}
tokenizer = pytest.fixture(scope="module")(test_sampling.tokenizer.__wrapped__)  # the sampler tests' tokenizer
fake_export = pytest.fixture()(test_sampling.fake_export.__wrapped__)


def small_transformer(vocab_size: int, max_seq_len: int = 32, seed: int = 0) -> DiffusionTransformer:
    config = ModelConfig(
        vocab_size=vocab_size, max_seq_len=max_seq_len, d_model=32, n_layers=2, n_heads=2, pad_vocab_multiple=64
    )
    torch.manual_seed(seed)
    return DiffusionTransformer(config)


def run_cases(tokenizer: Tokenizer) -> dict[str, list[list[int]]]:
    model = small_transformer(tokenizer.get_vocab_size())
    base = {"prompt": "ROMEO:", "length": 16, "steps": 16, "num_samples": 2, "seed": 3}
    return {name: generate(model, tokenizer, **(base | case)).token_ids for name, case in CASES.items()}


def test_default_sampler_is_bit_identical_to_before(tokenizer: Tokenizer) -> None:
    assert run_cases(tokenizer) == json.loads(EXPECTATION.read_text())


def test_fast_path_without_threshold_or_cache_equals_the_plain_sampler(tokenizer: Tokenizer) -> None:
    model = small_transformer(tokenizer.get_vocab_size()).eval()
    tokens = torch.tensor([tokenizer.encode("ROMEO:").ids + [MASK] * 16] * 2)
    fill = tokens[0] == MASK
    for case in CASES.values():
        options = SamplingOptions(**{"steps": 16} | case)
        positions = fill.nonzero().squeeze(-1)
        blocks = list(positions.split(options.block_length)) if options.block_length else [positions]
        with torch.inference_mode():
            plain = denoise(model, tokens, fill, options, generator=torch.Generator().manual_seed(3))
            generator = torch.Generator().manual_seed(3)
            fast = denoise_fast(
                model, tokens.clone(), fill, options, blocks, generator=generator, schedule=LinearSchedule()
            )
        assert torch.equal(plain[0], fast[0]) and plain[1] == fast[1]


def end_model(tokenizer: Tokenizer, words: int) -> TableModel:
    """Positions 0 .. words - 1 predict token 10 + j confidently, every later one the end token."""

    table = torch.zeros(32, tokenizer.get_vocab_size())
    table[torch.arange(words), 10 + torch.arange(words)] = 8.0
    table[words:, END] = 8.0
    return TableModel(table)


def test_stop_at_end_cuts_what_sampling_to_the_end_would_cut_and_saves_passes(tokenizer: Tokenizer) -> None:
    model = end_model(tokenizer, 5)
    for remasking in ("random", "confidence"):
        options = {"length": 24, "steps": 24, "num_samples": 2, "seed": 1, "remasking": remasking}
        options["block_length"] = 8
        full = generate(model, tokenizer, **options)
        stopped = generate(model, tokenizer, stop_at_end=True, **options)
        assert stopped.token_ids == cut_after_stop(full.token_ids, [True] * 24, END)
        assert stopped.lengths == [6, 6] and full.lengths == [24, 24]
        assert stopped.forward_passes <= 8 < full.forward_passes


def test_threshold_commits_every_confident_position_and_at_least_one(tokenizer: Tokenizer) -> None:
    # Positions 0-3 are near certain, 4-7 uncertain: one pass commits the four, then one per step.
    model = TableModel(torch.zeros(16, tokenizer.get_vocab_size()))
    model.table.data[torch.arange(4), 10 + torch.arange(4)] = 20.0
    history, result = recorded_generate(model, tokenizer, 8, steps=8, threshold=0.9, temperature=0)
    committed = [int(((before == MASK) & (after != MASK)).sum()) for before, after in itertools.pairwise(history)]
    assert committed == [4, 1, 1, 1, 1] and result.forward_passes == 5
    assert result.token_ids[0][:4] == [10, 11, 12, 13]
    # Few steps: the schedule's count is the floor, so the block still ends within its steps.
    _, few = recorded_generate(model, tokenizer, 8, steps=2, threshold=0.9, temperature=0)
    assert few.forward_passes == 2 and MASK not in few.token_ids[0]


def test_threshold_ranks_by_the_probability_of_the_sampled_token(tokenizer: Tokenizer) -> None:
    # At every position token 10 has probability 0.6 and token 11 0.35: at temperature 1 about four
    # samples in ten are token 11, whose own probability is below the threshold though the top-1 is above.
    table = torch.full((16, tokenizer.get_vocab_size()), math.log(0.05 / (tokenizer.get_vocab_size() - 2)))
    table[:, 10], table[:, 11] = math.log(0.6), math.log(0.35)
    table[:, [MASK, PAD]] = float("-inf")  # never predicted: the probabilities the sampler sees
    probability = table.softmax(dim=-1)[0]
    threshold, length = 0.5, 16
    history, result = recorded_generate(
        TableModel(table), tokenizer, length, steps=length, threshold=threshold, temperature=1.0, top_p=None, seed=0
    )
    assert MASK not in result.token_ids[0]
    for step, (before, after) in enumerate(itertools.pairwise(history)):
        committed = after[0][(before[0] == MASK) & (after[0] != MASK)]
        # Below the threshold only when the schedule forces a count: at least one, and enough that
        # no more than floor(n * (1 - (step + 1) / steps)) stay masked.
        need = max(1, int((before[0] == MASK).sum()) - (length - step - 1))
        low = probability[committed] <= threshold
        assert not bool(low.any()) or len(committed) == need, (step, committed.tolist())
    # The first step commits its token-10 samples only (by top-1 probability it would commit all 16).
    assert 0 < history[1][0].tolist().count(MASK) < length


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cached_pass_on_an_unchanged_sequence_matches_the_full_pass(tokenizer: Tokenizer, mode: str) -> None:
    model = small_transformer(tokenizer.get_vocab_size()).eval()
    tokens = torch.randint(3, 200, (2, 32), generator=torch.Generator().manual_seed(0))
    tokens[:, 12:20] = MASK
    positions = torch.zeros_like(tokens, dtype=torch.bool)
    positions[:, 12:20] = True
    options = SamplingOptions(cache=mode)  # type: ignore[arg-type]
    reverse = _FastReverse(model, options, torch.Generator(), MASK, torch.tensor([MASK]), _Window(12, 20, tokens))
    with torch.inference_mode():
        reference = model(tokens, output_positions=positions)
        first = reverse.logits(tokens, positions, None)  # refreshes the cache
        cached = reverse.logits(tokens, positions, None)
        rows = torch.tensor([False, True])
        one_row = reverse.logits(tokens[rows], positions[rows], rows)
    # Up to float rounding: the refreshing pass runs its last block over the queried columns only, and
    # matmuls of another shape may take other kernels (AVX2-only ones do here), summing in another order.
    torch.testing.assert_close(first, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cached, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one_row, reference[8:], atol=1e-5, rtol=1e-5)


def test_prefix_and_dual_caches_give_valid_tokens_for_less_compute(tokenizer: Tokenizer) -> None:
    model = small_transformer(tokenizer.get_vocab_size())
    options = {"prompt": "ROMEO:", "length": 24, "steps": 24, "num_samples": 2, "block_length": 8}
    fed = {}
    for mode in ("none", "prefix", "dual"):
        result = generate(model, tokenizer, cache=mode, **options)
        assert all(
            MASK not in row and PAD not in row and len(row) == len(result.token_ids[0]) for row in result.token_ids
        )
        fed[mode] = result.forward_tokens
    assert fed["dual"] < fed["prefix"] < fed["none"]
    fast = generate(model, tokenizer, cache="dual", threshold=0.5, **options)
    assert fast.forward_passes <= 24 and MASK not in fast.token_ids[0]


def test_block_model_refuses_the_approximate_cache(tokenizer: Tokenizer) -> None:
    model = small_transformer(tokenizer.get_vocab_size())
    model.config = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        max_seq_len=32,
        d_model=32,
        n_layers=2,
        n_heads=2,
        pad_vocab_multiple=64,
        block_size=4,
    )
    with pytest.raises(UserError, match="block model"):
        generate(model, tokenizer, length=8, steps=8, cache="prefix")


@pytest.mark.parametrize(("options", "name"), [({"threshold": 1.0}, "--threshold"), ({"cache": "full"}, "--cache")])
def test_bad_fast_options_name_the_option(options: dict[str, Any], name: str) -> None:
    with pytest.raises(UserError, match=name):
        SamplingOptions(**options)


def test_cli_sample_threshold_cache_and_stop(fake_export: list[object]) -> None:
    args = ["sample", "m", "--length", "8", "--steps", "8", "--threshold", "0.5", "--cache", "none", "--stop-at-eos"]
    result = CliRunner().invoke(app, [*args, "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["forward_passes"] <= 8 and 1 <= payload["lengths"][0] <= 8 and payload["forward_tokens"] > 0
