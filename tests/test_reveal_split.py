"""How a block's fixed-count steps share its positions: the noise schedule's split or LLaDA's even one."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import test_sampling
import torch
from test_sampling import MASK, random_model, recorded_generate
from tokenizers import Tokenizer
from typer.testing import CliRunner

from dlm.cli import app
from dlm.config.schema import ModelConfig
from dlm.diffusion.schedules import get_schedule
from dlm.errors import UserError
from dlm.model.transformer import DiffusionTransformer
from dlm.sampling.generation import generate
from dlm.sampling.options import SamplingOptions
from dlm.sampling.reverse import masked_after, reveal_count

tokenizer = pytest.fixture(scope="module")(test_sampling.tokenizer.__wrapped__)  # the sampler tests' tokenizer
fake_export = pytest.fixture()(test_sampling.fake_export.__wrapped__)


def llada_split(n: int, steps: int) -> list[int]:
    """LLaDA's `get_num_transfer_tokens` for one block: n // steps each, the first n % steps one more."""

    counts = [n // steps] * steps
    for step in range(n % steps):
        counts[step] += 1
    return counts


def test_the_two_splits_of_six_positions_in_four_steps() -> None:
    assert [reveal_count(6, 4, step) for step in range(4)] == [2, 1, 2, 1]  # floor(6 m(t)): 6, 4, 3, 1, 0
    assert [reveal_count(6, 4, step, split="even") for step in range(4)] == [2, 2, 1, 1]


def test_the_even_split_is_llada_s_and_every_split_reveals_the_block() -> None:
    cosine = get_schedule("cosine")
    differ = 0
    for n in range(1, 33):
        for steps in range(1, 41):
            even = [reveal_count(n, steps, step, split="even") for step in range(steps)]
            assert even == llada_split(n, steps)
            for schedule in (None, cosine):
                split = [reveal_count(n, steps, step, *([schedule] if schedule else [])) for step in range(steps)]
                assert sum(split) == n and min(split) >= 0
            assert sum(even) == n and min(even) >= 0
            schedule_split = [reveal_count(n, steps, step) for step in range(steps)]
            differ += steps <= n and schedule_split != even
            for name, counts in (("even", even), ("schedule", schedule_split)):
                left = [masked_after(n, steps, step, split=name) for step in range(steps)]  # type: ignore[arg-type]
                assert left == [n - done for done in itertools.accumulate(counts)]
    assert differ == 284  # of the 528 pairs with steps <= n <= 32


def recorded_counts(tokenizer: Tokenizer, **options: Any) -> list[int]:
    history, result = recorded_generate(random_model(tokenizer), tokenizer, 6, steps=4, seed=1, **options)
    assert MASK not in result.token_ids[0]
    return [int(((before == MASK) & (after != MASK)).sum()) for before, after in itertools.pairwise(history)]


@pytest.mark.parametrize("remasking", ["confidence", "margin"])
def test_sampling_reveals_by_the_chosen_split(tokenizer: Tokenizer, remasking: str) -> None:
    assert recorded_counts(tokenizer, remasking=remasking) == [2, 1, 2, 1]
    assert recorded_counts(tokenizer, remasking=remasking, reveal_split="schedule") == [2, 1, 2, 1]
    assert recorded_counts(tokenizer, remasking=remasking, reveal_split="even") == [2, 2, 1, 1]


def test_a_threshold_keeps_the_chosen_split_as_its_minimum(tokenizer: Tokenizer) -> None:
    # A random table is never 0.99 sure: every step commits exactly its minimum.
    assert recorded_counts(tokenizer, threshold=0.99) == [2, 1, 2, 1]
    assert recorded_counts(tokenizer, threshold=0.99, reveal_split="even") == [2, 2, 1, 1]


def test_a_block_model_reveals_by_the_chosen_split(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    import dlm.sampling.reverse

    config = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        max_seq_len=32,
        d_model=32,
        n_layers=2,
        n_heads=2,
        pad_vocab_multiple=64,
        block_size=8,
    )
    torch.manual_seed(0)
    model = DiffusionTransformer(config)
    counts: list[int] = []
    real = dlm.sampling.reverse.reveal_count  # every strategy's steps run through reverse_step
    monkeypatch.setattr(dlm.sampling.reverse, "reveal_count", lambda *a: counts.append(real(*a)) or counts[-1])
    for split, expected in (("schedule", [2, 1, 2, 1] * 2), ("even", [2, 2, 1, 1] * 2)):
        counts.clear()
        result = generate(
            model, tokenizer, length=12, prompt="ROMEO:", steps=8, remasking="confidence", reveal_split=split
        )
        # "ROMEO:" is 2 tokens: the generated positions fill 6 of the first block and 6 of the second.
        assert counts == expected and MASK not in result.token_ids[0]


def test_ancestral_steps_refuse_the_even_split() -> None:
    with pytest.raises(UserError, match="--reveal-split even") as error:
        SamplingOptions(reveal_split="even")
    assert "--remasking confidence" in (error.value.fix or "")
    with pytest.raises(UserError, match="--reveal-split must be one of schedule, even"):
        SamplingOptions(remasking="confidence", reveal_split="llada")  # type: ignore[arg-type]
    SamplingOptions(reveal_split="even", threshold=0.9)  # a threshold's minimum counts follow it


def test_cli_reveal_split(fake_export: list[object], tokenizer: Tokenizer, run_cli: Any) -> None:
    args = ["sample", "m", "--length", "6", "--steps", "4", "--seed", "2", "--remasking", "confidence", "--json"]
    result = CliRunner().invoke(app, [*args, "--reveal-split", "even"])
    assert result.exit_code == 0, result.output
    expected = generate(
        random_model(tokenizer), tokenizer, length=6, steps=4, seed=2, remasking="confidence", reveal_split="even"
    )
    assert json.loads(result.output)["token_ids"] == expected.token_ids
    refused = ("--reveal-split even", "--remasking random")
    run_cli("sample", "m", "--remasking", "random", "--reveal-split", "even").assert_refused(*refused)
    assert len(fake_export) == 1  # refused before loading the model
    # Without --remasking the order is the model's own, which only the loaded model knows (a student's
    # may be planned): refused once it is loaded, as this one samples in ancestral steps.
    run_cli("sample", "m", "--reveal-split", "even").assert_refused(*refused)
    assert len(fake_export) == 2


def test_the_scorer_takes_the_split(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    import dlm.sampling.dispatch
    from dlm.evaluation.scoring import Scorer

    seen: list[SamplingOptions] = []
    real = dlm.sampling.dispatch.denoise
    monkeypatch.setattr(dlm.sampling.dispatch, "denoise", lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    config = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(), max_seq_len=32, d_model=32, n_layers=2, n_heads=2, pad_vocab_multiple=64
    )
    scorer = Scorer(DiffusionTransformer(config).eval(), tokenizer)
    scorer.generate([5, 6], max_tokens=6, steps=4, remasking="confidence", reveal_split="even")
    assert seen[0].reveal_split == "even"


@pytest.mark.lm_eval_extra
def test_the_harness_takes_the_split(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[lm-eval]')")
    from lm_eval.api.instance import Instance

    import dlm.artifacts.loading
    from dlm.harness import DlmLM

    loaded = SimpleNamespace(
        model=random_model(tokenizer),
        tokenizer=tokenizer,
        info=SimpleNamespace(diffusion=SimpleNamespace(mask_eps=1e-3)),
    )
    monkeypatch.setattr(dlm.artifacts.loading, "load_model_with_info", lambda *args, **kwargs: loaded)
    model = DlmLM(pretrained="model", device="cpu", reveal_split="even")
    seen: list[Any] = []

    def reverse(contexts: list[list[int]], count: int, sampling: Any, *, stop: bool) -> torch.Tensor:
        seen.append(sampling)
        return torch.zeros((len(contexts), count), dtype=torch.long)

    monkeypatch.setattr(model.scorer, "_reverse", reverse)
    model.generate_until([Instance("generate_until", {}, ("ROMEO:", {"max_gen_toks": 4}), 0)])
    assert seen[0].reveal_split == "even" and seen[0].remasking == "confidence"
