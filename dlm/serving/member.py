"""One request of the cohort (`dlm.serving.cohort`): where its rows are, where its steps are, its streams."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dlm.sampling.remasking import ANCESTRAL, DILATED
from dlm.sampling.row_noise import RowNoise
from dlm.serving.jobs import Answer, Job
from dlm.serving.passes import Call


@dataclass(eq=False)
class Member:
    """One request of the cohort: its rows (`first` .. `first + rows`), its own sequence width and
    blocks (columns of its own layout), where its steps are, and its random streams."""

    job: Job
    answer: Answer
    noise: RowNoise
    width: int  # its own sequence's columns: its longest prompt and its generated positions
    offsets: list[int]  # each prompt's leading padding within its own layout
    prompts: list[int]  # each prompt's tokens
    blocks: list[tuple[int, int]]  # [start, end) columns of its own layout
    block_steps: list[int]
    started: float = field(default_factory=time.perf_counter)
    first: int = 0  # its first row in the cohort
    block: int = 0  # the block being denoised
    index: int = 0  # the step of that block
    call: Call | None = None  # this round's model call
    counts: list[int] = field(default_factory=list)  # this round's revealed (ranked: candidate) positions per row
    keep: int = 0  # a ranked step's positions to reveal per row (the most confident of its candidates)

    @property
    def ranked(self) -> bool:
        """Whether its steps rank the masked positions by a confidence (`confidence`, `margin`, ...)."""

        return self.job.generation.options.remasking not in (ANCESTRAL, DILATED)

    @property
    def thresholded(self) -> bool:
        """Whether its steps commit every candidate above a confidence (`threshold`, whatever its order)."""

        return self.job.generation.options.threshold is not None

    @property
    def rows(self) -> int:
        return self.job.generation.rows

    @property
    def span(self) -> slice:
        return slice(self.first, self.first + self.rows)

    @property
    def done(self) -> bool:
        return self.block == len(self.blocks)

    def advance(self) -> bool:
        """One step on; whether its block changed."""

        self.index += 1
        if self.index < self.block_steps[self.block]:
            return False
        self.block, self.index = self.block + 1, 0
        return True


def staying(members: list[Member], gone: list[Member]) -> list[Member]:
    """`members` without `gone`, each member gone giving its place to the last member of as many rows (so
    that only that member's rows move), or else closing up."""

    kept = list(members)
    place = 0
    while place < len(kept):
        if kept[place] not in gone:
            place += 1
            continue
        while kept[-1] in gone and len(kept) - 1 > place:  # the members gone at the end simply drop
            kept.pop()
        if kept[-1] is not kept[place] and kept[-1].rows == kept[place].rows:
            kept[place] = kept.pop()
            place += 1
        else:
            kept.pop(place)
    return kept
