"""The contract between a model and the code that runs it, as a type the checker verifies.

Sampling (`dlm.sampling`, `dlm.sampling.block_model`) and evaluation (`dlm.evaluation.evaluate`) accept any
`Denoiser`: `dlm.model.transformer.DiffusionTransformer` is one, and so is a module that wraps one as long as it
keeps the same call and exposes the same `config`. Nothing here imports torch at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from dlm.config.schema import ModelConfig
    from dlm.model.attention import KVCache


class Denoiser(Protocol):
    """A network that predicts the clean tokens of a partly masked sequence.

    Called with token ids [B, L] it returns logits [B, L, vocab_size], or [N, vocab_size] at the N
    true entries of the boolean `output_positions`. A model declares its variant through `config`,
    read only through `block_size()` and `needs_clean_copy()` below: a block model also takes the
    clean sequence (`clean_tokens`) or a `cache` of the positions before `tokens`. `pad`
    (a batch of prompts, sampled or scored) counts each row's leading padding positions; `documents` (a scored
    pass of a model with `document_separator_id`) gives each position's document in the packed row.
    The rest is the part of `torch.nn.Module` that sampling and evaluation use: the train / eval
    mode, and the parameters and buffers that tell which device the model is on.
    """

    training: bool

    @property
    def config(self) -> ModelConfig: ...

    def __call__(
        self,
        tokens: Tensor,
        output_positions: Tensor | None = None,
        *,
        clean_tokens: Tensor | None = None,
        cache: KVCache | None = None,
        pad: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> Tensor: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def to(self, device: torch.device) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]: ...


if TYPE_CHECKING:
    from dlm.model.transformer import DiffusionTransformer

    def _model_is_a_denoiser(model: DiffusionTransformer) -> Denoiser:
        return model  # the checker verifies that the model meets the contract


def block_size(config: ModelConfig) -> int:
    """The model's block size when it is a block model (block-causal attention), else 0: the whole
    sequence is one block. The one reading of the model's variant outside the model itself."""

    return config.block_size if getattr(config, "is_block_model", False) else 0


def needs_clean_copy(config: ModelConfig) -> bool:
    """Whether a scored pass feeds the clean sequence beside the noisy one (a block model's 2L pass,
    or the shifted clean row an autoregressive model reads)."""

    return block_size(config) > 0


def pass_copies(config: ModelConfig) -> int:
    """Copies of the row a scored pass runs the layers over: 2 for a block model's noisy and clean
    copies, 1 for a whole-sequence model and for an autoregressive one (one causal pass)."""

    return 2 if needs_clean_copy(config) and not getattr(config, "is_autoregressive", False) else 1


def autoregressive_inputs(tokens: Tensor, mask_token_id: int, pad: Tensor | None = None) -> Tensor:
    """What an autoregressive model (`ModelConfig.is_autoregressive`) reads to predict `tokens` [B, L]:
    the row shifted right by one, the mask token first (at each row's first position after its
    `pad` leading padding positions), so that position i reads token i - 1 and predicts token i."""

    shifted = tokens.roll(1, dims=1)
    if pad is None:
        shifted[:, 0] = mask_token_id
    else:  # a left-padded row starts after its padding; the padding itself is never seen
        first = pad.to(tokens.device).clamp_max(tokens.shape[1] - 1)[:, None]
        shifted.scatter_(1, first, mask_token_id)
    return shifted


def masked_logits(
    model: Denoiser | Callable[..., Tensor],
    noisy: Tensor,
    mask: Tensor,
    clean: Tensor,
    *,
    config: ModelConfig | None = None,
) -> Tensor:
    """Logits [N, V] at the N true entries of `mask` in `noisy`, a corruption of `clean`: the one forward
    pass of training, validation, `dlm eval`, scoring and the generation benchmark's judge. `config`
    names the model when `model` is a wrapper without one (the DDP or compiled training model)."""

    config = cast("Denoiser", model).config if config is None else config
    keywords: dict[str, Any] = {}  # only those the variant takes: a plain callable may know no others
    if needs_clean_copy(config):
        keywords["clean_tokens"] = clean
    if config.document_separator_id is not None:  # document-aware attention, from the clean row's separators
        from dlm.model.attention import document_ids  # lazy: this module imports no torch at run time

        keywords["documents"] = document_ids(clean, config.document_separator_id)
    return model(noisy, output_positions=mask, **keywords)
