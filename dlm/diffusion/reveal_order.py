"""The dilated reveal order: which positions a few-step sampler reveals together.

A step of the reverse process draws the tokens it reveals independently of each other, so text
revealed several tokens a step reads worse than text revealed one a step wherever tokens revealed
together depend on each other. In text, near tokens depend on each other most. The dilated order
(Luxembourg et al., 2025, "Plan for Speed: Dilated Scheduling for Masked Diffusion Language Models")
plans the reveals so that each step's positions lie as far apart as they can: `--remasking dilated`
samples in it (`dlm.sampling.reverse`), and `dlm distill --remasking dilated` trains a student for it
(`dlm.diffusion.distillation.planned_masks`).
"""

from __future__ import annotations

import torch


def dilated_order(size: int) -> torch.Tensor:
    """The ranks 0 .. size - 1 in the order `--remasking dilated` reveals them: by their bit-reversed binary
    digits (the van der Corput sequence), so that 0, size / 2, size / 4, 3 size / 4, ... come first.
    Any run of consecutive entries is spread out evenly: at 8 positions a step out of 64, a step's
    positions lie 8 apart, and a position revealed late has its neighbours revealed before it. The
    positions a step reveals together are drawn independently of each other; far apart, in text they
    depend on each other least."""

    bits = max(1, (size - 1).bit_length())
    ranks = torch.arange(size)
    reversed_bits = torch.zeros_like(ranks)
    for bit in range(bits):
        reversed_bits |= ((ranks >> bit) & 1) << (bits - 1 - bit)
    return ranks[reversed_bits.argsort()]
