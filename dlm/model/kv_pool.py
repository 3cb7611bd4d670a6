"""A preallocated pool of keys and values, one slot per sequence: many block-model sequences in shared passes.

A block model's sampler keeps the keys and values of a sequence's finished blocks (`KVCache`) and feeds
only the block being denoised. A server advancing many sequences at once would, with one `KVCache`
each, pad and concatenate all of them into one cache for every shared pass and cut them back after
it: two copies of every live key per step. The pool instead holds every sequence's keys in place, in
its own slot (a row of one tensor per layer, `[slots, kv_heads, context + 1, head_dim]`), and a pass
(`PoolPass`) writes the keys of the positions it feeds straight into their slots' columns and attends
over the slots as they stand: no key is copied but the fed ones.

In a pass each row feeds the positions [start, end) of its own sequence (numbered from its first
token, as the model numbered them in training): the finished blocks not yet in its slot, then the
block being denoised. Rows of different widths share the pass right-padded; the padding's keys go to
a scratch column past the context that no query reads. A query at position p sees the keys of its
row's positions c < end with block(c) <= block(p): the block-causal pattern of
`dlm.model.attention.block_causal_mask`, per row. The keys written for the block being denoised are
overwritten by the row's next pass, which feeds that block again; the caller says which positions
are final (`PoolPass.starts` of the next pass), as the sampler says it with `KVCache.keep`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dlm.model.attention import AttentionMask


@dataclass
class KVPool:
    """Keys and values of `slots` sequences of up to `context` positions each, for every layer.

    The tensors are made at a layer's first write (then the keys' dtype and device are known) and grow
    by doubling as sequences join (`reserve`); sequences that leave give their slots back (`keep`).
    """

    context: int
    slots: int = 0
    layers: list[tuple[Tensor, Tensor] | None] = field(default_factory=list)

    @property
    def scratch(self) -> int:
        """The column the padding's keys are written to: past every position, read by no query."""

        return self.context

    def reserve(self, slots: int) -> None:
        """Room for at least `slots` sequences; the slots held keep their keys."""

        if slots <= self.slots:
            return
        grown = max(slots, 2 * self.slots)
        self.layers = [None if kv is None else (_grown(kv[0], grown), _grown(kv[1], grown)) for kv in self.layers]
        self.slots = grown

    def keep(self, slots: Tensor) -> None:
        """Keep the sequences of `slots` (in that order) as slots 0, 1, ...: those that left give theirs back."""

        count = int(slots.numel())
        for kv in self.layers:
            if kv is not None and count:
                for tensor in kv:
                    tensor[:count] = tensor.index_select(0, slots.to(tensor.device))

    def layer(self, index: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values of layer `index`, made like `like` ([rows, kv_heads, width, head_dim]) if new."""

        while len(self.layers) <= index:
            self.layers.append(None)
        held = self.layers[index]
        if held is None:
            shape = (self.slots, like.shape[1], self.context + 1, like.shape[3])
            held = (like.new_zeros(shape), like.new_zeros(shape))
            self.layers[index] = held
        return held


def _grown(tensor: Tensor, slots: int) -> Tensor:
    grown = tensor.new_zeros((slots, *tensor.shape[1:]))
    grown[: tensor.shape[0]] = tensor
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
    _in_order: bool | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def _consecutive(self) -> bool:
        """Whether the rows are consecutive slots (the common case: every live sequence steps)."""

        if self._in_order is None:
            first = self.slots[0]
            self._in_order = self.slots == list(range(first, first + self.rows))
        return self._in_order

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

    def _tensors(self, width: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """Each fed column's position [rows, width], each row's end [rows, 1] and slot [rows], on `device`."""

        if "positions" not in self._index or self._index["positions"].shape[1] != width:
            starts = torch.tensor(self.starts, device=device)
            self._index["positions"] = starts[:, None] + torch.arange(width, device=device)
            self._index["ends"] = torch.tensor(self.ends, device=device)[:, None]
            self._index["slots"] = torch.tensor(self.slots, device=device)
        return self._index["positions"], self._index["ends"], self._index["slots"]

    def positions(self, width: int, device: torch.device) -> Tensor:
        """The position of every fed column [rows, width]; the padding's are clamped into the context."""

        positions, _, _ = self._tensors(width, device)
        return positions.clamp_max(self.pool.context - 1)

    def mask(self, width: int, device: torch.device) -> AttentionMask:
        """Which of the slots' first max(ends) keys each fed column sees [rows, 1, width, keys]: its row's
        keys before the row's end, from its own block back (padding columns see all of those)."""

        positions, ends, _ = self._tensors(width, device)
        keys = torch.arange(max(self.ends), device=device)
        block = self.block_size
        seen = (keys[None, None, :] < ends[:, :, None]) & (
            keys[None, None, :] // block <= positions[:, :, None] // block
        )
        return AttentionMask("sdpa-mask", seen[:, None])

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the fed keys and values [rows, kv_heads, width, head_dim] of layer `layer` into their
        slots' columns (the padding's into the scratch column); the slots' first max(ends) keys and values."""

        pool_k, pool_v = self.pool.layer(layer, k)
        positions, ends, slots = self._tensors(k.shape[2], k.device)
        columns = torch.where(positions < ends, positions, self.pool.scratch)
        rows = slots[:, None]
        pool_k[rows, :, columns] = k.transpose(1, 2).to(pool_k.dtype)
        pool_v[rows, :, columns] = v.transpose(1, 2).to(pool_v.dtype)
        keys, first = max(self.ends), self.slots[0]
        if self._consecutive:  # a view of the pool, no copy
            return pool_k[first : first + self.rows, :, :keys], pool_v[first : first + self.rows, :, :keys]
        return pool_k[:, :, :keys].index_select(0, slots), pool_v[:, :, :keys].index_select(0, slots)
