"""Sampling from a block model (`[model] block_size`): block by block, with an exact KV cache.

A block model attends causally across blocks, so the keys and values of a finished (clean) block
never change: they are computed once, in a pass that stores them in a `KVCache`, and every
denoising step of a later block feeds only that block's B positions, which read the cache. This is
exact, not an approximation: the cached pass computes the same attention as a pass over the whole
prefix under the block-causal mask (`kv_cache=False`, the reference the tests compare against).

Blocks are the model's own, aligned to position 0 as in training; a block holding any position to
generate is denoised with the reverse process of `dlm.sampling` (its share of the steps), positions
of the prompt or template inside it stay fixed. With `stop_token_id`, generation ends after the
first block that leaves every sample with that token (the end-of-document token) among its
generated positions; later positions stay masked for the caller to cut off. With a `threshold`
a block's steps commit every position above it (`dlm.sampling.reverse.reveal_threshold`) and the block
ends as soon as it is filled.

Past the context: the model saw at most `max_seq_len` positions in training, so the cache keeps
the most recent clean blocks that fit with the block being denoised (a sliding window of whole
blocks) and drops older ones. Rotary positions keep counting past `max_seq_len`: attention with
rotary embeddings depends only on the distance between positions, which stays within the window,
so this is the same as re-numbering the window from 0. The approximation is in the kept keys: they
were computed when the blocks before them were still visible, which a fresh pass over the window
would not see. Until the sequence outgrows the context nothing is dropped, and generation is the
same as without the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dlm.diffusion.schedules import Schedule
from dlm.errors import UserError
from dlm.model.attention import KVCache
from dlm.model.denoiser import block_size
from dlm.sampling.options import SamplingOptions, StepCallback
from dlm.sampling.reverse import (
    Reverse,
    ReverseContext,
    Strategy,
    never_predicted,
    reverse_step,
    steps_per_block,
)
from dlm.sampling.row_noise import RowNoise

if TYPE_CHECKING:
    from dlm.model.denoiser import Denoiser


def check_block_model_options(options: SamplingOptions) -> None:
    """A block model has its own exact cache: refuse the approximate one, which would be ignored."""

    if options.cache != "none":
        raise UserError(
            f"--cache {options.cache} is for whole-sequence models",
            fix="omit --cache: a block model always reuses the exact cache of earlier blocks",
        )


@dataclass
class _Window:
    """The model block being denoised, [start, end), and the cache of everything before it; the
    whole batch's tokens, and the passes made to store finished blocks that no step could share."""

    start: int = 0
    end: int = 0
    cache: KVCache | None = None
    tokens: Tensor | None = None
    commit_passes: int = 0


@dataclass(frozen=True)
class BlockReverse(Reverse):
    """The reverse process of one model block: the model sees the prefix (or its cache) and the block.

    Finished blocks not yet in the cache are stored by the block's first forward pass: it feeds them
    before the block and keeps their keys and values (`KVCache.keep`), so a block costs its steps'
    passes and no commit pass (at block_size 1, one pass per token). Their keys and values are the
    ones a pass of their own would store, as the block-causal mask hides the block from them.
    """

    window: _Window = field(default_factory=_Window)

    def model_tokens(self, tokens: Tensor, rows: Tensor | None) -> Tensor:
        """What the model reads for `tokens` of the batch rows `rows` (None: all): every pass, and
        every pass that only stores keys and values, feeds this (`dlm.sampling.autoregressive` shifts it)."""

        return tokens

    def logits(self, tokens: Tensor, positions: Tensor, rows: Tensor | None) -> Tensor:
        tokens = self.model_tokens(tokens, rows)
        window = self.window
        start, end, cache = window.start, window.end, window.cache
        if cache is None:  # reference: the whole prefix under the block-causal mask
            return self.forward(tokens[:, :end], positions[:, :end], rows)
        if cache.length < start and rows is not None and not bool(rows.all()):
            # A step of some rows only cannot store the batch's cache: a pass of its own does.
            assert window.tokens is not None
            window.commit_passes += _commit(self, window.tokens, cache, start, end - start)
        if cache.length < start:
            first = cache.length
            cache.committing, cache.keep = True, start - first
            try:  # every row (rows, if given, are all of them): the batch's own cache
                return self.forward(tokens[:, first:end], positions[:, first:end], rows, cache)
            finally:
                cache.committing, cache.keep = False, None
        cache = cache if rows is None else cache.select(rows)
        return self.forward(tokens[:, start:end], positions[:, start:end], rows, cache)


