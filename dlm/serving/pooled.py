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

from typing import NamedTuple

import torch
from torch import Tensor

from dlm.model.kv_pool import KVPool, PoolPass
from dlm.runtime.memory import is_out_of_memory
from dlm.serving.member import Member
from dlm.serving.passes import Call, OutOfMemory


class _Feed(NamedTuple):
    """A step's rows as fed: its cohort rows and what each holds once the call has run; each fed row's slot,
    start and end (its own positions), first and last cohort column; how far a fed row reaches."""

    rows: list[int]
    held: list[int]
    slots: list[int]
    starts: list[int]
    ends: list[int]
    columns: list[tuple[int, int]]
    reach: int


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

    def calls(self, tokens: Tensor, reveal: Tensor, members: list[Member]) -> list[Call]:
        """The call of each member's step in the cohort's `tokens`: its rows that reveal something, each fed
        from its held positions to its block's end, with logits at what `reveal` [cohort rows, columns]
        marks; the positions before each row's block are held once its call has run. All calls' tokens are
        gathered with one index.

        A row that feeds its block after the one just finished (or a prompt of at most a block) feeds them as
        two rows of one block each over the same slot: a pass writes every row's keys into the pool before
        any row reads them, so the block sees the finished one's keys of the same pass, and the pass is one
        block wide instead of padded to its widest row. A longer prompt is fed whole, as one row (as many
        rows of a block each would each read the whole prompt's keys): such calls share a pass of their
        own (`Call.group`)."""

        feeds = [self._feed(member, int(tokens.shape[1])) for member in members]
        calls: dict[int, Call] = {}
        for whole in (False, True):  # the calls a block wide, then those of prompts fed whole
            chosen = [index for index, feed in enumerate(feeds) if (feed.reach > self.block_size) == whole]
            if chosen:
                gathered = self._gathered(tokens, reveal, [feeds[index] for index in chosen])
                calls.update(zip(chosen, gathered, strict=True))
        return [calls[index] for index in range(len(feeds))]

    def _feed(self, member: Member, width: int) -> _Feed:
        """`member`'s step as fed, in a cohort `width` columns wide: each of its rows that reveal something from
        its held positions to its block's end (its own positions count from its prompt's leading padding,
        whole blocks)."""

        block, n = self.block_size, member.job.generation.n
        shift, block_end = width - member.width, member.blocks[member.block][1]
        rows = [member.first + row for row, count in enumerate(member.counts) if count]
        offsets = [member.offsets[row // n] for row, count in enumerate(member.counts) if count]
        ends = [block_end - offset for offset in offsets]
        spans = [end - self.stored[row] for row, end in zip(rows, ends, strict=True)]
        reach = block if max(spans) <= 2 * block else max(spans)
        feed = _Feed(rows, [(end - 1) // block * block for end in ends], [], [], [], [], reach)
        for row, offset, end in zip(rows, offsets, ends, strict=True):
            for start in range(self.stored[row], end, reach):
                feed.slots.append(row)
                feed.starts.append(start)
                feed.ends.append(end)
                feed.columns.append((shift + offset + start, shift + offset + end))
        return feed

    def _gathered(self, tokens: Tensor, reveal: Tensor, feeds: list[_Feed]) -> list[Call]:
        """The calls of `feeds`, their tokens and output positions gathered together, as wide as the widest."""

        width = max(
            min(feed.reach, end - start) for feed in feeds for start, end in zip(feed.starts, feed.ends, strict=True)
        )
        device = tokens.device
        bounds = torch.tensor([bound for feed in feeds for bound in feed.columns], device=device)
        columns = bounds[:, :1] + torch.arange(width, device=device)
        real = columns < bounds[:, 1:]
        columns = columns.clamp_max(tokens.shape[1] - 1)  # a row's block cut short where its sequence ends
        rows = torch.tensor([slot for feed in feeds for slot in feed.slots], device=device)[:, None]
        fed, outputs = tokens[rows, columns], reveal[rows, columns] & real
        calls = []
        sizes = [len(feed.slots) for feed in feeds]
        for feed, own_fed, own_outputs in zip(feeds, fed.split(sizes), outputs.split(sizes), strict=True):
            step = PoolPass(self.pool, feed.slots, feed.starts, feed.ends, self.block_size)
            calls.append(Call(own_fed, own_outputs, step, None))
            self._fed.append((calls[-1], feed.rows, feed.held))
        return calls

    def settled(self) -> None:
        """After the round's passes: each row whose pass ran holds the positions before its block."""

        for call, rows, held in self._fed:
            if call.done and call.error is None:
                for row, positions in zip(rows, held, strict=True):
                    self.stored[row] = positions
        self._fed = []
