"""The plain sampler: every step of the reverse process as `dlm.sampling.reverse` defines it, block by block.

The fallback strategy: a whole-sequence model without a threshold, a cache or a stop token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dlm.sampling.options import SamplingOptions
from dlm.sampling.reverse import (
    Reverse,
    ReverseContext,
    Strategy,
    reveal_count,
    sequence_blocks,
    step_times,
    steps_per_block,
)

if TYPE_CHECKING:
    from dlm.model.denoiser import Denoiser


def denoise_plain(
    model: Denoiser, tokens: Tensor, fill_mask: Tensor, options: SamplingOptions, context: ReverseContext
) -> tuple[Tensor, int]:
    """`dlm.sampling.dispatch.denoise` by the plain loop (which never stops early: no stop token here)."""

    mask_id = model.config.mask_token_id
    tokens, blocks = sequence_blocks(tokens, fill_mask, options, mask_id)
    never = [mask_id, *(token for token in context.forbidden_token_ids if token != mask_id)]
    noise, schedule, on_step = context.noise, context.schedule, context.on_step
    reverse = Reverse(model, options, noise, mask_id, torch.tensor(never, device=noise.device), pad=context.pad)
    forward_passes, step = 0, 0
    if on_step is not None:
        on_step(0, tokens.clone())
    for block, block_steps in zip(blocks, steps_per_block(options.steps, len(blocks)), strict=True):
        for index in range(block_steps):
            if options.remasking == "random":
                t, s = step_times(block_steps, index)
                forward_passes += reverse.reveal_random(tokens, block, schedule.reveal_probability(s, t))
            else:
                count = reveal_count(block.numel(), block_steps, index, schedule, options.reveal_split)
                forward_passes += reverse.reveal_confident(tokens, block, count)
            step += 1
            if on_step is not None:
                on_step(step, tokens.clone())
    return tokens, forward_passes


STRATEGY = Strategy("plain", lambda model, options, stop_token_id: True, denoise_plain)