def _commit(reverse: BlockReverse, tokens: Tensor, cache: KVCache, end: int, room: int, defer: bool = False) -> int:
    """Store the keys and values of positions [cache.length, end), which are final, leaving room in
    the model's context for `room` more positions; forward passes made.

    Older blocks are dropped from the cache (whole blocks, oldest first) where the context would
    overflow, and a long stretch is committed in chunks that fit. With `defer`, a stretch that fits
    beside the next `room` positions without dropping anything is left to the block's first pass.
    """

    config = reverse.model.config
    block_size, context = config.block_size, config.max_seq_len
    tokens = reverse.model_tokens(tokens, None)
    passes = 0
    while cache.length < end:
        if defer and cache.stored + (end - cache.length) + room <= context:
            return passes
        cache.trim(context - block_size, block_size)
        fits = (context - cache.stored) // block_size * block_size
        chunk = tokens[:, cache.length : min(end, cache.length + fits)]
        cache.committing = True
        try:  # no output positions: keys and values only (no vocabulary matmul, no last-layer MLP)
            reverse.forward(chunk, torch.zeros_like(chunk, dtype=torch.bool), None, cache)
        finally:
            cache.committing = False
        passes += 1
    cache.trim(context - room, block_size)
    return passes


def _denoise_block(reverse: BlockReverse, tokens: Tensor, block: Tensor, steps: int, schedule: Schedule) -> int:
    """Run `steps` reverse steps on the positions `block` of one model block; forward passes made."""

    passes = 0
    for index in range(steps):
        if reverse.options.threshold is not None and not bool((tokens[:, block] == reverse.mask_id).any()):
            break  # the threshold filled the block early
        passes += reverse_step(reverse, tokens, block, steps, index, schedule)
    return passes


def model_blocks(
    tokens: Tensor, fill_mask: Tensor, options: SamplingOptions, block_size: int, mask_id: int
) -> tuple[Tensor, list[Tensor]]:
    """A block model's start: a copy of `tokens` masked where `fill_mask` is, and the positions to generate
    of each model block that holds any (blocks of `block_size` from column 0); refused with a
    `block_length` of another size or fewer steps than blocks."""

    if options.block_length not in (None, block_size):
        raise UserError(
            f"--block-length {options.block_length} differs from the model's block_size {block_size}",
            fix="omit --block-length: a block model generates its own blocks",
        )
    tokens = tokens.clone()
    tokens[:, fill_mask] = mask_id
    positions = fill_mask.nonzero().squeeze(-1)
    blocks = [positions[positions // block_size == b] for b in sorted(set((positions // block_size).tolist()))]
    if len(blocks) > options.steps:
        raise UserError(
            f"--steps ({options.steps}) is fewer than the {len(blocks)} blocks to generate",
            fix=f"use at least {len(blocks)} steps",
        )
    return tokens, blocks


def denoise_blocks(
    model: Denoiser,
    tokens: Tensor,
    fill_mask: Tensor,
    options: SamplingOptions,
    *,
    generator: torch.Generator | RowNoise,
    forbidden_token_ids: Sequence[int] = (),
    on_step: StepCallback | None = None,
    schedule: Schedule,
    kv_cache: bool = True,
    stop_token_id: int | None = None,
    pad: Tensor | None = None,
    reverse_type: type[BlockReverse] = BlockReverse,
) -> tuple[Tensor, int]:
    """`dlm.sampling.dispatch.denoise` for a block model: the model's blocks left to right, cached prefix.
    `reverse_type` computes the logits (`dlm.sampling.autoregressive` feeds its model a shifted row)."""

    block_size, mask_id = model.config.block_size, model.config.mask_token_id
    tokens, blocks = model_blocks(tokens, fill_mask, options, block_size, mask_id)
    positions = fill_mask.nonzero().squeeze(-1)
    noise = RowNoise.of(generator, tokens.shape[0])
    never = never_predicted(mask_id, forbidden_token_ids, noise.device)
    reverse = reverse_type(model, options, noise, mask_id, never, pad=pad)
    reverse.window.tokens = tokens
    cache = KVCache() if kv_cache else None
    passes, step = 0, 0
    if on_step is not None:
        on_step(0, tokens.clone())
    for block, block_steps in zip(blocks, steps_per_block(options.steps, len(blocks)), strict=True):
        start = int(block[0]) // block_size * block_size
        window = reverse.window
        window.start, window.end, window.cache = start, min(start + block_size, tokens.shape[1]), cache
        if cache is not None:
            passes += _commit(reverse, tokens, cache, start, window.end - start, defer=True)
        passes += _denoise_block(reverse, tokens, block, block_steps, schedule)
        step += block_steps
        if on_step is not None:
            on_step(step, tokens.clone())
        generated = tokens[:, positions[positions < window.end]]
        if stop_token_id is not None and bool((generated == stop_token_id).any(dim=1).all()):
            break
    return tokens, passes + reverse.window.commit_passes


def _run(
    model: Denoiser, tokens: Tensor, fill_mask: Tensor, options: SamplingOptions, context: ReverseContext
) -> tuple[Tensor, int]:
    check_block_model_options(options)
    return denoise_blocks(model, tokens, fill_mask, options, generator=context.noise, **context.keywords())


# A block model always samples block by block (prefix cached, may stop early).
STRATEGY = Strategy("block model", lambda model, options, stop_token_id: block_size(model.config) > 0, _run)
