"""The transformer against independent mathematics: attention, rotary, tying, gradients, learning."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from dlm.config.schema import ModelConfig
from dlm.config.shapes import format_parameter_count
from dlm.diffusion.objective import accumulation_mask_probabilities, corrupt_tokens, diffusion_cross_entropy
from dlm.model.rotary import apply_rotary, head_tables, rotary_tables
from dlm.model.transformer import DiffusionTransformer


def tiny_config(**overrides: object) -> ModelConfig:
    fields: dict[str, object] = dict(
        vocab_size=100, mask_token_id=1, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, pad_vocab_multiple=64
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_model(**overrides: object) -> DiffusionTransformer:
    torch.manual_seed(0)
    return DiffusionTransformer(tiny_config(**overrides))


def test_logits_cover_the_vocabulary_and_never_the_padding_rows() -> None:
    model = tiny_model()
    assert model.token_embedding.weight.shape == (128, 32)
    assert torch.equal(model.token_embedding.weight[100:], torch.zeros(28, 32))
    tokens = torch.randint(100, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 100)
    with torch.no_grad():
        model.token_embedding.weight[100:] = 1e4  # huge padding rows would dominate any logit they reach
    assert torch.equal(model(tokens), logits)


def test_embedding_and_head_are_one_parameter() -> None:
    model = tiny_model()
    weight = model.token_embedding.weight
    assert sum(1 for p in model.parameters() if p is weight) == 1
    assert sum(1 for p in model.parameters() if p.shape == weight.shape) == 1
    # Token 99 never appears in the input, so its row only gets gradient through the head.
    tokens = torch.randint(50, (2, 16))
    model(tokens).logsumexp(-1).sum().backward()
    assert weight.grad[99].abs().sum() > 0


def test_parameter_count_and_flops_follow_the_architecture() -> None:
    config = tiny_config()
    d, f, layers = config.d_model, config.ffn_size, config.n_layers
    per_block = 3 * d * d + d * d + 2 * d * f + f * d + 2 * d  # qkv, out, gate_up, down, two norms
    expected = config.padded_vocab_size * d + layers * per_block + d
    model = tiny_model()
    assert model.num_parameters == expected
    assert model.flops_per_token(16) == 6 * expected + 12 * layers * d * 16


def test_state_dict_holds_weights_only_and_round_trips() -> None:
    model = tiny_model()
    state = model.state_dict()
    assert not any("rope" in key for key in state)
    clone = DiffusionTransformer(tiny_config())
    clone.load_state_dict(state, strict=True)
    tokens = torch.randint(100, (1, 16))
    assert torch.equal(clone(tokens), model(tokens))


def test_init_scales_residual_projections_with_depth() -> None:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=512, max_seq_len=8, d_model=256, n_layers=8, n_heads=4, init_std=0.02)
    model = DiffusionTransformer(config)
    residual = 0.02 / math.sqrt(16)
    for block in model.blocks:
        assert block.attention.out.weight.std().item() == pytest.approx(residual, rel=0.05)
        assert block.mlp.down.weight.std().item() == pytest.approx(residual, rel=0.05)
        assert block.attention.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert torch.equal(block.attention_norm.weight, torch.ones(256))


def test_meta_device_construction_then_init_weights_rebuilds_the_rotary_tables() -> None:
    reference = tiny_model()
    with torch.device("meta"):
        model = DiffusionTransformer(tiny_config())
    model.to_empty(device="cpu")
    model.init_weights()
    assert torch.equal(model.rope_cos, reference.rope_cos) and torch.equal(model.rope_sin, reference.rope_sin)
    assert torch.isfinite(model(torch.randint(100, (1, 16)))).all()


def test_sparse_head_equals_full_head_restricted_in_values_and_gradients() -> None:
    model = tiny_model()
    tokens = torch.randint(100, (3, 16))
    positions = torch.rand(3, 16, generator=torch.Generator().manual_seed(1)) < 0.4
    targets = torch.randint(100, (int(positions.sum()),))

    sparse = model(tokens, output_positions=positions)
    F.cross_entropy(sparse, targets).backward()
    sparse_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full = model(tokens)[positions]
    F.cross_entropy(full, targets).backward()

    assert sparse.shape == (int(positions.sum()), 100)
    assert torch.allclose(sparse, full, atol=1e-6)
    for sparse_grad, parameter in zip(sparse_grads, model.parameters(), strict=True):
        assert torch.allclose(sparse_grad, parameter.grad, atol=1e-7)


def test_activation_checkpointing_gives_identical_loss_and_gradients() -> None:
    tokens = torch.randint(100, (2, 16))
    target = torch.randint(100, (2 * 16,))
    results = []
    for recompute in (False, True):
        model = tiny_model(activation_checkpointing=recompute).train()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), target)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    for grad_a, grad_b in zip(grads_a, grads_b, strict=True):
        assert torch.allclose(grad_a, grad_b, atol=1e-6)


def test_attention_is_bidirectional() -> None:
    model = tiny_model().eval()
    tokens = torch.randint(2, 100, (1, 16))
    changed = tokens.clone()
    changed[0, -1] = 0
    first, second = model(tokens), model(changed)
    assert not torch.allclose(first[0, 0], second[0, 0], atol=1e-5)


def naive_attention_with_complex_rotary(
    x: torch.Tensor, qkv_weight: torch.Tensor, heads: int, theta: float
) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V, with rotary written as multiplication by e^{i m w_j} on pairs (x_j, x_{j+D/2})."""

    batch, length, width = x.shape
    head_dim = width // heads
    q, k, v = (x @ qkv_weight.T).view(batch, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    frequencies = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), frequencies)
    phase = torch.polar(torch.ones_like(angles), angles)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        half = head_dim // 2
        z = torch.complex(t[..., :half].double(), t[..., half:].double()) * phase
        return torch.cat((z.real, z.imag), dim=-1)

    scores = rotate(q) @ rotate(k).transpose(-1, -2) / math.sqrt(head_dim)
    y = torch.softmax(scores, dim=-1) @ v.double()
    return y.transpose(1, 2).reshape(batch, length, width)


