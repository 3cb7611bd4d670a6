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
        drop = _nucleus_cut(logits, top_p)
        if drop is None:
            drop = _sorted_drop(logits, top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _sorted_drop(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens outside the top-p nucleus, by a full sort with indices (the reference).

    The sort is stable, so tokens tied exactly at the cut are kept in the order of their ids: an
    unstable sort orders ties by its kernels, which differ between CPUs (ATen's `default` and AVX2
    sorts of the same bfloat16-valued logits disagree), and the nucleus with them.
    """

    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the more likely tokens before it already reach top_p.
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def _nucleus_cut(logits: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """`_sorted_drop` of `logits` [N, V] from sorted values alone, or None where that cannot be exact.

    torch's CPU sort with indices costs ~25x numpy's sort of the values, and was most of a step
    that samples every masked position. The values alone give the same sorted sequence, hence the
    same softmax and cumulative sums bit for bit, so the same cut: when the drops are the tail of
    the sorted order, the nucleus is every token more likely than its least likely kept value
    `last`, plus as many of the tokens tied at `last` as the kept count leaves, the lowest ids first
    (the stable sort's order of ties). Logits from a bfloat16 model tie at the cut often.
    """

    if logits.device.type != "cpu" or logits.dim() != 2 or logits.dtype not in (torch.float32, torch.float64):
        return None
    # Descending values as -sort(-x) in one buffer: negation is exact, and every new [N, V] float64
    # buffer costs its page faults. (NaN lands last, not first; such a row's probabilities are all NaN.)
    values = torch.neg(logits.detach())
    values.numpy().sort(axis=-1)
    values.neg_()
    probs = values.softmax(dim=-1)
    drop_sorted = probs.cumsum(dim=-1).sub_(probs) >= top_p
    width = drop_sorted.shape[-1]
    kept = width - drop_sorted.sum(dim=-1, keepdim=True)  # the nucleus size, when the drops are one tail
    tail = torch.arange(width)[None, :] >= kept
    # A row with NaN or +inf has NaN probabilities, no drops here nor in the reference: it keeps all.
    if not torch.equal(drop_sorted, tail):
        return None
    last = values.gather(-1, (kept - 1).clamp_min(0))  # the least likely kept value (kept >= 1: p[0] - p[0] = 0)
    first_out = values.gather(-1, kept.clamp_max(width - 1))
    cut = kept < width
    keep = logits > last
    tied = cut & (first_out == last)
    if bool(tied.any()):
        # Of the tokens equal to `last`, keep the first (kept - #more likely) by id.
        at_last = logits == last
        room = kept - keep.sum(dim=-1, keepdim=True)
        keep |= at_last & (at_last.cumsum(dim=-1) <= room)
    else:
        keep |= logits == last
    return cut & ~keep


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
    if temperature != 1:  # x / 1 is x: a pass over [N, V] saved
        logits = logits / temperature
    logits = filter_logits(logits, top_k=top_k, top_p=top_p)
    if uniform is None:
        uniform = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    # logits + -log(-log(u)), as logits - log(-log(u)) (IEEE subtraction is addition of the
    # negation, so the same bits) in place on one new buffer: the same kernels as out of place
    # without allocating a fresh [N, V] float64 tensor per operation.
    gumbel = uniform.clamp_min(torch.finfo(torch.float64).tiny).log_().neg_().log_()
    return torch.sub(logits, gumbel, out=gumbel).argmax(dim=-1)
