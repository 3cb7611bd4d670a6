"""`dlm.evaluation.scoring`: conditional likelihoods, rolling windows and generation from token ids (what the
lm-evaluation-harness adapter serves), on a tiny random model."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer

from dlm.config.schema import ModelConfig
from dlm.data.tokenizer import load_tokenizer
from dlm.errors import UserError
from dlm.evaluation.scoring import Scorer, rolling_windows
from dlm.model.transformer import DiffusionTransformer
from dlm.sampling.dispatch import denoise
from dlm.sampling.options import SamplingOptions

MASK_ID, LENGTH = 1, 32


def tiny_model(block_size: int = 0) -> DiffusionTransformer:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=512,
        mask_token_id=MASK_ID,
        max_seq_len=LENGTH,
        d_model=32,
        n_layers=2,
        n_heads=4,
        pad_vocab_multiple=64,
        block_size=block_size,
    )
    return DiffusionTransformer(config).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_path) -> Tokenizer:  # type: ignore[no-untyped-def]
    return load_tokenizer(tiny_tokenizer_path)


def ids(count: int, start: int = 10) -> list[int]:
    return [start + (7 * i) % 300 for i in range(count)]


@pytest.mark.parametrize("total", [0, 1, 31, 32, 33, 70])
def test_rolling_windows_score_every_token_once_within_the_model_length(total: int) -> None:
    tokens = ids(total)
    windows = rolling_windows(tokens, 0, LENGTH)
    assert [token for _, scored in windows for token in scored] == tokens
    assert all(len(context) + len(scored) <= LENGTH and context for context, scored in windows)
    if windows:
        assert windows[0][0] == [0]  # the first window follows an end of document
    for context, scored in windows[1:]:  # each later one follows the text just before it
        end = tokens.index(scored[0]) if len(set(tokens)) == len(tokens) else None
        assert end is None or context == tokens[end - len(context) : end]
    if len(windows) > 1:
        assert len(windows[-1][0]) + len(windows[-1][1]) == LENGTH  # the last one has all the context that fits


@pytest.mark.parametrize("estimator", ["exact-count", "bernoulli"])
def test_scores_do_not_depend_on_batch_size_order_or_neighbours(tokenizer: Tokenizer, estimator: str) -> None:
    model = tiny_model()
    requests = [(ids(5), ids(3, 40)), (ids(6), ids(2, 50)), (ids(4), ids(4, 60)), (ids(5), ids(3, 70))]
    one = Scorer(model, tokenizer, mc_samples=4, batch_size=1, estimator=estimator).loglikelihood(requests)
    many = Scorer(model, tokenizer, mc_samples=4, batch_size=8, estimator=estimator).loglikelihood(requests[::-1])
    many = many[::-1]
    alone = Scorer(model, tokenizer, mc_samples=4, batch_size=8, estimator=estimator).loglikelihood(requests[2:3])
    for a, b in zip(one, many, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.is_greedy == b.is_greedy
        assert a.tokens == b.tokens
    assert alone[0].logprob == pytest.approx(one[2].logprob, abs=1e-5)
    assert all(score.logprob < 0 and score.stderr is not None for score in one)


@pytest.mark.parametrize("estimator", ["exact-count", "bernoulli"])
def test_a_long_context_loses_its_oldest_tokens(tokenizer: Tokenizer, estimator: str) -> None:
    scorer = Scorer(tiny_model(), tokenizer, mc_samples=3, estimator=estimator)
    continuation = ids(4, 90)
    long, kept = ids(60), ids(60)[-(LENGTH - 4) :]
    [truncated], [same] = scorer.loglikelihood([(long, continuation)]), scorer.loglikelihood([(kept, continuation)])
    assert truncated == same and truncated.tokens == 4
    with pytest.raises(UserError, match="does not fit the model's 32 positions"):
        scorer.loglikelihood([([], ids(LENGTH + 1))])


def greedy_continuation(model: DiffusionTransformer, context: list[int], count: int) -> list[int]:
    """What dlm's sampler writes after `context` at temperature 0, one token per step, confidence order."""

    tokens = torch.tensor([context + [MASK_ID] * count])
    fill = torch.tensor([False] * len(context) + [True] * count)
    options = SamplingOptions(steps=count, temperature=0.0, top_p=None, remasking="confidence")
    with torch.inference_mode():
        written, _ = denoise(model, tokens, fill, options, generator=torch.Generator(), forbidden_token_ids=[2])
    return written[0, len(context) :].tolist()


@pytest.mark.parametrize("block_size", [0, 4])
def test_greedy_means_what_the_greedy_sampler_writes(tokenizer: Tokenizer, block_size: int) -> None:
    model = tiny_model(block_size)
    # Contexts of two lengths (rows of one length share a reverse process), continuations of 3 to 6 tokens.
    requests = [
        (ids(length, start), count)
        for length, start, count in (
            (8, 10, 3),
            (8, 150, 3),
            (8, 60, 4),
            (8, 110, 6),
            (12, 20, 5),
            (12, 90, 6),
            (5, 30, 6),
        )
    ]
    written = [(context, greedy_continuation(model, context, count)) for context, count in requests]
    changed = [(context, [(new[0] + 1) % 500 + 3, *new[1:]]) for context, new in written]
    scorer = Scorer(model, tokenizer, mc_samples=1, batch_size=4)
    assert [score.is_greedy for score in scorer.loglikelihood(written)] == [True] * len(written)
    assert [score.is_greedy for score in scorer.loglikelihood(changed)] == [False] * len(changed)
    assert scorer.rolling([ids(40)]) and scorer.loglikelihood(written[:1], greedy=False)[0].is_greedy is None


