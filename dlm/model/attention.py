"""Attention patterns of block diffusion and the kernel that applies them.

A block model (`[model] block_size = B`) cuts the sequence into blocks of B positions: a query
attends to every key of its own block and of earlier blocks (block-causal). Training and evaluation
score all blocks in one forward pass over 2L tokens, the noisy copy followed by the clean copy
(BD3-LM), with the pattern

    noisy block b sees noisy block b and clean blocks < b;  clean block b sees clean blocks <= b.

This module is the only place that knows these patterns and picks the kernel; the transformer's
`Block` only calls `attend(q, k, v, mask)`. The contract of an `AttentionMask`: it covers queries
[query_start, query_end) against keys [0, key_end) of the same forward pass (or of the KV cache
followed by it); `mask is None` means every query sees every key (plain bidirectional attention,
the unmasked SDPA call that a whole-sequence model has always made).

Kernels: `flex` (`torch.nn.attention.flex_attention` with a block-sparse mask, compiled) where it
has a backward pass, which is CUDA; `sdpa-mask` (scaled_dot_product_attention with a boolean mask)
elsewhere; `sdpa` when there is no mask at all. FlexAttention has no backward on the CPU, so the
CPU always takes `sdpa-mask`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# The flex functions, or None on a torch without them.
create_block_mask: Any
flex_attention: Any
try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch
    create_block_mask = flex_attention = None

_compiled_flex: Any = None


@dataclass(frozen=True)
class AttentionMask:
    """Which keys each query sees, in the form the chosen kernel takes."""

    kernel: str  # "sdpa", "sdpa-mask", "sdpa-causal" or "flex"
    mask: Any = None  # None (all keys), a [queries, keys] bool tensor, or a flex BlockMask


def training_kernel(device: torch.device) -> str:
    """The kernel of the 2L training / evaluation pass on `device`: flex where it can run backward."""

    return "flex" if flex_attention is not None and device.type == "cuda" else "sdpa-mask"


def _block_of(index: Tensor, length: int, block_size: int) -> Tensor:
    # Positions of the clean copy (index >= length) repeat those of the noisy copy.
    return (index % length) // block_size


def bd3_allowed(query: Tensor, key: Tensor, length: int, block_size: int) -> Tensor:
    """Whether query index `query` sees key index `key` in the 2L pass (indices broadcast)."""

    return _bd3_rule(
        _block_of(query, length, block_size), _block_of(key, length, block_size), query < length, key < length
    )


def _bd3_rule(query_block: Tensor, key_block: Tensor, query_noisy: Tensor, key_noisy: Tensor) -> Tensor:
    # A noisy query sees its own block's noisy keys and earlier blocks' clean ones; a clean query sees
    # clean keys up to its own block.
    noisy_query = query_noisy & ((key_noisy & (key_block == query_block)) | (~key_noisy & (key_block < query_block)))
    clean_query = ~query_noisy & ~key_noisy & (key_block <= query_block)
    return noisy_query | clean_query


def padded_bd3_mask(length: int, block_size: int, pad: Tensor) -> AttentionMask:
    """The 2L pass's mask for a left-padded batch, [B, 1, 2L, 2L]: row b's blocks count from its first real
    token (column `pad[b]` of each copy), so a row scores as it would unpadded whatever its padding; no
    real query sees a padding key, and padding queries (whose outputs are never used) see every key, so
    none is NaN."""

    index = torch.arange(2 * length, device=pad.device)
    column = (index % length)[None, :] - pad[:, None]  # [B, 2L]: the position from the row's first real token
    block = torch.div(column, block_size, rounding_mode="floor")
    noisy = (index < length)[None, :]
    allowed = _bd3_rule(block[:, :, None], block[:, None, :], noisy[:, :, None], noisy[:, None, :])
    real_key, padding_query = column[:, None, :] >= 0, column[:, :, None] < 0
    return AttentionMask("sdpa-mask", ((allowed & real_key) | padding_query)[:, None])


@lru_cache(maxsize=32)
def _bd3_bool(length: int, block_size: int, device: torch.device) -> Tensor:
    index = torch.arange(2 * length, device=device)
    return bd3_allowed(index[:, None], index[None, :], length, block_size)


@lru_cache(maxsize=32)
def _bd3_flex(length: int, block_size: int, device: torch.device, queries: int = 0) -> Any:
    def mask_mod(batch: Tensor, head: Tensor, query: Tensor, key: Tensor) -> Tensor:
        return bd3_allowed(query, key, length, block_size)

    return create_block_mask(mask_mod, None, None, queries or 2 * length, 2 * length, device=device)


def bd3_mask(length: int, block_size: int, device: torch.device, noisy_queries_only: bool = False) -> AttentionMask:
    """The mask of the 2L pass over a noisy and a clean copy of `length` tokens; with
    `noisy_queries_only`, of the noisy copy's `length` queries against all 2L keys."""

    if training_kernel(device) == "flex":  # a flex block mask cannot be sliced by query: built to size
        return AttentionMask("flex", _bd3_flex(length, block_size, device, length if noisy_queries_only else 0))
    mask = _bd3_bool(length, block_size, device)
    return AttentionMask("sdpa-mask", mask[:length] if noisy_queries_only else mask)


