"""The 2L training pass of a block model computes the noisy copy's outputs only in its last layer:
the same loss and gradients as the pass that computes every position in every layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from dlm.config.schema import ModelConfig
from dlm.diffusion.objective import corrupt_tokens, diffusion_cross_entropy
from dlm.evaluation.evaluate import evaluate_model
from dlm.model.attention import AttentionMask, _bd3_bool
from dlm.model.denoiser import masked_logits
from dlm.model.rotary import head_tables
from dlm.model.transformer import DiffusionTransformer

MASK_ID = 1


def model_of(block_size: int, checkpointing: bool = False, attention: str = "bidirectional") -> DiffusionTransformer:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=64,
        mask_token_id=MASK_ID,
        max_seq_len=16,
        d_model=32,
        n_layers=3,
        n_heads=4,
        pad_vocab_multiple=64,
        block_size=block_size,
        activation_checkpointing=checkpointing,
        attention=attention,
    )
    return DiffusionTransformer(config).double().train()


def every_position_logits(model: DiffusionTransformer, noisy: Tensor, mask: Tensor, clean: Tensor) -> Tensor:
    """The 2L pass as it was: every layer computes all 2L positions, then the noisy copy is read."""

    length, config = noisy.shape[1], model.config
    cos, sin = head_tables(*(table[:length].float().repeat(2, 1) for table in (model.rope_cos, model.rope_sin)))
    attention = AttentionMask("sdpa-mask", _bd3_bool(length, config.block_size, noisy.device))
    x = model.token_embedding(torch.cat((noisy, clean), 1))
    for block in model.blocks:
        x = block(x, cos, sin, attention)
    x = model.norm(x[:, :length])[mask]
    return F.linear(x, model.token_embedding.weight)[..., : config.vocab_size]


def loss_and_gradients(
    model: DiffusionTransformer, logits_of: object, block_size: int
) -> tuple[Tensor, Tensor, list[Tensor]]:
    clean = torch.randint(2, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    times = torch.rand(3, 16 // block_size, generator=torch.Generator().manual_seed(2))
    corruption = corrupt_tokens(clean, MASK_ID, times, 1e-3, torch.Generator().manual_seed(3), block_size=block_size)
    model.zero_grad()
    logits = logits_of(model, corruption.noisy_tokens, corruption.mask, clean)  # type: ignore[operator]
    loss = diffusion_cross_entropy(logits, clean, corruption).loss
    loss.backward()
    return logits.detach(), loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(("block_size", "checkpointing"), [(1, False), (4, False), (1, True)])
def test_the_trimmed_2l_pass_has_the_loss_and_gradients_of_the_full_one(block_size: int, checkpointing: bool) -> None:
    model = model_of(block_size, checkpointing)
    logits, loss, grads = loss_and_gradients(model, masked_logits, block_size)
    want_logits, want_loss, want_grads = loss_and_gradients(model, every_position_logits, block_size)
    assert logits.dtype == torch.float64 and len(grads) == len(want_grads) == len(list(model.parameters()))
    # The two passes differ only in which rows the last layer computes: float64 rounding apart.
    torch.testing.assert_close(logits, want_logits, atol=1e-12, rtol=0)
    # The ELBO's cross-entropy runs in float32 (as in training), so the loss and gradients are
    # compared at float32's resolution.
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=0)
    for grad, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(grad, want, atol=1e-7, rtol=1e-5)


def test_block_size_one_trains_on_every_position_with_weight_one() -> None:
    # At block_size 1 the noise draw masks every token with weight 1 whatever the times: the loss is
    # the mean cross-entropy of each token given the clean tokens before it, one number for any times.
    model = model_of(1)
    clean = torch.randint(2, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    losses = []
    for seed in range(2):
        times = torch.rand(2, 16, generator=torch.Generator().manual_seed(seed))
        corruption = corrupt_tokens(clean, MASK_ID, times, 1e-3, torch.Generator().manual_seed(seed), block_size=1)
        with torch.no_grad():
            logits = masked_logits(model, corruption.noisy_tokens, corruption.mask, clean)
        losses.append(diffusion_cross_entropy(logits, clean, corruption).loss)
        torch.testing.assert_close(losses[-1], F.cross_entropy(logits, clean.flatten()).float(), atol=1e-6, rtol=0)
    assert float(losses[0]) == float(losses[1])


class EveryPosition(torch.nn.Module):
    """The model with its 2L pass computing every position in every layer (as it did before)."""

    def __init__(self, inner: DiffusionTransformer) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, tokens: Tensor, output_positions: Tensor | None = None, **kwargs: Tensor | None) -> Tensor:
        clean = kwargs.get("clean_tokens")
        if clean is None or output_positions is None:
            return self.inner(tokens, output_positions, **kwargs)
        return every_position_logits(self.inner, tokens, output_positions, clean)


@pytest.mark.parametrize("block_size", [1, 4])
def test_eval_figures_of_a_block_model_are_those_of_the_full_pass(block_size: int) -> None:
    model = model_of(block_size).float().eval()
    data = torch.randint(2, 64, (8, 16), generator=torch.Generator().manual_seed(5))
    reports = [evaluate_model(m, data, batches=2, mc_samples=2, batch_size=4) for m in (model, EveryPosition(model))]
    for name in ("nll", "fixed_noise_loss", "nll_mc_stderr"):
        assert getattr(reports[0], name) == pytest.approx(getattr(reports[1], name), abs=1e-6), name


@pytest.mark.parametrize("block_size, attention", [(4, "bidirectional"), (2, "bidirectional"), (1, "causal")])
def test_a_left_padded_batch_scores_each_row_as_it_scores_alone(block_size: int, attention: str) -> None:
    """Rows of different lengths share the 2L pass (the autoregressive model's one causal pass) when
    left-padded: the padding is by any number of positions, not whole blocks, and each row's blocks count
    from its own first token, so each row's logits are its unpadded pass's up to float rounding."""

    model = model_of(block_size, attention=attention).eval()
    lengths = [13, 16, 10]
    generator = torch.Generator().manual_seed(4)
    alone, clean_rows, noisy_rows, scored_rows = [], [], [], []
    for length in lengths:
        clean = torch.randint(2, 64, (1, length), generator=generator)
        scored = torch.rand(1, length, generator=generator) < 0.5
        scored[0, -1] = True
        noisy = clean.masked_fill(scored, MASK_ID)
        alone.append(model(noisy, output_positions=scored, clean_tokens=clean))
        clean_rows.append(clean)
        noisy_rows.append(noisy)
        scored_rows.append(scored)
    width = max(lengths)
    pad = torch.tensor([width - length for length in lengths])

    def left_padded(rows: list[Tensor], filler: int | bool) -> Tensor:
        return torch.cat([F.pad(row, (width - row.shape[1], 0), value=filler) for row in rows])

    together = model(
        left_padded(noisy_rows, 0),
        output_positions=left_padded(scored_rows, False),
        clean_tokens=left_padded(clean_rows, 0),
        pad=pad,
    )
    assert torch.allclose(together, torch.cat(alone), atol=1e-10, rtol=0)
