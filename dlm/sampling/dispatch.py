"""The one entry to the reverse process: `denoise` runs the sampler strategy a model and its options need.

Strategies are registered here, each a `dlm.sampling.reverse.Strategy` (a name, when it applies, how
it runs); the newest registered one that applies runs. The built-ins, in the order they are tried:
an autoregressive model samples token by token (`dlm.sampling.autoregressive`); another block model
block by block (`dlm.sampling.block_model`); a threshold, a cache or a stop token take the fast path
(`dlm.sampling.fast`); everything else runs the plain loop (`dlm.sampling.plain`).
Adding a sampler is one module with its `Strategy` and one `register_strategy` call.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from dlm.diffusion.schedules import Schedule, model_schedule
from dlm.errors import UserError
from dlm.registry import Registry
from dlm.runtime.allocator import keep_freed_memory
from dlm.sampling import autoregressive, block_model, fast, plain
from dlm.sampling.options import SamplingOptions, StepCallback
from dlm.sampling.reverse import ReverseContext, Strategy
from dlm.sampling.row_noise import RowNoise

if TYPE_CHECKING:
    from dlm.config.schema import ModelConfig
    from dlm.model.denoiser import Denoiser

_STRATEGIES: Registry[Strategy] = Registry("sampler strategy")


def register_strategy(strategy: Strategy, replace: bool = False) -> None:
    """Make `strategy` a sampler `denoise` may run; it is tried before every strategy registered earlier."""

    if replace:
        _STRATEGIES.remove(strategy.name)  # a replacement is tried first, as any newer registration
    _STRATEGIES.add(strategy.name, strategy)


def unregister_strategy(name: str) -> None:
    _STRATEGIES.remove(name)


def strategy_names() -> tuple[str, ...]:
    """The registered strategies in the order `denoise` tries them."""

    return tuple(reversed(_STRATEGIES.names()))


def strategy_for(model: Denoiser, options: SamplingOptions, stop_token_id: int | None) -> Strategy:
    """The strategy `denoise` runs for `model` with `options`: the newest registered one that applies."""

    for name in strategy_names():
        strategy = _STRATEGIES.get(name)
        if strategy is not None and strategy.applies(model, options, stop_token_id):
            return strategy
    raise LookupError("no sampler strategy applies (the plain one always should: was it unregistered?)")


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
    with (`dlm.diffusion.schedules.model_schedule`). Call it in eval mode under `torch.inference_mode()`
    (as `generate` does). A `dlm.sampling.row_noise.RowNoise` as `generator` gives groups of rows their
    own random streams; `pad` [B] counts each row's leading padding positions, which no position
    attends to. The newest registered strategy that applies runs (see `register_strategy`).
    """

    check_samplable(model.config, options)
    keep_freed_memory(tokens.device)  # on the CPU each step reuses the last one's buffers: no page faults
    noise = RowNoise.of(generator, tokens.shape[0])
    schedule = model_schedule(model) if schedule is None else schedule
    strategy = strategy_for(model, options, stop_token_id)
    context = ReverseContext(noise, schedule, forbidden_token_ids, on_step, stop_token_id, pad)
    return strategy.run(model, tokens, fill_mask, options, context)


def check_samplable(config: ModelConfig, options: SamplingOptions) -> None:
    """Refuse what the reverse process cannot run: an imported causal model (its positions never see
    the masks after them, so it was not trained to fill them; dlm's own autoregressive model is sampled
    token by token), and a shifted-logits model with a KV cache (a
    block's first position predicts from the position before it, which a cached pass does not feed)."""

    if config.attention == "causal" and not config.is_autoregressive:
        raise UserError(
            "a causal model (model.attention = causal) cannot be sampled as a diffusion model",
            fix="adapt it first: dlm train --init-from MODEL with model.attention = bidirectional",
        )
    if config.shift_logits and options.cache != "none":
        raise UserError(
            f"--cache {options.cache} cannot serve a shifted-logits model (model.shift_logits)", fix="omit --cache"
        )


def _sharded(model: object) -> bool:
    """Whether FSDP shards any part of `model` (a served request's stand-in is no module: never)."""

    if not isinstance(model, torch.nn.Module):
        return False
    # A sharded module's class comes from torch.distributed.fsdp, so where that was never imported
    # nothing is sharded; importing it only to find out costs a fresh process about 0.4 s.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)  # torch 2.6 and later
    if fsdp_module is None:
        return False
    return any(isinstance(module, fsdp_module) for module in model.modules())


@contextmanager
def inference(model: Denoiser) -> Iterator[None]:
    """Eval mode without autograd, leaving the model's train / eval mode as it was.

    Inference mode where it can be; plain no-grad for a model FSDP shards (`dlm rl` samples with the
    model it trains): FSDP gathers its parameters into buffers it reuses, and buffers first written
    under inference mode can no longer be written by the training step's forward.
    """

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad() if _sharded(model) else torch.inference_mode():
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


# Tried last to first: the plain loop is the fallback, a block model never takes the whole-sequence paths.
register_strategy(plain.STRATEGY)
register_strategy(fast.STRATEGY)
register_strategy(block_model.STRATEGY)
register_strategy(autoregressive.STRATEGY)
