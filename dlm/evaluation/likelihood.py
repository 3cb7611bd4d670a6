"""From scored tokens to the likelihood figures `dlm eval` reports.

Bits per byte divide by the exact UTF-8 bytes of the tokens scored: `packed_token_bytes` finds the
byte table of the tokenizer the data was packed with (by its sha256), `scored_counts` counts tokens
and their bytes, and `likelihood_figures` turns per-sequence Monte Carlo means into the NLL, its
standard errors, the perplexity bound and bits per byte.

The NLL is total NLL over total tokens: each sequence's per-token mean is weighted by its scored
tokens. Plain text has the same number in every sequence, so this is the plain mean there; in
instruction data a 4-token reply and a 14-token one would otherwise count alike, and NLL x tokens
would no longer be the total NLL that bits per byte divide by the bytes. Its standard error is the
ratio estimator's, sequences being the sampled units.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dlm.data.tokenizer import load_tokenizer, token_byte_lengths, tokenizer_sha256
from dlm.diffusion.objective import Batch, split_batch
from dlm.errors import UserError


def packed_token_bytes(
    metadata: Mapping[str, Any] | None, candidates: Iterable[Path]
) -> tuple[np.ndarray | None, str | None]:
    """The per-id byte table (`token_byte_lengths`) of the first tokenizer file among `candidates`
    whose sha256 is the one the pack metadata records, or (None, why bits per byte are skipped).

    Only the tokenizer the data was packed with decodes its ids to the right bytes, hence the hash.
    """

    expected = (metadata or {}).get("tokenizer_sha256")
    if not expected:
        return None, "bits per byte skipped: the data records no tokenizer hash (pass token_bytes, or pack it)"
    looked = []
    for candidate in candidates:
        if candidate.is_file() and tokenizer_sha256(candidate) == expected:
            return token_byte_lengths(load_tokenizer(candidate)), None
        looked.append(str(candidate))
    where = ", ".join(looked) or "nowhere"
    return None, f"bits per byte skipped: no tokenizer.json with the data's sha256 (looked at {where})"


def byte_table(token_bytes: Any, dataset: Any, metadata: Mapping[str, Any] | None) -> tuple[Tensor | None, str | None]:
    """`token_bytes` as a tensor; without it, the table of the tokenizer beside a packed dataset."""

    if token_bytes is not None:
        return torch.as_tensor(np.asarray(token_bytes), dtype=torch.int64), None
    path = getattr(dataset, "path", None)
    table, why = packed_token_bytes(metadata, [Path(path).parent / "tokenizer.json"] if path else [])
    return (None, why) if table is None else (torch.from_numpy(table), None)


def scored_counts(batches: Iterable[Batch], table: Tensor | None) -> tuple[Tensor, int | None]:
    """Tokens scored in each sequence, [S] (with a loss mask, the response tokens only), and the
    exact UTF-8 bytes they all decode to (None without a byte table)."""

    counts, text_bytes = [], 0
    for batch in batches:
        clean, loss_mask = split_batch(batch)
        counts.append(torch.full(clean.shape[:1], clean.shape[1]) if loss_mask is None else loss_mask.sum(dim=1))
        clean = clean if loss_mask is None else clean[loss_mask.bool()]
        if table is not None and clean.numel():
            if int(clean.max()) >= table.numel():
                raise UserError(
                    f"the data holds token id {int(clean.max())}, beyond the tokenizer's {table.numel()} ids",
                    fix="evaluate on data packed with the model's tokenizer",
                )
            text_bytes += int(table[clean].sum())
    together = torch.cat(counts) if counts else torch.zeros(0, dtype=torch.long)
    return together.long(), None if table is None else text_bytes


def likelihood_figures(
    means: Tensor, errors: Tensor, counts: Tensor, mc_samples: int, text_bytes: int | None, notes: list[str]
) -> dict[str, Any]:
    """NLL, its two standard errors, the perplexity bound and bits per byte from per-sequence
    Monte Carlo means per token [S] and their standard errors [S] over `counts` [S] scored tokens
    per sequence, which decode to `text_bytes` UTF-8 bytes in all; reasons for missing figures go
    to `notes`. Sequences without a scored token carry no information and are left out."""

    scored = counts > 0
    weights, means, errors = counts[scored].double(), means[scored].double(), errors[scored].double()
    sequences, tokens = int(weights.numel()), int(weights.sum())
    if tokens == 0:
        raise ValueError("no sequence holds a scored token")
    if sequences < counts.numel():
        notes.append(
            f"{counts.numel() - sequences} of {counts.numel()} sequences hold no scored token (a loss mask "
            "of zeros): left out"
        )
    nll = float((weights * means).sum() / tokens)
    # Ratio estimator of total NLL / total tokens over sequences drawn at random: its residuals
    # are each sequence's NLL minus what the pooled rate predicts for its tokens. Sequences and
    # Monte Carlo samples together: each sequence mean already carries its MC noise.
    residuals = weights * (means - nll)
    spread = residuals.pow(2).sum() * sequences / (sequences - 1) if sequences > 1 else None
    stderr = None if spread is None else float(spread.sqrt() / tokens)
    # The Monte Carlo part alone: the error of the weighted mean of S independent estimates.
    mc_stderr = float((weights * errors).pow(2).sum().sqrt() / tokens) if mc_samples > 1 else None
    if mc_samples == 1:
        notes.append("--mc-samples 1: no Monte Carlo standard error")
    if text_bytes == 0:
        notes.append("bits per byte skipped: the scored tokens decode to no text (only special tokens)")
    to_bits = tokens / (text_bytes * math.log(2)) if text_bytes else None
    return {
        "sequences": sequences,
        "nll": nll,
        "nll_stderr": stderr,
        "nll_mc_stderr": mc_stderr,
        "perplexity_bound": math.exp(min(nll, 700.0)),  # exp overflows a double past ~709
        "bits_per_byte": None if to_bits is None else nll * to_bits,
        "bits_per_byte_stderr": None if to_bits is None or stderr is None else stderr * to_bits,
        "tokens": tokens,
        "bytes": text_bytes,
    }
