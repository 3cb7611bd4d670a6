"""The cohort's block-model rows: each row's keys in its own slot of a `KVPool`, each step a `PoolPass`.

A block model's sampler alone keeps a `KVCache` of its finished blocks and feeds the block it denoises
(`dlm.sampling.block_model`). In the cohort (`dlm.serving.cohort`) every row's keys stay in place in a
preallocated pool instead (`dlm.model.kv_pool`), slot = the row's place in the cohort: rows join at the
end, and when some leave the rest move up (a copy once per request that ends, not once per pass). Each
row knows how many of its own positions its slot holds (`stored`); a step's call feeds each of its rows
from there to the end of the row's block, and once that pass has run, the positions before the block
are final and held (the block's own keys are overwritten by the row's next pass, which feeds it again).

A row's own positions count from its first token, as the model numbered them in training and as a
padded batch numbers them alone (`DiffusionTransformer.forward(pad=...)`). A block model's prompts are
left-padded by whole blocks (`dlm.sampling.prompt_batch.prompt_offsets`), so a row's blocks are the
model's blocks of its own positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dlm.model.kv_pool import KVPool, PoolPass
from dlm.runtime.memory import is_out_of_memory
from dlm.serving.passes import Call, OutOfMemory


class PooledRows:
    """The pool and every cohort row's held positions. Runs on the engine's thread only."""

    def __init__(self, context: int, block_size: int) -> None:
        self.pool = KVPool(context)
        self.block_size = block_size
        self.stored: list[int] = []  # per cohort row: its own positions its slot holds
        self._fed: list[tuple[Call, list[int], list[int]]] = []  # this round's calls, their rows, what each then holds

    def join(self, rows: int, positions: int) -> None:
        """`rows` new rows at the end, their slots empty, with room for `positions` positions each; where the
        pool cannot grow that far, `OutOfMemory` and nothing changed."""

        try:
            self.pool.reserve(len(self.stored) + rows, positions)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            raise OutOfMemory("the request's keys do not fit the device's memory now; retry later") from exc
        self.stored += [0] * rows

    def keep(self, rows: list[int]) -> None:
        """Keep the cohort rows `rows` (in that order) as rows 0, 1, ...: the others have left."""

        self.stored = [self.stored[row] for row in rows]
        self.pool.keep(rows)

    def clear(self) -> None:
        self.stored, self._fed = [], []

    def call(self, tokens: Tensor, reveal: Tensor, rows: list[int], origins: list[int], ends: list[int]) -> Call:
        """The call of a step of the cohort rows `rows`: each fed from its held positions to `ends` (its block's
        end, in its own positions; `origins` are the cohort columns of its position 0), with logits at what
        `reveal` [cohort rows, columns] marks. The positions before each row's block are held once it has run.

        A row that feeds its block after the one just finished (or a prompt of at most a block) feeds them as
        two rows of one block each over the same slot: a pass writes every row's keys into the pool before
        any row reads them, so the block sees the finished one's keys of the same pass, and the pass is one
        block wide instead of padded to its widest row. A longer prompt is fed whole, as one row (as many
        rows of a block each would each read the whole prompt's keys): such calls share a pass of their
        own (`Call.group`)."""

        block = self.block_size
        spans = [end - self.stored[row] for row, end in zip(rows, ends, strict=True)]
        step = block if max(spans) <= 2 * block else max(spans)
        slots, starts, row_ends, first_columns, last_columns = [], [], [], [], []
        for row, origin, end in zip(rows, origins, ends, strict=True):
            for start in range(self.stored[row], end, step):
                slots.append(row)
                starts.append(start)
                row_ends.append(end)
                first_columns.append(origin + start)
                last_columns.append(origin + end)
        width = max(min(step, end - start) for start, end in zip(starts, row_ends, strict=True))
        device = tokens.device
        columns = torch.tensor(first_columns, device=device)[:, None] + torch.arange(width, device=device)
        real = columns < torch.tensor(last_columns, device=device)[:, None]
        columns = columns.clamp_max(tokens.shape[1] - 1)  # a row's block cut short where its sequence ends
        index = torch.tensor(slots, dtype=torch.long, device=device)
        fed = tokens.index_select(0, index).gather(1, columns)
        outputs = reveal.index_select(0, index).gather(1, columns) & real
        call = Call(fed, outputs, PoolPass(self.pool, slots, starts, row_ends, block), None)
        self._fed.append((call, rows, [(end - 1) // block * block for end in ends]))
        return call

    def settled(self) -> None:
        """After the round's passes: each row whose pass ran holds the positions before its block."""

        for call, rows, held in self._fed:
            if call.done and call.error is None:
                for row, positions in zip(rows, held, strict=True):
                    self.stored[row] = positions
        self._fed = []
