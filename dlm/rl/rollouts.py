"""Rollouts: `group_size` completions of each prompt of an RL step, sampled by dlm's own sampler.

The p-th prompt of step s (which prompt that is depends on the seed and s alone) samples its group
from a stream seeded by (seed, s, p), so a step's rollouts do not depend on which other prompts
share its batch, on the number of processes, or on whether the run was resumed: given the same
weights, they are the same tokens (up to the float rounding of another batch shape,
`dlm.sampling.prompt_batch`). Rows are laid out as
the sampler lays out a batch of prompts: left-padded so that every completion takes the last
`length` columns (`dlm.sampling.prompt_batch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dlm.data.chat import reply
from dlm.data.tokenizer import special_token_id
from dlm.diffusion.objective import noise_seed
from dlm.model.denoiser import Denoiser
from dlm.rl.prompts import PromptSet
from dlm.sampling.generation import generate

ROLLOUT_TAG = 0x524C  # keeps rollout seeds apart from every other stream of the run


@dataclass(frozen=True)
class Rollouts:
    """One batch of rollouts: `prompts` x `group_size` rows, the group of each prompt consecutive."""

    prompt_indices: list[int]  # into the prompt set, one per group
    positions: list[int]  # each group's place in its step over all processes (what seeds its scoring draws)
    tokens: Tensor  # [R, W] long: padding, prompt, completion
    pad: Tensor  # [R] long: leading padding positions of each row
    prompt: Tensor  # [R, W] bool: the prompt's positions
    completion: Tensor  # [R, W] bool: the sampled positions
    replies: list[str]  # each row's reply, up to its end-of-document token
    group_size: int


def rollout_seed(seed: int, step: int, position: int) -> int:
    return noise_seed(seed, step, position, ROLLOUT_TAG)


def sample_rollouts(
    model: Denoiser,
    tokenizer: Any,
    prompts: PromptSet,
    indices: Sequence[int],
    *,
    group_size: int,
    length: int,
    seeds: Sequence[int],
    options: dict[str, Any],
    positions: Sequence[int] | None = None,
) -> Rollouts:
    """`group_size` completions of `length` tokens for each prompt `indices[i]`, seeded `seeds[i]`;
    `options` go to `dlm.sampling.generation.generate` (steps, temperature, top_p, remasking, ...);
    `positions` are the groups' places in the whole step (default 0, 1, ...)."""

    texts = [prompts.texts[index] for index in indices]
    result = generate(
        model, tokenizer, prompts=texts, seeds=list(seeds), num_samples=group_size, length=length, **options
    )
    eos = special_token_id(tokenizer, "eos")
    rows = result.token_ids
    width = max(len(row) for row in rows)
    device = next(model.parameters()).device
    tokens = torch.full((len(rows), width), eos, dtype=torch.long)
    pad = torch.tensor([width - len(row) for row in rows], dtype=torch.long)
    for index, row in enumerate(rows):
        tokens[index, width - len(row) :] = torch.tensor(row, dtype=torch.long)
    columns = torch.arange(width)
    prompt_end = pad + torch.tensor(result.prompt_tokens, dtype=torch.long)
    prompt = (columns >= pad[:, None]) & (columns < prompt_end[:, None])
    completion = columns >= prompt_end[:, None]
    replies = [reply(tokenizer, row, size, eos) for row, size in zip(rows, result.prompt_tokens, strict=True)]
    places = list(range(len(indices))) if positions is None else list(positions)
    return Rollouts(
        list(indices),
        places,
        tokens.to(device),
        pad.to(device),
        prompt.to(device),
        completion.to(device),
        replies,
        group_size,
    )
