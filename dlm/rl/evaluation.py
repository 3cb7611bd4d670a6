"""Accuracy on prompts with a verifiable reward (`dlm eval MODEL --prompts FILE --reward R`).

Each prompt is sampled `samples` times (its stream seeded by (seed, prompt index) alone, so a model
is always asked the same way, whatever the batch) and each completion scored by the rewards. A
completion is correct when the first reward is positive. pass@k is the unbiased estimate of the
chance that at least one of k samples is correct (1 - C(n - c, k) / C(n, k) for c correct of n,
averaged over prompts), with its standard error over the prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlm.artifacts.loading import load_model_with_info
from dlm.config.rl import RewardSpec
from dlm.diffusion.objective import noise_seed
from dlm.errors import UserError
from dlm.model.denoiser import Denoiser, block_size
from dlm.rl.prompts import PromptSet, completion_length, read_prompts
from dlm.rl.rewards import BoundReward, bind_rewards, check_records, score
from dlm.rl.rollouts import sample_rollouts


@dataclass(frozen=True)
class PromptEvaluation:
    prompts: int
    samples: int
    pass_at: dict[int, float]  # k -> the mean over prompts of the pass@k estimate
    stderr: dict[int, float]  # k -> its standard error over prompts
    mean_reward: float
    examples: list[dict[str, Any]] = field(default_factory=list)  # the first completions, for people

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "samples": self.samples,
            "pass_at": {str(k): v for k, v in self.pass_at.items()},
            "stderr": {str(k): v for k, v in self.stderr.items()},
            "mean_reward": self.mean_reward,
            "examples": self.examples,
        }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased chance that some of k of the n samples (c of them correct) is correct."""

    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    variance = sum((value - mean) ** 2 for value in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def evaluate_prompts(
    model: Denoiser,
    tokenizer: Any,
    prompts: PromptSet,
    rewards: Sequence[BoundReward],
    *,
    samples: int,
    length: int,
    seed: int,
    batch_size: int,
    options: dict[str, Any],
    ks: Sequence[int] = (1,),
    examples: int = 3,
    progress: Any = None,
) -> PromptEvaluation:
    """pass@k for each k of `ks` (at most `samples`) of `model` on `prompts`, `batch_size` prompts per
    sampler call; `options` go to the sampler. `progress(done, total)` after each batch."""

    correct_counts: list[int] = []
    shown: list[dict[str, Any]] = []
    reward_sum = 0.0
    total = len(prompts)
    for start in range(0, total, batch_size):
        indices = list(range(start, min(start + batch_size, total)))
        rollouts = sample_rollouts(
            model,
            tokenizer,
            prompts,
            indices,
            group_size=samples,
            length=length,
            seeds=[noise_seed(seed, index) for index in indices],
            options=options,
        )
        for slot, index in enumerate(indices):
            record, where = prompts.records[index], f"prompt {index + 1} of {prompts.path}"
            correct = 0
            for reply in rollouts.replies[slot * samples : (slot + 1) * samples]:
                values = score(rewards, reply, record, where)
                reward_sum += sum(value * reward.weight for value, reward in zip(values, rewards, strict=True))
                correct += values[0] > 0
                if len(shown) < examples:
                    shown.append({"prompt": prompts.texts[index], "completion": reply, "correct": values[0] > 0})
            correct_counts.append(correct)
        if progress is not None:
            progress(indices[-1] + 1, total)
    pass_at, stderr = {}, {}
    for k in sorted({k for k in ks if 1 <= k <= samples}):
        pass_at[k], stderr[k] = _mean_and_stderr([pass_at_k(samples, c, k) for c in correct_counts])
    return PromptEvaluation(total, samples, pass_at, stderr, reward_sum / (total * samples), shown)


def evaluate_model(
    source: str | Path,
    prompts: str | Path,
    *,
    rewards: Sequence[str] = ("exact_match",),
    samples: int = 1,
    ks: Sequence[int] = (1,),
    limit: int | None = None,
    steps: int | None = None,
    temperature: float = 1.0,
    top_p: float | None = None,
    completion_tokens: int | None = None,
    seed: int = 0,
    batch_size: int = 64,
    device: str = "cpu",
    progress: Any = None,
) -> PromptEvaluation:
    """`evaluate_prompts` on the model at `source` (an export, checkpoint or run) and the first `limit`
    prompts of the JSONL file `prompts`, each reward a registered name or `module:function`."""

    if samples < max(ks):
        raise UserError(f"pass@{max(ks)} needs at least {max(ks)} samples per prompt", fix=f"pass --samples {max(ks)}")
    bound = bind_rewards([RewardSpec(name=name) for name in rewards], where="--reward")
    loaded = load_model_with_info(source, device=device)
    prompt_set = read_prompts(prompts, loaded.tokenizer, loaded.info.tokenizer_path, limit)
    check_records(bound, prompt_set.records, str(prompt_set.path))
    config = loaded.model.config
    length = completion_length(prompt_set, config.max_seq_len, completion_tokens, slides=bool(block_size(config)))
    options = {"steps": steps, "temperature": temperature, "top_p": top_p}
    return evaluate_prompts(
        loaded.model,
        loaded.tokenizer,
        prompt_set,
        bound,
        samples=samples,
        length=length,
        seed=seed,
        batch_size=batch_size,
        options=options,
        ks=ks,
        progress=progress,
    )