@lru_cache(maxsize=64)
def block_causal_mask(
    query_start: int, query_end: int, block_size: int, device: torch.device, key_start: int = 0
) -> AttentionMask:
    """Queries [query_start, query_end) against keys [key_start, query_end): a key is seen from its block on.

    Queries inside one block see every key (their own block and all earlier ones): no mask at all.
    `key_start` > 0 is a cache whose oldest keys a sliding window dropped.
    """

    if query_start // block_size == (query_end - 1) // block_size:
        return AttentionMask("sdpa")
    query = torch.arange(query_start, query_end, device=device) // block_size
    key = torch.arange(key_start, query_end, device=device) // block_size
    return AttentionMask("sdpa-mask", key[None, :] <= query[:, None])


@lru_cache(maxsize=32)
def causal_mask(length: int, device: torch.device) -> AttentionMask:
    """Each of `length` queries sees itself and the keys before it: an autoregressive model's one pass.

    The kernel is SDPA's own causal one (no mask tensor to read); the boolean mask rides along for
    what narrows it further (documents, a cut to some queries)."""

    index = torch.arange(length, device=device)
    return AttentionMask("sdpa-causal", index[None, :] <= index[:, None])


@dataclass(frozen=True)
class AttentionAnneal:
    """The attention of a causal model on its way to bidirectional (DiffuLLaMA's mask annealing): a
    query sees every key before it and each later key with probability `fraction`, one draw per
    query-key pair for the whole batch, seeded so that a resumed run draws the same masks."""

    fraction: float  # of the keys after a query that it sees: 0 is causal, 1 bidirectional
    seed: int

    def mask(self, length: int, device: torch.device) -> AttentionMask:
        generator = torch.Generator().manual_seed(self.seed)
        index = torch.arange(length)
        seen = (index[None, :] <= index[:, None]) | (torch.rand(length, length, generator=generator) < self.fraction)
        return AttentionMask("sdpa-mask", seen.to(device))


def document_ids(tokens: Tensor, separator: int) -> Tensor:
    """Each position's document [B, L] in rows of packed documents: the separator (the end-of-document
    token the packer writes after every document) belongs to the document it closes."""

    ends = (tokens == separator).long()
    return ends.cumsum(dim=1) - ends


def same_document(base: AttentionMask | None, documents: Tensor, queries: int) -> AttentionMask:
    """`base` limited to keys of each query's own document, as a boolean mask [B, 1, queries, keys].

    `documents` [B, keys] holds the document of every key; the queries are the first `queries` keys
    (the 2L pass repeats the row's documents for its clean copy). A query always sees itself, so no
    row of the mask is empty.
    """

    allowed = documents[:, :queries, None] == documents[:, None, :]
    if base is not None and base.mask is not None:
        allowed = allowed & base.mask
    return AttentionMask("sdpa-mask", allowed[:, None])


def same_document_flex(
    documents: Tensor, queries: int, length: int, block_size: int, causal: bool = False
) -> AttentionMask:
    """`same_document` as a flex block mask (built per batch: the documents differ row by row); with
    `block_size` > 0 on top of the 2L BD3 pattern over `length` tokens, with `causal` on top of the
    causal pattern, else over all keys."""

    def mask_mod(batch: Tensor, head: Tensor, query: Tensor, key: Tensor) -> Tensor:
        same = documents[batch, query] == documents[batch, key]
        if causal:
            return same & (key <= query)
        return same & bd3_allowed(query, key, length, block_size) if block_size else same

    rows, keys = documents.shape
    return AttentionMask("flex", create_block_mask(mask_mod, rows, None, queries, keys, device=documents.device))


