"""The plain sampler: every step of the reverse process as `dlm.sampling.reverse` defines it, block by block.

The fallback strategy: a whole-sequence model without a threshold, a cache or a stop token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from dlm.sampling.options import SamplingOptions
from dlm.sampling.reverse import (
    Reverse,
    ReverseContext,
    Strategy,
    never_predicted,
    reverse_step,
    sequence_blocks,
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
    noise, schedule, on_step = context.noise, context.schedule, context.on_step
    never = never_predicted(mask_id, context.forbidden_token_ids, noise.device)
    reverse = Reverse(model, options, noise, mask_id, never, pad=context.pad)
    forward_passes, step = 0, 0
    if on_step is not None:
        on_step(0, tokens.clone())
    for block, block_steps in zip(blocks, steps_per_block(options.steps, len(blocks)), strict=True):
        for index in range(block_steps):
            forward_passes += reverse_step(reverse, tokens, block, block_steps, index, schedule)
            step += 1
            if on_step is not None:
                on_step(step, tokens.clone())
    return tokens, forward_passes


STRATEGY = Strategy("plain", lambda model, options, stop_token_id: True, denoise_plain)
