"""A preallocated pool of keys and values, one slot per sequence: many block-model sequences in shared passes.

A block model's sampler keeps the keys and values of a sequence's finished blocks (`KVCache`) and feeds
only the block being denoised. A server advancing many sequences at once would, with one `KVCache`
each, pad and concatenate all of them into one cache for every shared pass and cut them back after
it: two copies of every live key per step. The pool instead holds every sequence's keys in place, in
its own slot (a row of one tensor per layer, `[slots, positions + 1, kv_heads, head_dim]`), and a pass
(`PoolPass`) writes the keys of the positions it feeds straight into their slots' columns and attends
over the slots as they stand: no key is copied but the fed ones.

In a pass each row feeds the positions [start, end) of its own sequence (numbered from its first
token, as the model numbered them in training): the finished blocks not yet in its slot, then the
block being denoised. Rows of different widths share the pass right-padded; the padding's keys go to
a scratch column past the positions that no query reads. A query at position p sees the keys of its
row's positions c < end with block(c) <= block(p): the block-causal pattern of
`dlm.model.attention.block_causal_mask`, per row. The keys written for the block being denoised are
overwritten by the row's next pass, which feeds that block again; the caller says which positions
are final (`PoolPass.starts` of the next pass), as the sampler says it with `KVCache.keep`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dlm.model.attention import AttentionMask, attend

# Rows in at most this many phases write their keys as slices; more, with one indexed copy.
MOST_SLICE_WRITES = 4


@dataclass
class KVPool:
    """Keys and values of `slots` sequences of up to `positions` positions each (at most the model's
    `context`), for every layer.

    A layer's tensors are made at its first write (then the keys' dtype and device are known); both sizes
    grow by doubling as sequences join (`reserve`: the longest held sets the positions, not the context),
    and sequences that leave give their slots back (`keep`). Nothing shrinks: the pool holds its peak.
    """

    context: int
    slots: int = 0
    positions: int = 0
    layers: list[tuple[Tensor, Tensor] | None] = field(default_factory=list)
    # Whether a pass in which some slots feed two rows reads the others' keys in place, with a second
    # attention call for those rows (None: on an accelerator, where a copy of every row's keys is what
    # the pool is for avoiding; on a CPU the copy of a CPU-sized model's keys costs less than the call).
    read_in_place: bool | None = None

    def in_place(self, held: Tensor) -> bool:
        return held.device.type != "cpu" if self.read_in_place is None else self.read_in_place

    @property
    def scratch(self) -> int:
        """The column the padding's keys are written to: past every position, read by no query."""

        return self.positions

    def reserve(self, slots: int, positions: int) -> None:
        """Room for at least `slots` sequences of `positions` positions; the slots held keep their keys. All
        or nothing: where the memory runs out the pool is as it was."""

        if slots <= self.slots and positions <= self.positions:
            return
        if positions > self.context:
            raise ValueError(f"{positions} positions exceed the pool's context of {self.context}")
        slots = max(slots, self.slots if slots <= self.slots else 2 * self.slots)
        positions = max(
            positions, self.positions if positions <= self.positions else min(self.context, 2 * self.positions)
        )
        self.layers = [
            None
            if kv is None
            else (_grown(kv[0], slots, positions, self.positions), _grown(kv[1], slots, positions, self.positions))
            for kv in self.layers
        ]
        self.slots, self.positions = slots, positions

    def keep(self, slots: list[int]) -> None:
        """Keep the sequences of `slots` (in that order) as slots 0, 1, ...: those that left give theirs back.
        Only the sequences that change slots are copied."""

        moved = [(slot, held) for slot, held in enumerate(slots) if held != slot]
        if not moved:
            return
        into, held = (torch.tensor(side) for side in zip(*moved, strict=True))
        for kv in self.layers:
            for tensor in kv or ():
                into, held = into.to(tensor.device), held.to(tensor.device)
                tensor.index_copy_(0, into, tensor.index_select(0, held))  # read first: moves may overlap

    def layer(self, index: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values of layer `index` [slots, positions + 1, kv_heads, head_dim], made like `like`
        ([rows, kv_heads, width, head_dim]) if new. Positions before heads: a pass's keys are written as
        whole rows of the flattened (slot, position) index, one `index_copy_` a tensor."""

        while len(self.layers) <= index:
            self.layers.append(None)
        held = self.layers[index]
        if held is None:
            shape = (self.slots, self.positions + 1, like.shape[1], like.shape[3])
            held = (like.new_zeros(shape), like.new_zeros(shape))
            self.layers[index] = held
        return held


def _grown(tensor: Tensor, slots: int, positions: int, held: int) -> Tensor:
    """`tensor` [slots, held + 1, ...] with room for `slots` x (`positions` + 1): its `held` positions kept."""

    grown = tensor.new_zeros((slots, positions + 1, *tensor.shape[2:]))
    grown[: tensor.shape[0], :held] = tensor[:, :held]
    return grown


@dataclass(eq=False)
class PoolPass:
    """One forward pass over rows of a `KVPool`: row i is slot `slots[i]` and feeds its positions
    [`starts[i]`, `ends[i]`), its keys before `starts[i]` already in the slot; the model's `cache`."""

    pool: KVPool
    slots: list[int]
    starts: list[int]
    ends: list[int]
    block_size: int
    _index: dict[str, Tensor] = field(default_factory=dict, repr=False)  # the pass's index tensors, made once

    def __post_init__(self) -> None:
        self.keys = max(self.ends)  # the keys of its slot each row reads: up to the furthest end
        # Rows in step (consecutive slots, one start, one end) write their keys as a slice of the pool: a
        # few slice copies cost less than one indexed copy of as many keys (rows in two or three phases).
        self._runs = _runs_in_step(self.slots, self.starts, self.ends)
        self._slot_run = _run(self.slots)  # every row's slot read as one slice of the pool
        self._parts = _shared_slot_parts(self.slots, self.starts)

    @property
    def rows(self) -> int:
        return len(self.slots)

    @classmethod
    def together(cls, passes: list[PoolPass]) -> PoolPass:
        """The rows of `passes` (over one pool) in one pass."""

        first = passes[0]
        return cls(
            first.pool,
            [slot for each in passes for slot in each.slots],
            [start for each in passes for start in each.starts],
            [end for each in passes for end in each.ends],
            first.block_size,
        )

    def _tensors(self, width: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Each fed column's position [rows, width], each row's end [rows, 1], its slot [rows], and where each
        fed column's key goes in a layer's flattened (slot, position) index [rows x width], on `device`."""

        if "positions" not in self._index or self._index["positions"].shape[1] != width:
            starts = torch.tensor(self.starts, device=device)
            positions = starts[:, None] + torch.arange(width, device=device)
            ends = torch.tensor(self.ends, device=device)[:, None]
            slots = torch.tensor(self.slots, device=device)
            columns = torch.where(positions < ends, positions, self.pool.scratch)
            self._index.update(
                positions=positions, ends=ends, slots=slots, flat=(slots[:, None] * (self.pool.positions + 1) + columns)
            )
        index = self._index
        return index["positions"], index["ends"], index["slots"], index["flat"].reshape(-1)

    def mask(self, width: int, device: torch.device) -> AttentionMask:
        """Which of the slots' first max(ends) keys each fed column sees [rows, 1, width, keys]: its row's
        keys before the row's end, from its own block back (padding columns see all of those). Where every
        row feeds only its last block, a query sees all of its row's keys: [rows, 1, 1, keys]; and no mask
        where they also end alike (a lone request's steps, requests in step)."""

        block, keys = self.block_size, self.keys
        if min(self.ends) == keys and min(self.starts) // block == (keys - 1) // block:
            return AttentionMask("sdpa")
        positions, ends, _, _ = self._tensors(width, device)
        key = torch.arange(keys, device=device)
        if all(start // block == (end - 1) // block for start, end in zip(self.starts, self.ends, strict=True)):
            # Every row feeds its last block only, so each query sees every key of its row before the row's
            # end: one mask row per row [rows, 1, 1, keys], cheaper to build and to apply than a mask per query.
            return AttentionMask("sdpa-mask", (key[None, :] < ends)[:, None, None])
        seen = (key[None, None, :] < ends[:, :, None]) & (key[None, None, :] // block <= positions[:, :, None] // block)
        return AttentionMask("sdpa-mask", seen[:, None])

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, groups: int) -> Tensor:
        """Write the fed keys and values [rows, kv_heads, width, head_dim] of layer `layer` into their slots'
        positions (the padding's into the scratch column), then each row's queries [rows, heads, queries,
        head_dim] attend over its slot's first max(ends) keys under `mask`; `groups` query heads share a key
        head. Where the pool reads in place (`KVPool.in_place`), the rows that feed a finished block beside
        their block's row (two rows of one slot) attend in a call of their own over their slots' keys,
        gathered, so that the others read the pool where it is; elsewhere all rows' keys are gathered."""

        pool_k, pool_v = self._written(layer, k, v)
        if q.shape[2] == 0:  # keys and values only
            return q
        if self._parts is None or not self.pool.in_place(pool_k):  # a row per slot, or all gathered
            keys = self._read(pool_k, pool_v, self.slots, self._slot_run, self._index.get("slots"))
            return attend(q, *keys, mask, groups)
        attended = torch.empty_like(q)
        for part, rows in enumerate(self._parts):
            index = self._index.get(f"part_{part}")
            if index is None:
                index = self._index[f"part_{part}"] = torch.tensor(rows, device=q.device)
            part_mask = mask if mask.mask is None else AttentionMask(mask.kernel, mask.mask.index_select(0, index))
            slots = [self.slots[row] for row in rows]
            keys = self._read(pool_k, pool_v, slots, _run(slots), None)
            attended.index_copy_(0, index, attend(q.index_select(0, index), *keys, part_mask, groups))
        return attended

    def _written(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The pool's keys and values of layer `layer`, with the fed ones written."""

        pool_k, pool_v = self.pool.layer(layer, k)
        for pooled, fed in ((pool_k, k), (pool_v, v)):
            if self._runs is not None:  # copies into slices, each row's padding left out
                for rows, slots, start, end in self._runs:
                    fed_end = min(end, start + k.shape[2])  # a row of a finished block feeds one block's width
                    pooled[slots, start:fed_end].copy_(fed[rows, :, : fed_end - start].transpose(1, 2))
                continue
            keyed = fed.transpose(1, 2).reshape(-1, *pooled.shape[2:])  # [rows x width, kv_heads, head_dim]
            flat = self._tensors(k.shape[2], k.device)[3]
            pooled.view(-1, *pooled.shape[2:]).index_copy_(0, flat, keyed.to(pooled.dtype))
        return pool_k, pool_v

    def _read(
        self, pool_k: Tensor, pool_v: Tensor, slots: list[int], run: slice | None, index: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """The first max(ends) keys and values of `slots` [len(slots), kv_heads, keys, head_dim]: a view of the
        pool where the slots are consecutive (`run`, their slice), else gathered (with `index`, the slots as a
        tensor, if made)."""

        keys = self.keys
        if run is not None:
            read_k, read_v = pool_k[run, :keys], pool_v[run, :keys]
        else:
            index = torch.tensor(slots, device=pool_k.device) if index is None else index
            read_k, read_v = pool_k[:, :keys].index_select(0, index), pool_v[:, :keys].index_select(0, index)
        return read_k.transpose(1, 2), read_v.transpose(1, 2)


def _shared_slot_parts(slots: list[int], starts: list[int]) -> tuple[list[int], list[int]] | None:
    """None where every row has a slot of its own; else the rows of each slot's block (its last row) and
    those of the finished blocks fed beside them."""

    last: dict[int, int] = {}
    for row, slot in enumerate(slots):
        if slot not in last or starts[row] > starts[last[slot]]:
            last[slot] = row
    if len(last) == len(slots):
        return None
    blocks = sorted(last.values())
    return blocks, sorted(set(range(len(slots))) - set(blocks))


def _runs_in_step(
    slots: list[int], starts: list[int], ends: list[int], most: int = MOST_SLICE_WRITES
) -> list[tuple[slice, slice, int, int]] | None:
    """The rows as runs of consecutive rows over consecutive slots that feed the same positions, each as
    (its rows, its slots, start, end); None where that takes more than `most` runs."""

    runs: list[tuple[slice, slice, int, int]] = []
    first = 0
    for row in range(1, len(slots) + 1):
        same = row < len(slots) and (starts[row], ends[row]) == (starts[first], ends[first])
        if same and slots[row] == slots[row - 1] + 1:
            continue
        if len(runs) == most:
            return None
        runs.append((slice(first, row), slice(slots[first], slots[row - 1] + 1), starts[first], ends[first]))
        first = row
    return runs


def _run(slots: list[int]) -> slice | None:
    """`slots` as a slice of the pool where they are consecutive (the common case: every live sequence steps)."""

    first = slots[0]
    return slice(first, first + len(slots)) if slots == list(range(first, first + len(slots))) else None
