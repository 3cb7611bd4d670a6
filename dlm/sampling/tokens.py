"""Token sampling from logits: top-k / top-p filtering and the Gumbel-max draw."""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf all but the top-k logits and all but the smallest top-p probability nucleus.

    Tokens tied with the k-th logit are kept. The most likely token always survives, so every row
    keeps a non-empty support.
    """

    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the more likely tokens before it already reach top_p.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of `logits` [N, V] by the Gumbel-max trick (argmax at temperature 0).

    The noise is float64: in 16-bit (or even 32-bit) precision the Gumbel tails are truncated and
    repeated samples lose diversity. `uniform` [N, V] gives the uniform draws instead of `generator`.
    """

    logits = logits.double()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / temperature, top_k=top_k, top_p=top_p)
    if uniform is None:
        uniform = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float64).tiny)))
    return (logits + gumbel).argmax(dim=-1)
