"""`[rl]`: reinforcement learning with verifiable rewards (`dlm rl`), GRPO with a diffusion likelihood.

Each RL step samples `group_size` completions for each of `prompts_per_step` prompts with dlm's own
sampler, scores them with the configured rewards, normalises the rewards within each prompt's group
(the advantages) and takes `inner_updates` optimizer steps on GRPO's clipped objective, the policy's
log-likelihood estimated by `estimator` (`dlm.diffusion.policy_likelihood`). The config stays torch-free;
the objective is `dlm.rl.objective`, the step `dlm.rl.step`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dlm.config.rules import FieldProblem


class RewardSpec(BaseModel):
    """One reward term: a registered name (`dlm.rl.rewards`) or `module:function`, its weight and options."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        description="exact_match (the extracted answer equals the prompt's field), regex (the completion matches "
        "a pattern), length_penalty (minus the share of the completion's characters beyond a length), or a "
        "function of your own as `module:function` (see docs/rl.md for its signature)."
    )
    weight: float = Field(1.0, description="The term's weight in the total reward.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of the reward (each built-in's are in docs/rl.md)."
    )


class RLConfig(BaseModel):
    """GRPO on verifiable rewards (`dlm rl`): `training.max_steps` counts RL steps, each one batch of
    rollouts and its `inner_updates` optimizer steps."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    prompts: Path = Field(
        description="JSONL of prompts: `prompt` (a user turn) or `messages` (a conversation up to the reply), "
        "plus the fields the rewards read (e.g. `answer`). Rendered with the chat template as `dlm pack --chat` does."
    )
    heldout: Path | None = Field(
        None, description="JSONL of evaluation prompts in the same form: their accuracy is measured at eval_interval."
    )
    heldout_prompts: int = Field(
        200, ge=1, description="How many held-out prompts each evaluation samples (the first N)."
    )
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="exact_match")],
        min_length=1,
        description="The reward terms, summed with their weights. The first is the accuracy reported (a rollout "
        "is correct when it is positive).",
    )
    group_size: int = Field(8, ge=2, description="Completions sampled per prompt (GRPO's G).")
    prompts_per_step: int = Field(16, ge=1, description="Prompts per RL step, over all processes.")
    inner_updates: int = Field(
        1,
        ge=1,
        le=16,
        description="Optimizer steps on each batch of rollouts (GRPO's mu); above 1 the ratio is clipped.",
    )
    clip_epsilon: float = Field(0.2, gt=0, le=1, description="The ratio's clip range 1 +- epsilon.")
    kl_weight: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL to the reference (the starting model; LoRA: the base without adapters).",
    )
    estimator: str = Field(
        "coupled",
        description="How the policy's log-likelihood is estimated, a name registered in "
        "`dlm/diffusion/policy_likelihood.py`: one-step (diffu-GRPO), coupled (complementary masks, coupled-GRPO), "
        "elbo (an exact-count ELBO of estimator_samples draws) or exact (block_size = 1 models).",
    )
    estimator_samples: int = Field(
        1,
        ge=1,
        le=64,
        description="Independent draws averaged per estimate: one forward pass each (coupled: a pair of passes).",
    )
    prompt_mask_probability: float = Field(
        0.15,
        ge=0,
        lt=1,
        description="one-step: the chance of masking each prompt token (diffu-GRPO's random prompt masking).",
    )
    completion_length: int | None = Field(
        None,
        ge=1,
        description="Tokens sampled per completion; none fills the model's context after the longest prompt (the "
        "layout of `dlm pack --chat` blocks).",
    )
    sampling_steps: int | None = Field(
        None, ge=1, description="Sampler steps per rollout; none takes the model's default (`dlm sample`'s)."
    )
    temperature: float = Field(1.0, gt=0, description="Rollout sampling temperature.")
    top_p: float | None = Field(None, gt=0, le=1, description="Rollout nucleus; none samples the full distribution.")
    remasking: str = Field("random", description="The sampler's remasking strategy (`dlm sample --remasking`).")
    block_length: int | None = Field(None, ge=1, description="Semi-autoregressive block length of the sampler.")
    advantage_scale: Literal["std", "none"] = Field(
        "std",
        description="std divides each group's centred rewards by their standard deviation (GRPO); none keeps them.",
    )

    @model_validator(mode="after")
    def _check_estimator(self) -> RLConfig:
        from dlm.diffusion.policy_likelihood import estimator_names  # lazy: it imports torch, dlm.config does not

        if self.estimator not in estimator_names():
            raise FieldProblem(
                "estimator",
                f"{self.estimator!r} is not a registered estimator",
                f"use one of: {', '.join(estimator_names())}",
            )
        return self
