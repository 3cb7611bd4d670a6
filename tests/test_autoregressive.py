"""dlm's autoregressive model (`block_size = 1`, `attention = "causal"`): one causal pass, exact KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import check_resume_is_exact, tiny_experiment

import dlm
from dlm.artifacts.export import export_model
from dlm.bench.setup import attention_backend
from dlm.config.schema import ModelConfig
from dlm.diffusion.schedules import LinearSchedule
from dlm.errors import UserError
from dlm.evaluation.evaluate import evaluate_model, evaluate_source
from dlm.model.attention import KVCache
from dlm.model.denoiser import autoregressive_inputs, masked_logits, pass_copies
from dlm.model.transformer import DiffusionTransformer
from dlm.sampling.autoregressive import generate_tokens
from dlm.sampling.dispatch import denoise, strategy_for
from dlm.sampling.options import SamplingOptions
from dlm.sampling.reverse import ReverseContext
from dlm.sampling.row_noise import RowNoise
from dlm.train.loop import train

MASK_ID = 1
AR = ("model.block_size=1", "model.attention=causal")


def ar_model(seq_len: int = 16, seed: int = 0, **fields: object) -> DiffusionTransformer:
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=64,
        mask_token_id=MASK_ID,
        max_seq_len=seq_len,
        d_model=32,
        n_layers=2,
        n_heads=4,
        pad_vocab_multiple=64,
        block_size=1,
        attention="causal",
        **fields,
    )  # type: ignore[arg-type]
    return DiffusionTransformer(config).eval()


def scored_logits(model: DiffusionTransformer, clean: torch.Tensor) -> torch.Tensor:
    """The training / evaluation pass: logits [B, L, V] of every token given the ones before it."""

    every = torch.ones_like(clean, dtype=torch.bool)
    logits = masked_logits(model, torch.full_like(clean, MASK_ID), every, clean)
    return logits.view(*clean.shape, -1)


def test_the_variant_is_causal_block_size_one_and_nothing_else_is() -> None:
    assert ar_model().config.is_autoregressive
    assert not ModelConfig(block_size=1).is_autoregressive  # block diffusion's own B = 1: the 2L pass
    assert not ModelConfig(attention="causal").is_autoregressive  # an imported causal model
    assert pass_copies(ar_model().config) == 1 and pass_copies(ModelConfig(block_size=1)) == 2
    with pytest.raises(ValueError, match="block_size = 1 for an autoregressive model"):
        ModelConfig(block_size=4, attention="causal")
    with pytest.raises(ValueError, match='set mask_logit = "plain"'):
        ModelConfig(block_size=1, attention="causal", mask_logit="subs")


def test_inputs_are_the_row_shifted_by_one_with_the_mask_token_first() -> None:
    tokens = torch.tensor([[5, 6, 7, 8], [9, 9, 10, 11]])
    assert autoregressive_inputs(tokens, MASK_ID).tolist() == [[1, 5, 6, 7], [1, 9, 9, 10]]
    # A left-padded row starts after its padding (which no position sees).
    padded = autoregressive_inputs(tokens, MASK_ID, pad=torch.tensor([0, 2]))
    assert padded.tolist() == [[1, 5, 6, 7], [11, 9, 1, 10]]
    assert tokens.tolist() == [[5, 6, 7, 8], [9, 9, 10, 11]]  # the input is left alone


def test_the_training_pass_is_one_pass_over_the_row() -> None:
    model = ar_model()
    widths: list[int] = []
    handle = model.blocks[0].register_forward_pre_hook(lambda module, args: widths.append(args[0].shape[1]))
    try:
        scored_logits(model, torch.randint(2, 64, (2, 16)))
    finally:
        handle.remove()
    assert widths == [16]  # block diffusion's B = 1 runs its layers over 32: the noisy and the clean copy
    n, attention = model.num_parameters, 12 * 2 * 4 * 8 * 16  # 12 x layers x heads x head width x seq_len
    assert model.flops_per_token(16) == 6 * n + attention // 2
    assert "2L" not in attention_backend(model.config, torch.device("cpu"), "float32")
    assert "2L" in attention_backend(ModelConfig(block_size=1), torch.device("cpu"), "float32")


def test_each_position_predicts_its_token_from_the_tokens_before_it() -> None:
    model = ar_model()
    clean = torch.randint(2, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = scored_logits(model, clean)
        changed = clean.clone()
        changed[:, 9:] = torch.randint(2, 64, (3, 7), generator=torch.Generator().manual_seed(2))
        later = scored_logits(model, changed)
    # Position i reads tokens < i only: changing tokens 9 and after leaves positions 0 to 9 alone.
    torch.testing.assert_close(logits[:, :10], later[:, :10], atol=0, rtol=0)
    assert not torch.allclose(logits[:, 10:], later[:, 10:])


def test_the_one_pass_equals_a_token_by_token_pass_through_the_cache() -> None:
    # float64: the comparison is of the computation, not of the CPU's float32 summation order.
    model = ar_model().double()
    clean = torch.randint(2, 64, (3, 16), generator=torch.Generator().manual_seed(3))
    cache = KVCache(committing=True)
    inputs = autoregressive_inputs(clean, MASK_ID)
    with torch.no_grad():
        one_pass = scored_logits(model, clean)
        stepped = torch.cat([model(inputs[:, i : i + 1], cache=cache) for i in range(16)], dim=1)
    assert cache.length == 16
    torch.testing.assert_close(stepped, one_pass, atol=1e-10, rtol=0)


def test_eval_is_the_exact_left_to_right_likelihood_through_the_cache() -> None:
    model = ar_model()
    data = torch.randint(2, 64, (6, 16), generator=torch.Generator().manual_seed(4))
    report = evaluate_model(model, data, batches=2, mc_samples=3, batch_size=3)
    cache, inputs, total = KVCache(committing=True), autoregressive_inputs(data, MASK_ID), 0.0
    with torch.no_grad():  # -log p(x_i | x_<i), one token per pass, the way sampling computes it
        for i in range(16):
            log_probs = model(inputs[:, i : i + 1], cache=cache)[:, 0].double().log_softmax(-1)
            total -= float(log_probs.gather(1, data[:, i : i + 1]).sum())
    assert report.nll == pytest.approx(total / data.numel(), abs=1e-6)
    assert report.nll_mc_stderr == 0.0  # no masks are drawn: every token is scored once


def test_document_aware_attention_keeps_each_document_to_itself() -> None:
    model = ar_model(document_separator_id=0)
    clean = torch.randint(2, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    clean[:, 6] = 0  # the first document ends at position 6
    other = clean.clone()
    other[:, :6] = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        first, second = scored_logits(model, clean), scored_logits(model, other)
        plain = scored_logits(ar_model(), clean)
    # The second document (from position 7, which reads the separator) sees nothing of the first.
    torch.testing.assert_close(first[:, 7:], second[:, 7:], atol=1e-6, rtol=0)
    assert not torch.allclose(first[:, 7:], plain[:, 7:], atol=1e-3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampling_is_one_pass_per_token_and_equals_the_uncached_reference(temperature: float) -> None:
    model = ar_model(seq_len=24)
    tokens = torch.randint(2, 64, (2, 24), generator=torch.Generator().manual_seed(7))
    fill = torch.zeros(24, dtype=torch.bool)
    fill[5:20] = True  # 15 tokens after a prompt of 5, fixed text after them
    options = SamplingOptions(steps=4, temperature=temperature, threshold=0.9)  # one step per token regardless
    outputs = []
    with torch.inference_mode():
        for cached in (True, False):
            context = ReverseContext(RowNoise.of(torch.Generator().manual_seed(8), 2), LinearSchedule())
            outputs.append(generate_tokens(model, tokens, fill, options, context, kv_cache=cached))
    (cached_tokens, passes), (reference, reference_passes) = outputs
    assert torch.equal(cached_tokens, reference)  # the reference recomputes the whole prefix every pass
    assert passes == reference_passes == 15
    assert not bool((cached_tokens == MASK_ID).any()) and torch.equal(cached_tokens[:, ~fill], tokens[:, ~fill])


def test_every_pass_past_the_context_feeds_the_shifted_row() -> None:
    # Past max_seq_len the cache slides, and passes that only store keys and values run too: each
    # must feed what the model reads (token i - 1 at position i), as the generating passes do.
    model, fed = ar_model(seq_len=16), []

    class Recorder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.config = model, model.config

        def forward(
            self, tokens: torch.Tensor, *args: object, cache: KVCache | None = None, **kwargs: object
        ) -> torch.Tensor:
            fed.append((cache.length if cache is not None else 0, tokens.clone()))
            return self.inner(tokens, *args, cache=cache, **kwargs)

    tokens = torch.randint(2, 64, (2, 40), generator=torch.Generator().manual_seed(10))
    fill = torch.zeros(40, dtype=torch.bool)
    fill[4:] = True  # 36 tokens after a prompt of 4: more than twice the context of 16
    with torch.inference_mode():
        context = ReverseContext(RowNoise.of(torch.Generator().manual_seed(11), 2), LinearSchedule())
        result, passes = generate_tokens(Recorder(), tokens, fill, SamplingOptions(), context)
    shifted = autoregressive_inputs(result, MASK_ID)
    assert passes == len(fed) > 36  # the sliding window's store-only passes among them
    for start, chunk in fed:
        assert torch.equal(chunk, shifted[:, start : start + chunk.shape[1]]), start


def test_greedy_sampling_picks_the_most_likely_next_token_of_the_scoring_pass() -> None:
    model = ar_model(seq_len=12)
    tokens = torch.randint(2, 64, (1, 12), generator=torch.Generator().manual_seed(9))
    fill = torch.zeros(12, dtype=torch.bool)
    fill[4:] = True
    with torch.inference_mode():
        assert strategy_for(model, SamplingOptions(), None).name == "autoregressive"
        result, passes = denoise(
            model,
            tokens,
            fill,
            SamplingOptions(steps=8, temperature=0, top_p=None),
            generator=torch.Generator().manual_seed(0),
            forbidden_token_ids=(0,),
        )
        logits = scored_logits(model, result)
        logits[..., [MASK_ID, 0]] = float("-inf")  # the sampler never writes the mask or a forbidden token
    assert passes == 8 and torch.equal(result[0, 4:], logits[0, 4:].argmax(-1))


def test_a_batch_of_prompts_samples_as_each_prompt_alone(tiny_data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    settings = (
        *AR,
        "training.max_steps=3",
        "training.warmup_steps=1",
        "training.eval_interval=3",
        "training.save_interval=3",
    )
    train(tiny_experiment(tiny_data_dir, run, *settings))
    model, tokenizer = dlm.load(export_model(run, tmp_path / "model", dtype="float32"))
    prompts = ["ROMEO:", "JULIET: O Romeo, Romeo"]
    together = dlm.sample(model, tokenizer, prompts=prompts, length=12, seeds=[3, 4], temperature=0)
    alone = [
        dlm.sample(model, tokenizer, prompt=p, length=12, seed=s, temperature=0).texts[0]
        for p, s in zip(prompts, (3, 4), strict=True)
    ]
    assert together.texts == alone and together.steps == 12
    assert together.forward_passes <= 12 + 1  # one pass per token (and the prompts' shared first one)


def test_trains_evaluates_exports_loads_and_samples(tiny_data_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    settings = (
        *AR,
        "training.max_steps=4",
        "training.warmup_steps=1",
        "training.eval_interval=4",
        "training.save_interval=4",
    )
    train(tiny_experiment(tiny_data_dir, run, *settings))
    report = evaluate_source(run, batches=1, mc_samples=2, batch_size=2)
    assert report.bits_per_byte is not None and 0 < report.nll < 10 and report.nll_mc_stderr == 0.0
    exported = export_model(run, tmp_path / "model", dtype="float32")
    model, tokenizer = dlm.load(exported)
    assert model.config.is_autoregressive
    assert evaluate_source(exported, tiny_data_dir, batches=1, mc_samples=2, batch_size=2).nll == report.nll
    result = dlm.sample(model, tokenizer, prompt="ROMEO:", length=20, seed=3, stop_at_end=True)
    again = dlm.sample(model, tokenizer, prompt="ROMEO:", length=20, seed=3, stop_at_end=True)
    assert result.texts == again.texts and result.texts[0].startswith("ROMEO:")
    assert "<|mask|>" not in result.texts[0] and result.forward_passes <= 20


def test_resume_is_bit_identical(tiny_data_dir: Path, tmp_path: Path) -> None:
    settings = (
        *AR,
        "training.max_steps=8",
        "training.log_interval=2",
        "training.warmup_steps=2",
        "training.gradient_accumulation_steps=2",
        "training.eval_interval=4",
        "training.save_interval=100",
    )
    losses = check_resume_is_exact(tiny_data_dir, tmp_path, settings, pause_at=4)
    assert len(losses) == 4 and all(loss is not None and loss < 7 for loss in losses)


def test_an_imported_causal_model_is_still_refused_by_the_sampler() -> None:
    torch.manual_seed(0)
    imported = DiffusionTransformer(
        ModelConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=1, n_heads=2, attention="causal")
    ).eval()
    fill = torch.ones(16, dtype=torch.bool)
    with pytest.raises(UserError, match="cannot be sampled as a diffusion model"):
        denoise(imported, torch.full((1, 16), MASK_ID), fill, SamplingOptions(), generator=torch.Generator())
