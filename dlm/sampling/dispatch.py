"""The one entry to the reverse process: `denoise` picks the sampler a model and its options need.

A block model samples block by block (`dlm.sampling.block_model`); a threshold, a cache or a stop
token take the fast path (`dlm.sampling.fast`); everything else runs the plain loop here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from dlm.diffusion.schedules import Schedule, model_schedule
from dlm.errors import UserError
from dlm.model.denoiser import block_size
from dlm.sampling.options import SamplingOptions, StepCallback
from dlm.sampling.reverse import Reverse, reveal_count, step_times, steps_per_block
from dlm.sampling.row_noise import RowNoise

if TYPE_CHECKING:
    from dlm.model.denoiser import Denoiser


def denoise(
    model: Denoiser,
    tokens: torch.Tensor,
    fill_mask: torch.Tensor,
    options: SamplingOptions,
    *,
    generator: torch.Generator | RowNoise,
    forbidden_token_ids: Sequence[int] = (),
    on_step: StepCallback | None = None,
    schedule: Schedule | None = None,
    stop_token_id: int | None = None,
    pad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Run the reverse process on `tokens` [B, L] where `fill_mask` [L] is true.

    Returns the completed tokens (no mask left in `fill_mask`, everything else unchanged) and the
    number of model forward passes. `model.config.mask_token_id` and `forbidden_token_ids` are
    never predicted. `on_step(step, tokens)` gets a copy of the tokens: step 0 is the starting
    sequence, then steps 1 .. `options.steps`. `schedule` defaults to the one the model was trained
    with (`dlm.diffusion.schedules.model_schedule`). Call it in eval mode under `torch.inference_mode()` (as
    `generate` does). A `dlm.sampling.row_noise.RowNoise` as `generator` gives groups of rows their own random
    streams; `pad` [B] counts each row's leading padding positions, which no position attends to.
    """

    mask_id = model.config.mask_token_id
    generator = RowNoise.of(generator, tokens.shape[0])
    schedule = model_schedule(model) if schedule is None else schedule
    if block_size(model.config):  # block by block, prefix cached, may stop early
        from dlm.sampling.block_model import check_block_model_options, denoise_blocks

        check_block_model_options(options)

        return denoise_blocks(model, tokens, fill_mask, options, generator=generator, schedule=schedule,
                              forbidden_token_ids=forbidden_token_ids, on_step=on_step,
                              stop_token_id=stop_token_id, pad=pad)  # fmt: skip
    tokens = tokens.clone()
    tokens[:, fill_mask] = mask_id
    never = [mask_id, *(token for token in forbidden_token_ids if token != mask_id)]
    reverse = Reverse(model, options, generator, mask_id, torch.tensor(never, device=generator.device), pad=pad)
    positions = fill_mask.nonzero().squeeze(-1)
    blocks = list(positions.split(options.block_length)) if options.block_length else [positions]
    if len(blocks) > options.steps:
        raise UserError(
            f"--steps ({options.steps}) is fewer than the {len(blocks)} blocks of --block-length "
            f"{options.block_length}",
            fix=f"use at least {len(blocks)} steps or a larger --block-length",
        )
    if options.threshold is not None or options.cache != "none" or stop_token_id is not None:
        from dlm.sampling.fast import denoise_fast

        if on_step is not None:
            on_step(0, tokens.clone())
        return denoise_fast(model, tokens, fill_mask, options, blocks, generator=generator, schedule=schedule,
                            forbidden_token_ids=forbidden_token_ids, on_step=on_step,
                            stop_token_id=stop_token_id, pad=pad)  # fmt: skip
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


@contextmanager
def inference(model: Denoiser) -> Iterator[None]:
    """Eval mode without autograd, leaving the model's train / eval mode as it was."""

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


@contextmanager
def counting_tokens(model: Denoiser) -> Iterator[list[int]]:
    """Count the token positions fed to the model (its first argument), the cost a cache saves."""

    fed = [0]

    def count(module: Any, args: tuple[Any, ...]) -> None:
        fed[0] += args[0].numel()

    handle = model.register_forward_pre_hook(count) if isinstance(model, torch.nn.Module) else None
    try:
        yield fed
    finally:
        if handle is not None:
            handle.remove()