def test_block_models_are_scored_block_by_block(tokenizer: Tokenizer) -> None:
    scorer = Scorer(tiny_model(block_size=1), tokenizer, mc_samples=3)
    model, context, continuation = scorer.model, ids(6), ids(3, 80)
    # Block size 1 is autoregressive: the bound is the exact log-likelihood, with no Monte Carlo noise.
    [score] = scorer.loglikelihood([(context, continuation)])
    total, sequence = 0.0, context + continuation
    with torch.no_grad():
        for i in range(len(context), len(sequence)):
            prefix = torch.tensor([sequence[: i + 1]])
            prefix[0, i] = MASK_ID
            total += float(model(prefix)[0, i].double().log_softmax(-1)[sequence[i]])
    assert score.logprob == pytest.approx(total, abs=1e-4) and score.stderr == 0.0


def exact_conditional_elbo(model: DiffusionTransformer, ids: list[int], start: int) -> float:
    """The negative ELBO of ids[start:] given ids[:start], summed, by enumerating every mask: each
    block's n scored positions, each subset S of them masked with weight 1 / (|S| x C(n, |S|)) (the
    continuous-time bound, exact-count form), the earlier blocks clean (the model's BD3 pass)."""

    clean, size, total = torch.tensor([ids]), model.config.block_size, 0.0
    for first in range(0, len(ids), size):
        scored = [i for i in range(first, min(first + size, len(ids))) if i >= start]
        n = len(scored)
        for subset in (s for k in range(1, n + 1) for s in itertools.combinations(scored, k)):
            mask = torch.zeros_like(clean, dtype=torch.bool)
            mask[0, list(subset)] = True
            with torch.no_grad():
                logits = model(clean.masked_fill(mask, MASK_ID), output_positions=mask, clean_tokens=clean)
            ce = float(torch.nn.functional.cross_entropy(logits.double(), clean[mask], reduction="sum"))
            total += ce / (len(subset) * math.comb(n, len(subset)))
    return total


@pytest.mark.parametrize("seed", [0, 1])
def test_a_row_that_is_not_whole_blocks_is_scored_as_its_exact_elbo(tokenizer: Tokenizer, seed: int) -> None:
    # Block size 4, a 5-token row: blocks [0, 4) and [4, 5). The last block is short, and its
    # tokens must not lend their weight to the first block's (as blocks of ceil(5 / 2) = 3 would).
    model = tiny_model(block_size=4).double()
    ids = [int(i) for i in torch.randint(2, 500, (5,), generator=torch.Generator().manual_seed(seed))]
    exact = exact_conditional_elbo(model, ids, 1)
    [score] = Scorer(model, tokenizer, mc_samples=128, seed=seed).loglikelihood([(ids[:1], ids[1:])])
    assert score.stderr is not None and score.tokens == 4
    # The Monte Carlo error of this near-uniform model is ~0.02 nats; misplaced weights cost ~1.5.
    assert abs(score.logprob + exact) < min(0.15, 4 * score.stderr + 0.02)


def test_generation_stops_at_the_first_until_string(tokenizer: Tokenizer) -> None:
    scorer = Scorer(tiny_model(), tokenizer, seed=3)
    options = {"temperature": 1.0, "top_p": None, "remasking": "random"}
    free = scorer.generate(ids(5), max_tokens=12, **options)
    assert free == scorer.generate(ids(5), max_tokens=12, **options)  # seeded by the request
    stop = free[len(free) // 2 : len(free) // 2 + 1]
    cut = scorer.generate(ids(5), max_tokens=12, until=[stop], **options)
    assert cut == free[: free.index(stop)]
    assert scorer.generate(ids(40), max_tokens=100, **options) is not None  # both cut to fit the 32 positions


def test_scorer_options_are_checked(tokenizer: Tokenizer) -> None:
    for options, message in (
        ({"mc_samples": 0}, "mc_samples"),
        ({"estimator": "x"}, "estimator"),
        ({"batch_size": 0}, "batch_size"),
    ):
        with pytest.raises(UserError, match=message):
            Scorer(tiny_model(), tokenizer, **options)  # type: ignore[arg-type]


def test_without_lm_eval_the_harness_names_the_extra() -> None:
    # lm_eval blocked as if it were not installed, in a fresh interpreter.
    code = (
        "import runpy, sys; sys.modules['lm_eval'] = None; "
        "runpy.run_module('dlm.harness', run_name='__main__', alter_sys=True)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "error: evaluating with lm-evaluation-harness needs lm_eval, which is not installed "
        "(pip install 'dlm[lm-eval]')"
    )
    imported = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['lm_eval'] = None; import dlm.harness"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert imported.returncode == 1 and "pip install 'dlm[lm-eval]'" in imported.stderr
