"""The demo's yardstick: what a model that ignores all context scores on the same validation blocks.

`SpreadBlocks` picks blocks spread evenly over the validation split, `unigram_bits_per_byte` scores
add-one unigram frequencies of the training tokens on them, and `unigram_verdict` says when a
trained model ends no better than that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

UNIGRAM_MARGIN = 0.02  # bits per byte: a model this close to its unigram level learned next to nothing


class SpreadBlocks:
    """`count` blocks spread evenly over a packed split, so that an evaluation of part of the
    validation split covers all three plays, not the first act of Hamlet."""

    def __init__(self, dataset: Any, count: int):
        self.dataset, self.metadata = dataset, dataset.metadata
        self.indices = sorted({round(i * (len(dataset) - 1) / max(1, count - 1)) for i in range(count)})

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[self.indices[index]]


def unigram_bits_per_byte(data_dir: Path, blocks: Sequence[int], token_bytes: Any = None) -> float | None:
    """Bits per byte of add-one unigram frequencies of the training tokens on these validation
    blocks: the level of a model that ignores all context. The bytes are those of exactly these
    blocks, from `token_bytes` (UTF-8 bytes per id) or the data's own tokenizer.json."""

    import numpy as np

    from dlm.data import load_packed_dataset
    from dlm.evaluate import packed_token_bytes

    train, val = load_packed_dataset(data_dir, split="train"), load_packed_dataset(data_dir, split="val")
    if token_bytes is None:
        token_bytes, _ = packed_token_bytes(val.metadata, [data_dir / "tokenizer.json"])
    counts = np.bincount(np.asarray(train.tokens).ravel(), minlength=int(train.metadata["vocab_size"])) + 1.0
    log_probability = np.log(counts / counts.sum())
    evaluated = np.asarray(val.tokens[list(blocks)]).ravel()
    text_bytes = None if token_bytes is None else int(np.asarray(token_bytes)[evaluated].sum())
    return None if not text_bytes else float(-log_probability[evaluated].sum() / (text_bytes * math.log(2)))


def unigram_verdict(bits_per_byte: float | None, unigram: float | None) -> str | None:
    """What to say when the model is no better than token frequencies on the held-out text."""

    if bits_per_byte is None or unigram is None or bits_per_byte < unigram - UNIGRAM_MARGIN:
        return None
    return (
        f"the model ends at the unigram level ({bits_per_byte:.3f} bits per byte against {unigram:.3f} from "
        "token frequencies alone): it has learned next to nothing about context. Train longer (a larger "
        "--minutes continues this run) or on a GPU, train a smaller model (--config), or check the data"
    )