def test_sdpa_attention_with_rotary_equals_naive_softmax_attention() -> None:
    model = tiny_model()
    attention = model.blocks[0].attention
    x = torch.randn(2, 16, 32)
    got = attention(x, *head_tables(model.rope_cos, model.rope_sin))
    heads = naive_attention_with_complex_rotary(x, attention.qkv.weight, 4, 10000.0)
    expected = heads @ attention.out.weight.T.double()
    assert torch.allclose(got.double(), expected, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_over_the_whole_head_equals_the_pairwise_formula_bit_for_bit(dtype: torch.dtype) -> None:
    cos, sin = rotary_tables(64, 16, 10000.0)
    x = torch.randn(3, 64, 2, 16).to(dtype)
    x1, x2 = x.float().split(8, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    pairwise = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)
    assert torch.equal(apply_rotary(x, *head_tables(cos, sin)), pairwise)
    per_row = head_tables(cos.expand(3, -1, -1), sin.expand(3, -1, -1))  # padded batches: a table per row
    assert torch.equal(apply_rotary(x, *per_row), pairwise)


def test_rotary_scores_depend_only_on_relative_position_and_preserve_norms() -> None:
    cos, sin = head_tables(*rotary_tables(64, 8, 10000.0))
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def at(x: torch.Tensor, position: int) -> torch.Tensor:
        return apply_rotary(x, cos[position : position + 1], sin[position : position + 1])

    assert torch.allclose(at(q, 3).norm(), q.norm(), atol=1e-5)
    score = (at(q, 3) * at(k, 10)).sum()
    for shift in (1, 20, 50):
        assert torch.allclose((at(q, 3 + shift) * at(k, 10 + shift)).sum(), score, atol=1e-5)


def test_too_long_sequences_and_index_positions_are_refused() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(TypeError, match="boolean"):  # integer "positions" would silently index rows
        model(torch.zeros(1, 16, dtype=torch.long), output_positions=torch.ones(1, 16, dtype=torch.long))


def test_bfloat16_autocast_forward_is_close_to_float32() -> None:
    model = tiny_model()
    tokens = torch.randint(100, (2, 16))
    reference = model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - reference).abs().max() < 0.05 * reference.abs().max()


