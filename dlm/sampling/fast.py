"""Fast decoding for a whole-sequence model: confidence thresholds, approximate KV caches, early stop.

`dlm.sampling.dispatch.denoise` hands a whole-sequence model to `denoise_fast` when any of these is asked for:

- `threshold` P (Fast-dLLM's parallel decoding): a step samples every masked position of the
  current block and commits each whose sampled token has probability above P (with `margin`
  remasking: whose top-1 minus top-2 probability is above P, the score that remasking ranks by).
  It commits at least one position, and at least as many as the schedule would (the highest
  scores), so a block never needs more than its share of the steps; a block whose positions are
  all committed ends at once. At temperature 0 the sampled token is the most probable one.
- `cache` `prefix` or `dual` (Fast-dLLM's approximate KV cache): the first step of a block runs
  the whole sequence and keeps every layer's keys and values; later steps of that block feed only
  the block and everything after it (`prefix`) or only the block (`dual`), and attend to the kept
  keys of the other positions. It is approximate because in a bidirectional model those keys
  would change as the block is filled in; they are refreshed at every block boundary.
- a stop token: generation ends once every sample has a committed end-of-document token with
  nothing masked before it; what follows it is cut off, so the kept text is exactly the text of
  sampling to the end and cutting there.

Without a threshold and with `cache="none"` every step is the one `dlm.sampling` runs, drawing
the same random numbers, so the tokens are those of the plain sampler. A block model's sampler
(`dlm.sampling.block_model`) takes its threshold steps from here too (`reveal_threshold`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dlm.diffusion.schedules import Schedule
from dlm.model.attention import KVCache
from dlm.sampling.options import SamplingOptions, StepCallback
from dlm.sampling.reverse import (
    Reverse,
    ReverseContext,
    Strategy,
    never_predicted,
    reverse_step,
    sequence_blocks,
    steps_per_block,
)
from dlm.sampling.row_noise import RowNoise

if TYPE_CHECKING:
    from dlm.model.denoiser import Denoiser


@dataclass
class _Window:
    """The block being denoised, [start, end), the live token tensor and the kept keys and values."""

    start: int = 0
    end: int = 0
    tokens: Tensor | None = None
    cache: KVCache | None = None


@dataclass(frozen=True)
class _FastReverse(Reverse):
    """`Reverse` with the cached forward pass and the threshold step."""

    window: _Window = field(default_factory=_Window)

    def logits(self, tokens: Tensor, positions: Tensor, rows: Tensor | None) -> Tensor:
        mode, window = self.options.cache, self.window
        if mode == "none":
            return self.forward(tokens, positions, rows)
        if window.cache is None:
            return self._refresh(positions, rows)
        cache = window.cache if rows is None else window.cache.select(rows)
        end = tokens.shape[1] if mode == "prefix" else window.end
        return self.forward(tokens[:, window.start : end], positions[:, window.start : end], rows, cache)

    def _refresh(self, positions: Tensor, rows: Tensor | None) -> Tensor:
        """Run the whole batch over the whole sequence, keep the keys and values outside the block.

        The cache needs every row even when only some rows want predictions (ancestral steps), so
        the pass reads the live tokens, which still hold this step's input.
        """

        window = self.window
        assert window.tokens is not None
        full = positions
        if rows is not None:
            full = torch.zeros_like(window.tokens, dtype=torch.bool)
            full[rows] = positions
        cache = KVCache(committing=True)
        logits = self.forward(window.tokens, full, None, cache)
        if rows is not None:  # row-major gather: keep the entries of the rows that asked
            owner = full.nonzero()[:, 0]
            logits = logits[rows[owner]]
        keep = slice(0, window.start)
        kept = []
        for layer in cache.layers:
            assert layer is not None
            parts = [kv[:, :, keep] for kv in layer]
            if self.options.cache == "dual":  # key order is irrelevant to unmasked attention
                after = [kv[:, :, window.end :] for kv in layer]
                parts = [torch.cat(pair, dim=2) for pair in zip(parts, after, strict=True)]
            kept.append((parts[0], parts[1]))
        window.cache = KVCache(list(kept), length=window.start)  # rotary positions of the block start here
        return logits


def ended_rows(tokens: Tensor, generated: Tensor, stop_token_id: int, mask_id: int) -> Tensor:
    """Per row of `tokens` [B, L]: whether it has a stop token at a generated position (`generated`, [L] or
    [B, L]) with no masked generated position before it (what follows is cut off: the row is done)."""

    stops = (tokens == stop_token_id) & generated
    first = stops.int().argmax(dim=1)  # the first stop's column (0 where there is none: nothing is before)
    before = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < first[:, None]
    return stops.any(dim=1) & ~((tokens == mask_id) & generated & before).any(dim=1)


def _finished(tokens: Tensor, fill_mask: Tensor, stop_token_id: int, mask_id: int) -> bool:
    """Whether every row has ended (`ended_rows`)."""

    return bool(ended_rows(tokens, fill_mask, stop_token_id, mask_id).all())


def denoise_fast(
    model: Denoiser,
    tokens: Tensor,
    fill_mask: Tensor,
    options: SamplingOptions,
    blocks: list[Tensor],
    *,
    generator: torch.Generator | RowNoise,
    forbidden_token_ids: Sequence[int] = (),
    on_step: StepCallback | None = None,
    schedule: Schedule,
    stop_token_id: int | None = None,
    pad: Tensor | None = None,
) -> tuple[Tensor, int]:
    """`dlm.sampling.dispatch.denoise` with the options above, on tokens already masked where `fill_mask` is."""

    mask_id = model.config.mask_token_id
    noise = RowNoise.of(generator, tokens.shape[0])
    reverse = _FastReverse(
        model, options, noise, mask_id, never_predicted(mask_id, forbidden_token_ids, noise.device), pad=pad
    )
    passes, step = 0, 0
    for block, block_steps in zip(blocks, steps_per_block(options.steps, len(blocks)), strict=True):
        window = reverse.window
        window.start, window.end, window.tokens, window.cache = int(block[0]), int(block[-1]) + 1, tokens, None
        for index in range(block_steps):
            if options.threshold is not None and not bool((tokens[:, block] == mask_id).any()):
                break  # a threshold can finish a block early; fixed-count steps keep their random draws
            passes += reverse_step(reverse, tokens, block, block_steps, index, schedule)
            step += 1
            if on_step is not None:
                on_step(step, tokens.clone())
            if stop_token_id is not None and _finished(tokens, fill_mask, stop_token_id, mask_id):
                return tokens, passes
    return tokens, passes


def _applies(model: Denoiser, options: SamplingOptions, stop_token_id: int | None) -> bool:
    return options.threshold is not None or options.cache != "none" or stop_token_id is not None


def _run(
    model: Denoiser, tokens: Tensor, fill_mask: Tensor, options: SamplingOptions, context: ReverseContext
) -> tuple[Tensor, int]:
    tokens, blocks = sequence_blocks(tokens, fill_mask, options, model.config.mask_token_id)
    if context.on_step is not None:
        context.on_step(0, tokens.clone())
    return denoise_fast(model, tokens, fill_mask, options, blocks, generator=context.noise, **context.keywords())


STRATEGY = Strategy("fast", _applies, _run)
