"""Sampling from an autoregressive model (`ModelConfig.is_autoregressive`): one pass per token, exact KV cache.

Such a model is causal with blocks of one token, so the block sampler (`dlm.sampling.block_model`)
runs it as it is: the keys and values of the finished prefix are stored once, and each pass feeds
only the positions not yet stored and the one being generated. One thing differs: position i reads
token i - 1 (the mask token at a row's first position), so every pass feeds the row shifted by one
(`dlm.model.denoiser.autoregressive_inputs`) and its output at position i is the distribution of token i.

Each token is its block's only reverse step: it is sampled from that distribution with the
options' temperature, top-k and top-p, and committed. A token costs one forward pass, whatever
`--steps`, `--threshold` or `--remasking` say (they choose which masked positions a step reveals,
and here a step has exactly one). With `kv_cache=False` every pass feeds the whole prefix under
the causal mask: the reference the tests compare the cached sampler against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from torch import Tensor

from dlm.model.denoiser import autoregressive_inputs
from dlm.sampling.block_model import BlockReverse, check_block_model_options, denoise_blocks
from dlm.sampling.options import SamplingOptions
from dlm.sampling.reverse import ReverseContext, Strategy

if TYPE_CHECKING:
    from dlm.model.denoiser import Denoiser


@dataclass(frozen=True)
class ShiftedReverse(BlockReverse):
    """The block reverse process of a model that reads each token at the position after it."""

    def model_tokens(self, tokens: Tensor, rows: Tensor | None) -> Tensor:
        pad = None if self.pad is None else (self.pad if rows is None else self.pad[rows])
        return autoregressive_inputs(tokens, self.mask_id, pad)


def autoregressive_options(options: SamplingOptions, tokens_to_generate: int) -> SamplingOptions:
    """`options` as an autoregressive model runs them: one step per token, no threshold."""

    return replace(options, steps=max(1, tokens_to_generate), threshold=None)


def generate_tokens(
    model: Denoiser,
    tokens: Tensor,
    fill_mask: Tensor,
    options: SamplingOptions,
    context: ReverseContext,
    kv_cache: bool = True,
) -> tuple[Tensor, int]:
    """Fill the positions `fill_mask` [L] of `tokens` [B, L] left to right, one pass per token."""

    check_block_model_options(options)
    options = autoregressive_options(options, int(fill_mask.sum()))
    return denoise_blocks(
        model,
        tokens,
        fill_mask,
        options,
        generator=context.noise,
        kv_cache=kv_cache,
        reverse_type=ShiftedReverse,
        **context.keywords(),
    )


def _applies(model: Denoiser, options: SamplingOptions, stop_token_id: int | None) -> bool:
    return bool(getattr(model.config, "is_autoregressive", False))


# An autoregressive model samples token by token (prefix cached, may stop early).
STRATEGY = Strategy("autoregressive", _applies, generate_tokens)