def test_trunk_compiles_without_graph_breaks() -> None:
    model = tiny_model()
    tokens = torch.randint(100, (2, 16))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    assert torch.allclose(compiled(tokens), model(tokens), atol=1e-6)


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Hundreds of tiny steps: thread hand-offs cost more than they save, badly so on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_tiny_model_overfits_one_batch() -> None:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=32, mask_token_id=1, max_seq_len=16, d_model=64, n_layers=2, n_heads=4)
    model = DiffusionTransformer(config)
    # One sequence under 16 independent noise draws per step: the 1/t weights make a single draw's
    # gradient very noisy, and copies are the cheapest variance reduction on a CPU.
    rows = 16
    clean = torch.randint(2, 32, (1, 16), generator=torch.Generator().manual_seed(1)).repeat(rows, 1)

    def loss_at(step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(step)
        times = accumulation_mask_probabilities(rows, 0, 1, torch.rand((), generator=generator), 1e-3, "cpu")
        corruption = corrupt_tokens(clean, 1, times, 1e-3, generator)
        logits = model(corruption.noisy_tokens, output_positions=corruption.mask)
        return diffusion_cross_entropy(logits, clean, corruption).loss

    def evaluate() -> float:
        with torch.no_grad():
            return torch.stack([loss_at(10_000 + i) for i in range(8)]).mean().item()

    before = evaluate()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(250):
        optimizer.zero_grad(set_to_none=True)
        loss_at(step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    assert before == pytest.approx(math.log(32), rel=0.1)  # near-uniform at initialisation
    # Not to zero: with (nearly) every token masked, rotary-only positions barely localise, so
    # t close to 1 keeps about the sequence's unigram entropy. The rest must be memorised.
    assert evaluate() < 0.1 * before


@pytest.mark.parametrize(
    ("count", "text"),
    [(999, "999"), (512_000, "512.0K"), (999_960, "1.0M"), (110_900_000, "110.9M"), (1_280_000_000, "1.28B")],
)
def test_format_parameter_count(count: int, text: str) -> None:
    assert format_parameter_count(count) == text


@pytest.mark.parametrize("block_size", [0, 4])
def test_subs_gives_the_mask_token_no_probability_and_copies_unmasked_tokens(block_size: int) -> None:
    model = tiny_model(mask_logit="subs", block_size=block_size).double()
    plain = tiny_model(mask_logit="plain", block_size=block_size).double()  # the same weights (seed 0)
    clean = torch.randint(2, 100, (3, 16), generator=torch.Generator().manual_seed(2))
    corruption = corrupt_tokens(
        clean, 1, torch.tensor([0.3, 0.6, 0.9]), 1e-3, torch.Generator().manual_seed(3), block_size=block_size
    )
    noisy, mask = corruption.noisy_tokens, corruption.mask
    context = {"clean_tokens": clean} if block_size else {}
    logits = model(noisy, output_positions=mask, **context)
    probabilities = logits.softmax(dim=-1)
    assert torch.equal(probabilities[:, 1], torch.zeros(int(mask.sum()), dtype=torch.float64))
    # The other tokens keep the plain model's logits, so their probabilities are its, renormalised
    # without the mask token: what the mask would have taken is given back to the real tokens.
    reference = plain(noisy, output_positions=mask, **context)
    reference[:, 1] = float("-inf")
    torch.testing.assert_close(probabilities, reference.softmax(dim=-1), rtol=1e-12, atol=1e-15)
    # An unmasked position predicts its own token with probability 1.
    full = model(noisy, **context).softmax(dim=-1)
    own = full[~mask].gather(1, noisy[~mask][:, None])
    assert torch.equal(own, torch.ones_like(own)) and bool((full[~mask].sum(dim=1) == 1).all())
    torch.testing.assert_close(full[mask], probabilities, rtol=1e-12, atol=1e-15)  # gathered before the head
    # The loss is finite and lower than the plain model's on the same masks; gradients are finite.
    loss = diffusion_cross_entropy(logits, clean, corruption).loss
    assert (
        torch.isfinite(loss)
        and loss < diffusion_cross_entropy(plain(noisy, output_positions=mask, **context), clean, corruption).loss
    )
    loss.backward()
    assert all(torch.isfinite(parameter.grad).all() for parameter in model.parameters())


def test_subs_trains_under_bfloat16_autocast() -> None:
    model = tiny_model(mask_logit="subs").train()
    clean = torch.randint(2, 100, (4, 16), generator=torch.Generator().manual_seed(4))
    corruption = corrupt_tokens(clean, 1, torch.tensor([0.2, 0.5, 0.7, 1.0]), 1e-3, torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(corruption.noisy_tokens, output_positions=corruption.mask)
    assert logits.dtype == torch.bfloat16 and bool((logits[:, 1] == float("-inf")).all())
    loss = diffusion_cross_entropy(logits, clean, corruption).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
