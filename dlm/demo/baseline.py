"""Which validation blocks the demo scores: `SpreadBlocks` picks blocks spread evenly over the
split, so that the model and its unigram level (`dlm.evaluation.unigram`) are judged on all three plays."""

from __future__ import annotations

from typing import Any


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
