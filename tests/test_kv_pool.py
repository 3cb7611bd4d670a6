"""The KV pool: a pass over rows of the pool gives each row the logits of the model over its own prefix.

The model runs in float64; the reference is the block model's plain pass over each row's whole prefix
under the block-causal mask (no cache at all), the pass `dlm.sampling.block_model` checks its own cache
against.
"""

from __future__ import annotations

import pytest
import torch
from test_batch_sampling import transformer

from dlm.config.schema import ModelConfig
from dlm.model.attention import attend
from dlm.model.kv_pool import KVPool, PoolPass
from dlm.model.transformer import DiffusionTransformer

BLOCK, CONTEXT = 8, 48


@pytest.fixture(scope="module")
def model() -> DiffusionTransformer:
    return transformer(100, max_seq_len=CONTEXT, block_size=BLOCK)  # the sampler tests' tiny float64 model


def sequences(*lengths: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(2, 100, (length,), generator=generator) for length in lengths]


def prefix_logits(model: DiffusionTransformer, sequence: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The model's logits at positions [start, end) of `sequence`, from a pass over its first `end` tokens."""

    outputs = torch.zeros(1, end, dtype=torch.bool)
    outputs[0, start:end] = True
    return model(sequence[None, :end], output_positions=outputs)


def pooled_logits(
    model: DiffusionTransformer, pool: KVPool, slots: list[int], rows: list[torch.Tensor], spans: list[tuple[int, int]]
) -> torch.Tensor:
    """One pass over the pool: row i (slot `slots[i]`) feeds positions `spans[i]` of `rows[i]`, right-padded."""

    width = max(end - start for start, end in spans)
    tokens = torch.zeros(len(spans), width, dtype=torch.long)
    outputs = torch.zeros(len(spans), width, dtype=torch.bool)
    for row, (start, end) in enumerate(spans):
        tokens[row, : end - start] = rows[row][start:end]
        outputs[row, : end - start] = True
    step = PoolPass(pool, slots, [start for start, _ in spans], [end for _, end in spans], BLOCK)
    return model(tokens, output_positions=outputs, cache=step)


@torch.inference_mode()
def test_rows_at_different_places_in_their_sequences_get_the_logits_of_their_own_prefix(
    model: DiffusionTransformer,
) -> None:
    """Three sequences in slots out of order, fed a block at a time with different amounts held: a first
    pass of two blocks, a block re-fed (its first pass held nothing), a last block cut short mid-block."""

    rows = sequences(30, 44, 17)
    pool = KVPool(CONTEXT)
    pool.reserve(5, CONTEXT)
    slots = [3, 0, 1]
    rounds = [
        [(0, 16), (0, 24), (0, 8)],
        [(8, 24), (16, 32), (0, 16)],  # the third row feeds its first block again with its second
        [(16, 30), (24, 40), (8, 17)],  # the first and third end mid-block
        [(24, 30), (32, 44), (16, 17)],
    ]
    for spans in rounds:
        got = pooled_logits(model, pool, slots, rows, spans)
        want = torch.cat([prefix_logits(model, rows[i], start, end) for i, (start, end) in enumerate(spans)])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@torch.inference_mode()
def test_rows_in_a_few_phases_written_as_slices_and_in_many_as_one_index_read_their_own_prefix(
    model: DiffusionTransformer,
) -> None:
    """Six sequences, each feeding only its last block: in step (one run of slots), in two and three phases
    (runs written as slices, one ending mid-block, so padded), then in six phases (one indexed write)."""

    rows = sequences(40, 40, 40, 40, 37, 40)
    pool = KVPool(CONTEXT)
    pool.reserve(6, CONTEXT)
    slots = list(range(6))
    rounds = [
        [(0, 8)] * 6,
        [(8, 16)] * 3 + [(0, 8)] * 3,  # two runs; the last three re-feed their first block
        [(16, 24)] * 3 + [(8, 16)] * 3,
        [(24, 32), (24, 32), (16, 24), (16, 24), (8, 16), (8, 16)],  # three runs
        [(32, 40), (32, 40), (24, 32), (24, 32), (16, 24), (16, 24)],
        [(32, 40)] * 4 + [(24, 32)] * 2,
        [(32, 40)] * 4 + [(32, 37), (32, 40)],  # three runs, one row cut short
        [(32, 40), (24, 32), (32, 40), (24, 32), (32, 37), (32, 40)],  # six runs: past the slice writes
    ]
    for spans in rounds:
        got = pooled_logits(model, pool, slots, rows, spans)
        want = torch.cat([prefix_logits(model, rows[i], start, end) for i, (start, end) in enumerate(spans)])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    runs = [
        len(PoolPass(pool, slots, [start for start, _ in spans], [end for _, end in spans], BLOCK)._runs or ())
        for spans in rounds
    ]
    assert runs == [1, 2, 2, 3, 3, 2, 3, 0]


@torch.inference_mode()
def test_an_imported_models_variants_read_their_pool_as_their_own_prefix() -> None:
    """Grouped-query attention (the pool holds the key heads, not the query heads), q/k norms, q/k/v biases,
    an untied head and the SUBS logits, which read the fed tokens at the output positions."""

    config = ModelConfig(
        vocab_size=100,
        max_seq_len=CONTEXT,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        qk_norm=True,
        qkv_bias=True,
        tie_embeddings=False,
        mask_logit="subs",
        pad_vocab_multiple=64,
        block_size=BLOCK,
    )  # type: ignore[call-arg]
    torch.manual_seed(0)
    variant = DiffusionTransformer(config).to(torch.float64).eval()
    rows = sequences(30, 20)
    pool = KVPool(CONTEXT)
    pool.reserve(2, CONTEXT)
    for spans in ([(0, 16), (0, 8)], [(8, 24), (8, 20)], [(16, 30), (16, 20)]):
        got = pooled_logits(variant, pool, [1, 0], rows, spans)
        want = torch.cat([prefix_logits(variant, rows[i], start, end) for i, (start, end) in enumerate(spans)])
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@torch.inference_mode()
def test_slots_keep_their_keys_when_the_pool_grows_and_when_others_leave(model: DiffusionTransformer) -> None:
    rows = sequences(24, 20, 32)
    pool = KVPool(CONTEXT)
    pool.reserve(3, 32)
    pooled_logits(model, pool, [0, 1, 2], rows, [(0, 16), (0, 16), (0, 16)])
    pool.reserve(7, CONTEXT)  # grown: slots 0-2 hold what they held, with room for longer sequences
    assert pool.slots >= 7 and pool.positions == CONTEXT
    pool.keep([2, 0])  # the second sequence leaves: the third moves to slot 0, the first to 1
    got = pooled_logits(model, pool, [0, 1], [rows[2], rows[0]], [(16, 32), (16, 24)])
    want = torch.cat([prefix_logits(model, rows[2], 16, 32), prefix_logits(model, rows[0], 16, 24)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@torch.inference_mode()
def test_a_pool_pass_refuses_what_it_cannot_hold(model: DiffusionTransformer) -> None:
    pool = KVPool(CONTEXT)
    pool.reserve(1, CONTEXT)
    tokens = torch.ones(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(tokens, cache=PoolPass(pool, [0], [CONTEXT - 4], [CONTEXT + 4], BLOCK))
    whole = DiffusionTransformer(model.config.model_copy(update={"block_size": 0})).to(torch.float64)
    with pytest.raises(ValueError, match="serves block models"):
        whole(tokens, cache=PoolPass(pool, [0], [0], [8], BLOCK))


@torch.inference_mode()
def test_a_pool_holds_only_the_positions_reserved_and_never_more_than_its_context(
    model: DiffusionTransformer,
) -> None:
    pool = KVPool(CONTEXT)
    pool.reserve(2, 16)
    assert (pool.slots, pool.positions) == (2, 16)
    with pytest.raises(ValueError, match="past the pool's 16"):
        model(torch.ones(1, 8, dtype=torch.long), cache=PoolPass(pool, [0], [16], [24], BLOCK))
    with pytest.raises(ValueError, match="exceed the pool's context"):
        pool.reserve(2, CONTEXT + 1)
    pool.reserve(3, 20)  # doubled, within the context
    assert (pool.slots, pool.positions) == (4, 32)


def test_each_fed_key_lands_at_its_rows_position_and_padding_in_the_scratch_column() -> None:
    """Rows that start apart and end alike (the second's last columns are padding): each key is written
    at its own row's position, whatever shortcut the write takes, and the rows attend over their slots."""

    pool = KVPool(CONTEXT)
    pool.reserve(2, CONTEXT)
    heads, width, dim = 2, 8, 4
    keys = torch.arange(2 * heads * width * dim, dtype=torch.float64).view(2, heads, width, dim) / 1000
    queries = torch.randn(2, heads, width, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    step = PoolPass(pool, [0, 1], [40, 44], [48, 48], BLOCK)
    mask = step.mask(width, torch.device("cpu"))
    attended = step.attend(0, queries, keys, -keys, mask, 1)
    held_k, held_v = pool.layers[0] or (None, None)
    assert held_k is not None and held_v is not None
    assert torch.equal(held_k[0, 40:48].transpose(0, 1), keys[0])
    assert torch.equal(held_k[1, 44:48].transpose(0, 1), keys[1, :, :4])  # its padding went to the scratch column
    assert torch.equal(held_v[1, 44:48].transpose(0, 1), -keys[1, :, :4])
    assert not held_k[1, 40:44].any()  # nothing written before the row's start
    want = attend(queries, held_k[:2, :48].transpose(1, 2), held_v[:2, :48].transpose(1, 2), mask)
    torch.testing.assert_close(attended, want, rtol=0, atol=0)


def test_sequences_that_stay_keep_their_slots_and_those_that_move_take_the_places_given_back() -> None:
    pool = KVPool(CONTEXT)
    pool.reserve(4, 8)
    keys, values = pool.layer(0, torch.zeros(1, 2, 1, 4))
    for slot in range(4):
        keys[slot], values[slot] = slot, -slot
    pool.keep([0, 3, 2])  # the second leaves, the last takes its place
    assert [int(keys[slot, 0, 0, 0]) for slot in range(3)] == [0, 3, 2]
    assert [int(values[slot, 0, 0, 0]) for slot in range(3)] == [0, -3, -2]


@pytest.mark.parametrize("in_place", [False, True])
@torch.inference_mode()
def test_a_finished_block_fed_beside_the_next_as_a_row_of_its_own_over_the_same_slot(
    model: DiffusionTransformer, in_place: bool
) -> None:
    """A pass in which the first sequence feeds its finished second block and its third as two rows over one
    slot, beside another sequence's block: the third block sees the second's keys of the same pass, and
    every row gets the logits of its own prefix, whether the keys are gathered or read in place."""

    rows = sequences(30, 40)
    pool = KVPool(CONTEXT, read_in_place=in_place)
    pool.reserve(2, CONTEXT)
    pooled_logits(model, pool, [0, 1], rows, [(0, 16), (0, 24)])  # the first holds 8, the second 16
    tokens = torch.zeros(3, BLOCK, dtype=torch.long)
    tokens[0], tokens[1], tokens[2] = rows[0][8:16], rows[1][16:24], rows[0][16:24]
    outputs = torch.ones(3, BLOCK, dtype=torch.bool)
    step = PoolPass(pool, [0, 1, 0], [8, 16, 16], [24, 24, 24], BLOCK)
    got = model(tokens, output_positions=outputs, cache=step)
    want = torch.cat(
        [
            prefix_logits(model, rows[0], 8, 16),
            prefix_logits(model, rows[1], 16, 24),
            prefix_logits(model, rows[0], 16, 24),
        ]
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
