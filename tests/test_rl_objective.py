"""GRPO's arithmetic, the likelihood estimators' draws and the rewards, each on hand-made inputs."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

from dlm.config.rl import RewardSpec
from dlm.diffusion.policy_likelihood import get_estimator, score_draws
from dlm.errors import UserError
from dlm.rl.evaluation import pass_at_k
from dlm.rl.objective import clipped_policy_loss, group_advantages
from dlm.rl.rewards import bind_rewards, check_records, score

MASK = 1


def test_equal_rewards_give_zero_advantages_and_others_are_normalised() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    advantages = group_advantages(rewards, 3)
    assert advantages[:3].tolist() == [0.0, 0.0, 0.0]
    # Group (0, 1, 0): mean 1/3, sample std sqrt(1/3).
    std = math.sqrt(1 / 3)
    expected = [(-1 / 3) / (std + 1e-4), (2 / 3) / (std + 1e-4), (-1 / 3) / (std + 1e-4)]
    assert advantages[3:].tolist() == pytest.approx(expected)
    assert group_advantages(rewards, 3, scale=False)[3:].tolist() == pytest.approx([-1 / 3, 2 / 3, -1 / 3])


def test_the_clipped_objective_matches_a_hand_computed_case() -> None:
    # Row 0 (A = +1): entries with ratios e^0.5 (clipped to 1.2) and e^-0.1; row 1 (A = -1): ratio e^-0.5 (clipped
    # to 0.8, which is the minimum of -rho, -0.8 = -0.8) with weight 2.
    new = torch.tensor([0.5, -0.1, -0.5])
    old = torch.zeros(3)
    weights = torch.tensor([1.0, 1.0, 2.0])
    rows = torch.tensor([0, 0, 1])
    advantages = torch.tensor([1.0, -1.0])
    result = clipped_policy_loss(new, old, weights, rows, advantages, 0.2)
    row0 = (min(math.exp(0.5), 1.2) + math.exp(-0.1)) / 2
    row1 = min(-math.exp(-0.5), -0.8)
    assert float(result.loss) == pytest.approx(-(row0 + row1) / 2, rel=1e-6)
    # Clipped: entry 0 (weight 1) and entry 2 (weight 2) of a total weight 4.
    assert float(result.clipped) == pytest.approx(3 / 4)


def test_the_kl_penalty_is_the_k3_estimate() -> None:
    new, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    result = clipped_policy_loss(
        new, new.detach(), torch.ones(2), torch.tensor([0, 0]), torch.zeros(1), 0.2, ref, kl_weight=0.5
    )
    k3 = [math.exp(r - n) - (r - n) - 1 for n, r in zip(new.tolist(), ref.tolist(), strict=True)]
    assert float(result.kl) == pytest.approx(sum(k3) / 2)
    assert float(result.loss) == pytest.approx(0.5 * sum(k3) / 2)


def test_one_inner_update_without_clipping_is_the_plain_policy_gradient() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, requires_grad=True)
    new = torch.log_softmax(logits, 0)[torch.tensor([0, 1, 2, 3, 4])]
    weights = torch.tensor([1.0, 2.0, 1.0, 0.5, 1.0])
    rows = torch.tensor([0, 0, 1, 1, 1])
    advantages = torch.tensor([0.7, -1.3])
    loss = clipped_policy_loss(new, new.detach(), weights, rows, advantages, 0.2).loss
    (grpo,) = torch.autograd.grad(loss, logits, retain_graph=True)
    estimate = torch.zeros(2).index_add(0, rows, new * weights)
    total_weight = torch.zeros(2).index_add(0, rows, weights)
    plain = -(advantages * estimate / total_weight).mean()
    (reference,) = torch.autograd.grad(plain, logits)
    torch.testing.assert_close(grpo, reference, rtol=0, atol=1e-7)


def _generators(seed: int, rows: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 1000 + row) for row in range(rows)]


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 5, 6, 7, 8, 9]])  # row 1 has one padding position
    prompt = torch.tensor([[1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    completion = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    return tokens, prompt, completion


def test_the_coupled_pair_scores_each_completion_token_exactly_once() -> None:
    tokens, prompt, completion = _rows()
    draws = get_estimator("coupled").draw(
        tokens, prompt, completion, MASK, _generators(3, 2), samples=3, prompt_mask_probability=0.0
    )
    assert len(draws) == 6
    for first, second in zip(draws[::2], draws[1::2], strict=True):
        assert torch.equal(first.scored | second.scored, completion)
        assert not (first.scored & second.scored).any()
        for draw in (first, second):  # what is scored is what is hidden, and nothing else
            assert torch.equal(draw.noisy == MASK, draw.scored)
            assert torch.equal(draw.weight, draw.scored.float() / 3)


def test_one_step_hides_the_whole_completion_and_some_prompt_tokens() -> None:
    tokens, prompt, completion = _rows()
    draws = get_estimator("one-step").draw(
        tokens, prompt, completion, MASK, _generators(0, 2), samples=64, prompt_mask_probability=0.5
    )
    hidden_prompt = 0
    for draw in draws:
        assert torch.equal(draw.scored, completion)
        assert torch.equal((draw.noisy == MASK) & ~prompt, completion)
        hidden_prompt += int(((draw.noisy == MASK) & prompt).sum())
    assert 0.35 < hidden_prompt / (64 * int(prompt.sum())) < 0.65


def test_the_elbo_draws_mask_l_of_n_completion_tokens_with_weight_n_over_l() -> None:
    tokens, prompt, completion = _rows()
    draws = get_estimator("elbo").draw(
        tokens, prompt, completion, MASK, _generators(1, 2), samples=2, prompt_mask_probability=0.0
    )
    for draw in draws:
        assert not (draw.scored & ~completion).any()
        for row in range(2):
            count, n = int(draw.scored[row].sum()), int(completion[row].sum())
            assert 1 <= count <= n
            assert draw.weight[row][draw.scored[row]].tolist() == pytest.approx([n / count / 2] * count)


def _tiny_logits(vocab: int = 12) -> torch.nn.Module:
    """A bidirectional toy scorer: logits from a hash of the whole noisy row and the position."""

    class Scorer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(vocab, 8)
            self.position = torch.nn.Embedding(8, 8)
            self.out = torch.nn.Linear(8, vocab)

        def forward(self, noisy: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
            context = self.embed(noisy).mean(dim=1, keepdim=True)
            hidden = torch.tanh(context + self.position(torch.arange(noisy.shape[1]))[None])
            return self.out(hidden)[scored]

    return Scorer()


def test_the_exact_count_elbo_mean_matches_its_enumeration() -> None:
    scorer = _tiny_logits()
    tokens = torch.tensor([[3, 4, 5, 6, 7]])
    prompt = torch.tensor([[1, 1, 0, 0, 0]], dtype=torch.bool)
    completion = ~prompt
    forbidden = torch.tensor([MASK])
    completion_positions = [2, 3, 4]
    n = len(completion_positions)
    # E[ELBO] = mean over l of (n / l) x mean over l-subsets of the sum of their masked log-probabilities.
    expected = 0.0
    with torch.no_grad():
        for count in range(1, n + 1):
            subsets = list(itertools.combinations(completion_positions, count))
            for subset in subsets:
                scored = torch.zeros_like(completion)
                scored[0, list(subset)] = True
                noisy = tokens.masked_fill(scored, MASK)
                logits = scorer(noisy, scored)
                logits[:, MASK] = -torch.inf  # the mask token is never a choice
                log_probs = torch.log_softmax(logits, -1).gather(1, tokens[scored][:, None]).sum()
                expected += float(log_probs) * n / count / len(subsets) / n
        generator = _generators(0, 1)
        estimates = []
        for _ in range(2000):
            draws = get_estimator("elbo").draw(
                tokens, prompt, completion, MASK, generator, samples=1, prompt_mask_probability=0.0
            )
            estimates.append(float(score_draws(scorer, tokens, draws, forbidden).per_sequence(1)[0]))
    mean = sum(estimates) / len(estimates)
    stderr = (sum((e - mean) ** 2 for e in estimates) / (len(estimates) - 1) / len(estimates)) ** 0.5
    assert abs(mean - expected) < 3 * stderr, (mean, expected, stderr)


def test_pass_at_k_is_the_unbiased_estimate() -> None:
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))
    assert pass_at_k(4, 3, 2) == 1.0


def test_built_in_rewards_and_their_checks() -> None:
    rewards = bind_rewards(
        [
            RewardSpec(name="exact_match"),
            RewardSpec(name="regex", options={"pattern": r"^\d+$"}),
            RewardSpec(name="length_penalty", weight=0.5, options={"max_chars": 2}),
        ]
    )
    assert score(rewards, " 42 ", {"answer": "42"}, "p") == [1.0, 0.0, -0.5]
    assert score(rewards, "41", {"answer": 42}, "p") == [0.0, 1.0, 0.0]
    extracting = bind_rewards([RewardSpec(name="exact_match", options={"pattern": r"answer: (\d+)"})])
    assert score(extracting, "answer: 3, no, answer: 4", {"answer": "4"}, "p") == [1.0]
    with pytest.raises(UserError, match="no reward named 'exact'"):
        bind_rewards([RewardSpec(name="exact")])
    with pytest.raises(UserError, match="options do not fit"):
        bind_rewards([RewardSpec(name="regex", options={"patern": "x"})])
    with pytest.raises(UserError, match="not a regular expression"):
        bind_rewards([RewardSpec(name="regex", options={"pattern": "("})])
    with pytest.raises(UserError, match="prompt 2 has no 'answer' field"):
        check_records(rewards, [{"answer": 1}, {"question": 2}], "prompts.jsonl")


def test_a_users_reward_is_imported_and_its_failures_name_the_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def strict(completion, record, *, bonus=0.0):\n"
        "    if completion == 'boom':\n"
        "        raise ValueError('cannot parse')\n"
        "    if completion == 'nan':\n"
        "        return float('nan')\n"
        "    return 1.0 + bonus\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = bind_rewards([RewardSpec(name="my_rewards:strict", options={"bonus": 0.5})])
    assert score(rewards, "7", {}, "prompt 1") == [1.5]
    with pytest.raises(UserError, match=r"raised ValueError: cannot parse on prompt 3 of p\.jsonl"):
        score(rewards, "boom", {}, "prompt 3 of p.jsonl")
    with pytest.raises(UserError, match="returned nan on prompt 4"):
        score(rewards, "nan", {}, "prompt 4")
    with pytest.raises(UserError, match="cannot be imported"):
        bind_rewards([RewardSpec(name="no_such_module_here:f")])
    with pytest.raises(UserError, match="has no function 'missing'"):
        bind_rewards([RewardSpec(name="my_rewards:missing")])
    sys.modules.pop("my_rewards", None)
