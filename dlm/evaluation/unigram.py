"""The yardstick of every likelihood figure: what a model that ignores all context scores.

`unigram_table` counts the training split's tokens (add-one smoothed, in bounded chunks so a large
corpus costs no more memory than a small one), `unigram_bits_per_byte` scores those frequencies on
chosen blocks of an evaluated split, and `unigram_verdict` says when a trained model ends no better.
`dlm eval` and `dlm demo` report the level beside the model's own figure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dlm.data.dataset import load_packed_dataset, token_counts
from dlm.evaluation.likelihood import packed_token_bytes

UNIGRAM_MARGIN = 0.02  # bits per byte: a model this close to its unigram level learned next to nothing
MAX_COUNTED = 1 << 28  # a 268M-token prefix pins frequencies down far beyond the figure's 3 decimals


def unigram_table(train: Any, max_tokens: int = MAX_COUNTED) -> np.ndarray:
    """Natural-log add-one unigram probabilities of the first `max_tokens` tokens of a packed
    training split (a `PackedDataset`)."""

    counts = token_counts(train, int(train.metadata["vocab_size"]), max_tokens) + 1.0
    return np.log(counts / counts.sum())


def unigram_bits_per_byte(
    data_dir: Path, blocks: Sequence[int], token_bytes: Any = None, *, evaluated: Any = None
) -> float | None:
    """Bits per byte of add-one unigram frequencies of `data_dir`'s training tokens on these
    `blocks` of `evaluated` (default: the directory's validation split): the level of a model that
    ignores all context. The bytes are those of exactly these blocks, from `token_bytes` (UTF-8
    bytes per id) or the data's own tokenizer.json. None without a byte count."""

    train = load_packed_dataset(data_dir, split="train")
    evaluated = evaluated if evaluated is not None else load_packed_dataset(data_dir, split="val")
    if token_bytes is None:
        token_bytes, _ = packed_token_bytes(evaluated.metadata, [data_dir / "tokenizer.json"])
    if token_bytes is None or not len(blocks):
        return None
    log_probability = unigram_table(train)
    scored = np.asarray(evaluated.tokens[list(blocks)]).reshape(-1)
    text_bytes = int(np.asarray(token_bytes)[scored].sum())
    return None if not text_bytes else float(-log_probability[scored].sum() / (text_bytes * math.log(2)))


DEMO_ADVICE = (
    "Train longer (a larger --minutes continues this run) or on a GPU, train a smaller model (--config), "
    "or check the data"
)
TRAINING_ADVICE = (
    "Train longer (`dlm resume` with a larger training.max_steps) or on a GPU, train a smaller model, or check the data"
)


def unigram_verdict(bits_per_byte: float | None, unigram: float | None, advice: str = DEMO_ADVICE) -> str | None:
    """What to say, with `advice`, when the model is no better than token frequencies on the
    held-out text."""

    if bits_per_byte is None or unigram is None or bits_per_byte < unigram - UNIGRAM_MARGIN:
        return None
    return (
        f"the model ends at the unigram level ({bits_per_byte:.3f} bits per byte against {unigram:.3f} from "
        f"token frequencies alone): it has learned next to nothing about context. {advice}"
    )