def padded_mask(
    base: AttentionMask | None,
    pad: Tensor,
    query_start: int,
    queries: int,
    keys: int,
    pad_keys: Tensor,
    pad_after: Tensor | None = None,
) -> AttentionMask:
    """`base` for a left-padded batch: row b's first `pad_keys[b]` keys (its padding) are seen by no
    query but its own padding (columns < `pad[b]`), whose outputs are never used; a query seeing no
    key at all would be NaN, and NaN values leak even through zero attention weights. `pad_after[b]`
    right-pads the queries (the last keys): its last queries and keys are padding too, seen by no real
    query; they see every key `base` lets them see (every key but the left padding without `base`)."""

    key = torch.arange(keys, device=pad.device)
    query = torch.arange(query_start, query_start + queries, device=pad.device)
    allowed = (key[None, None, :] >= pad_keys[:, None, None]) | (query[None, :, None] < pad[:, None, None])
    if pad_after is not None:
        padding_query = query[None, :, None] >= query_start + queries - pad_after[:, None, None]
        allowed = allowed & ((key[None, None, :] < keys - pad_after[:, None, None]) | padding_query)
        if base is not None and base.mask is not None:
            return AttentionMask("sdpa-mask", ((allowed & base.mask) | padding_query)[:, None])
    if base is not None and base.mask is not None:
        allowed = allowed & base.mask
    return AttentionMask("sdpa-mask", allowed[:, None])  # [B, 1 (heads), queries, keys]


def attend(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None, groups: int = 1) -> Tensor:
    """softmax(q k^T / sqrt(D)) v over the keys `mask` allows; q, k, v are [B, H, L, D], or with `groups`
    query heads to each key / value head (grouped-query attention), k and v [B, H / groups, L, D]."""

    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    if mask is not None and mask.kernel == "sdpa-causal" and q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if mask is None or mask.mask is None:
        # is_causal=False lets flash / memory-efficient kernels serve full bidirectional attention
        # without materialising an L x L mask.
        return F.scaled_dot_product_attention(q, k, v, is_causal=False)
    if mask.kernel == "flex":
        global _compiled_flex
        if _compiled_flex is None:  # compiled once per process: eager flex is a slow reference
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=mask.mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.mask)


@dataclass
class KVCache:
    """Keys and values [B, H, P, D] of each layer for the first P positions of a sequence.

    A block model's earlier blocks are clean and see nothing after them, so their keys and values
    never change: sampling stores them once (`committing = True`) and later passes feed only the
    block being denoised, which reads the stored prefix (`committing = False`). With `keep`, a
    committing pass stores only its first `keep` positions: the finished blocks it feeds before the
    block being denoised, whose first step then shares their pass.
    """

    layers: list[tuple[Tensor, Tensor] | None] = field(default_factory=list)
    length: int = 0  # the position (column) after the cached ones: where the next tokens go
    committing: bool = False
    dropped: int = 0  # leading positions a sliding window removed (`trim`)
    keep: int | None = None  # positions a committing pass stores (None: all it feeds)

    @property
    def stored(self) -> int:
        """Keys held per layer."""

        first = self.layers[0] if self.layers else None
        return 0 if first is None else first[0].shape[2]

    def trim(self, keep: int, block_size: int) -> None:
        """Drop the oldest keys, whole blocks of `block_size`, until at most `keep` are held."""

        excess = self.stored - keep
        if excess <= 0:
            return
        drop = -(-excess // block_size) * block_size
        self.layers = [None if kv is None else (kv[0][:, :, drop:], kv[1][:, :, drop:]) for kv in self.layers]
        self.dropped += drop

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's stored keys and values followed by `k`, `v`; stored if committing."""

        stored = self.layers[layer] if layer < len(self.layers) else None
        end = k.shape[2] if self.keep is None else self.keep
        if stored is not None:
            end += stored[0].shape[2]
            k, v = torch.cat((stored[0], k), dim=2), torch.cat((stored[1], v), dim=2)
        if self.committing:  # a pass that only reads leaves the cache as it was, empty layers included
            while len(self.layers) <= layer:
                self.layers.append(None)
            self.layers[layer] = (k[:, :, :end], v[:, :, :end])
        return k, v

    def select(self, rows: Tensor) -> KVCache:
        """The cache of the sequences `rows` of the batch (a view for a sub-batch)."""

        if rows.dtype == torch.bool:  # one nonzero for all layers, not one per tensor
            rows = rows.nonzero().squeeze(1)
        layers = [
            None if kv is None else (kv[0].index_select(0, rows), kv[1].index_select(0, rows)) for kv in self.layers
        ]
        return KVCache(layers, self.length, self.committing, self.dropped, self.keep)
