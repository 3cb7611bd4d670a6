"""Batches of prompts of different lengths, block models past their context, block-model thresholds.

A batch equals one-by-one sampling up to float rounding (docs/reproducibility.md): the random
streams are the same exactly, the model's outputs agree to rounding, and a token can differ only
where a choice is a tie within that rounding. The token-for-token comparisons run the model in
float64, where rounding is about 1e-16, far below any gap between the choices these seeds make, so
they hold whatever kernels the CPU dispatches (in float32, threshold ranks flip between AVX-512 and
AVX2 kernels). An empty prompt's first step sees only mask tokens, so every position gets the same
distribution and any ranking of them is an exact tie that rounding decides: it is sampled only with
ancestral (unranked) reveals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_sampling
import torch
from tokenizers import Tokenizer
from typer.testing import CliRunner

from dlm.cli import app
from dlm.config.schema import ModelConfig
from dlm.errors import UserError
from dlm.model.attention import KVCache
from dlm.model.transformer import DiffusionTransformer
from dlm.sampling.generation import generate
from dlm.sampling.reverse import Reverse
from dlm.sampling.row_noise import RowNoise

tokenizer = pytest.fixture(scope="module")(test_sampling.tokenizer.__wrapped__)  # the sampler tests' tokenizer
PROMPTS = ["ROMEO:", "", "JULIET: O Romeo, Romeo, wherefore", "To be"]
# For options that rank positions: no empty prompt (its symmetric tie); 13 and 9 tokens share a block
# model's phase, so its batches are padded too.
RANKED = ["ROMEO:", "JULIET: O Romeo, Romeo, wherefore", "To be", "ROMEO: But soft"]


def transformer(
    vocab_size: int,
    max_seq_len: int = 48,
    block_size: int = 0,
    dtype: torch.dtype = torch.float64,
    attention: str = "bidirectional",
) -> DiffusionTransformer:
    config = ModelConfig(
        vocab_size=vocab_size,
        max_seq_len=max_seq_len,
        d_model=32,
        n_layers=2,
        n_heads=2,
        pad_vocab_multiple=64,
        block_size=block_size,
        attention=attention,
    )  # type: ignore[arg-type]
    torch.manual_seed(0)
    return DiffusionTransformer(config).to(dtype).eval()


def one_by_one(model: Any, tokenizer: Tokenizer, prompts: list[str], seed: int, **options: Any) -> list[list[int]]:
    rows = []
    for index, prompt in enumerate(prompts):
        rows += generate(model, tokenizer, prompt=prompt, seed=seed + index, **options).token_ids
    return rows


def test_prompt_lengths_differ(tokenizer: Tokenizer) -> None:
    for prompts in (PROMPTS, RANKED):
        sizes = [len(tokenizer.encode(prompt).ids) for prompt in prompts]
        assert len(set(sizes)) == len(prompts)  # otherwise the padding would not be exercised
        assert len({size % 4 for size in sizes}) < len(prompts)  # nor a block model's


@pytest.mark.parametrize(
    ("options", "prompts"),
    [
        ({}, PROMPTS),
        ({"remasking": "confidence", "block_length": 4}, RANKED),
        ({"remasking": "dilated", "block_length": 4}, PROMPTS),
        ({"cache": "prefix", "block_length": 4}, PROMPTS),
        ({"cache": "dual", "block_length": 4}, PROMPTS),
        ({"cache": "dual", "block_length": 4, "threshold": 0.05, "remasking": "margin"}, RANKED),
        ({"stop_at_end": True, "threshold": 0.05, "block_length": 4}, RANKED),
    ],
)
def test_a_batch_of_prompts_equals_one_by_one_sampling(
    tokenizer: Tokenizer, options: dict[str, Any], prompts: list[str]
) -> None:
    model = transformer(tokenizer.get_vocab_size())
    common = {"length": 12, "steps": 12, "num_samples": 2} | options
    batch = generate(model, tokenizer, prompts=prompts, seed=5, **common)
    assert batch.token_ids == one_by_one(model, tokenizer, prompts, 5, **common)
    single = [generate(model, tokenizer, prompt=p, seed=5 + i, **common) for i, p in enumerate(prompts)]
    assert batch.texts == [text for result in single for text in result.texts]
    assert batch.lengths == [n for result in single for n in result.lengths]
    assert batch.prompt_tokens == [len(tokenizer.encode(p).ids) for p in prompts for _ in range(2)]
    assert batch.seeds == [5 + i for i in range(len(prompts)) for _ in range(2)]


@pytest.mark.parametrize("remasking", ["random", "dilated", "confidence"])
@pytest.mark.parametrize("prompts", [["ROMEO:"], [""], ["To be", "ROMEO: But soft", "To be"]])
def test_samples_of_one_prompt_share_the_passes_where_they_repeat_each_other(
    tokenizer: Tokenizer, remasking: str, prompts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The samples of a prompt repeat each other until a step writes their tokens: such a step (every row's
    first) runs the model on each distinct row once (one a prompt: the batch of three holds a prompt
    twice, padded alike), and the samples are those of every row through the model. Once every row of a
    step is distinct, no later step looks."""

    model = transformer(tokenizer.get_vocab_size())
    rows: list[int] = []
    forward = model.forward

    def counted(tokens: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows.append(int(tokens.shape[0]))
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    looks: list[bool] = []
    shared = Reverse._shared

    def looking(*args: Any) -> torch.Tensor | None:
        logits = shared(*args)
        looks.append(logits is not None)
        return logits

    monkeypatch.setattr(Reverse, "_shared", looking)
    options = {"length": 12, "steps": 4, "num_samples": 4, "remasking": remasking}
    together = generate(model, tokenizer, prompts=prompts, seed=5, **options)
    assert rows[0] == len(set(prompts)) and max(rows[1:]) > len(set(prompts))
    assert looks[0] and not looks[-1] and len(looks) < len(rows)
    rows.clear()
    monkeypatch.setattr(Reverse, "_shared", lambda *_: None)
    each = generate(model, tokenizer, prompts=prompts, seed=5, **options)  # every row through the model
    assert rows[0] > len(set(prompts))
    assert together.token_ids == each.token_ids


@pytest.mark.parametrize(
    ("options", "prompts"), [({}, PROMPTS), ({"remasking": "confidence"}, RANKED), ({"threshold": 0.05}, RANKED)]
)
def test_a_batch_of_prompts_equals_one_by_one_for_a_block_model(
    tokenizer: Tokenizer, options: dict[str, Any], prompts: list[str]
) -> None:
    model = transformer(tokenizer.get_vocab_size(), block_size=4)
    common = {"length": 10, "steps": 12, "num_samples": 2} | options
    batch = generate(model, tokenizer, prompts=prompts * 2, seed=1, **common)  # each length twice: one batch
    assert batch.token_ids == one_by_one(model, tokenizer, prompts * 2, 1, **common)


def test_the_same_batch_repeats_bit_for_bit_in_float32(tokenizer: Tokenizer) -> None:
    # Same machine, same batch shape: every sum runs the same kernel in the same order, so even the
    # near-ties of a float32 model and an empty prompt's symmetric first step come out the same.
    model = transformer(tokenizer.get_vocab_size(), dtype=torch.float32)
    common = {
        "length": 12,
        "steps": 12,
        "num_samples": 2,
        "cache": "dual",
        "block_length": 4,
        "threshold": 0.05,
        "remasking": "margin",
    }
    first = generate(model, tokenizer, prompts=PROMPTS, seed=5, **common)
    assert generate(model, tokenizer, prompts=PROMPTS, seed=5, **common).token_ids == first.token_ids


def test_padding_changes_no_logit_beyond_float32_rounding(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size(), dtype=torch.float32)
    tokens = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    padded = torch.cat((torch.full((1, 7), 5), tokens), dim=1)
    with torch.inference_mode():
        plain = model(tokens)
        shifted = model(torch.cat((tokens, padded[:, :20])), pad=torch.tensor([0, 0]))[:1]
        left = model(padded, pad=torch.tensor([7]))[:, 7:]
    torch.testing.assert_close(left, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shifted, plain, atol=1e-5, rtol=1e-5)


def test_row_noise_gives_each_group_its_own_stream() -> None:
    noise = RowNoise((torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)), (2, 1))
    draws = noise.stacked(torch.tensor([2, 0, 3]), 5)
    assert torch.equal(draws[:2], torch.rand((2, 5), dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(draws[2:], torch.rand((3, 5), dtype=torch.float64, generator=torch.Generator().manual_seed(4)))
    single = RowNoise.of(torch.Generator().manual_seed(9), 3).per_row((3, 4))
    assert torch.equal(single, torch.rand((3, 4), dtype=torch.float64, generator=torch.Generator().manual_seed(9)))


def test_a_block_model_generates_past_its_context(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size(), max_seq_len=16, block_size=4)
    prompt = len(tokenizer.encode("ROMEO:").ids)

    def blocks(length: int) -> int:  # model blocks holding a generated position: 2 steps each below
        return (prompt + length - 1) // 4 - prompt // 4 + 1

    long = generate(model, tokenizer, prompt="ROMEO:", length=40, steps=2 * blocks(40), seed=2)
    # (The model raises on a pass that would see more than its 16 positions: the window held.)
    assert long.lengths == [40] and len(long.token_ids[0]) == prompt + 40 > 16
    assert 1 not in long.token_ids[0]  # nothing left masked
    # Within the context nothing slides: the first window is what generating only it gives.
    short = generate(model, tokenizer, prompt="ROMEO:", length=16 - prompt, steps=2 * blocks(16 - prompt), seed=2)
    assert short.token_ids[0] == long.token_ids[0][:16]


def test_a_batch_past_the_context_equals_one_by_one(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size(), max_seq_len=16, block_size=4)
    common = {"length": 30, "steps": 40, "num_samples": 1}
    batch = generate(model, tokenizer, prompts=PROMPTS * 2, seed=0, **common)
    expected = [
        row
        for index, prompt in enumerate(PROMPTS * 2)
        for row in generate(model, tokenizer, prompt=prompt, seed=index, **common).token_ids
    ]
    assert batch.token_ids == expected


def test_the_window_keeps_whole_recent_blocks() -> None:
    cache = KVCache([(torch.zeros(1, 1, 12, 2), torch.ones(1, 1, 12, 2))], length=12)
    cache.trim(8, 4)
    assert cache.stored == 8 and cache.dropped == 4 and cache.length == 12
    cache.trim(5, 4)
    assert cache.stored == 4 and cache.dropped == 8


def test_a_whole_sequence_model_refuses_more_than_its_context(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size(), max_seq_len=16)
    with pytest.raises(UserError, match="max_seq_len \\(16\\)") as error:
        generate(model, tokenizer, prompt="ROMEO:", length=40)
    assert "block_size" in (error.value.fix or "")


def test_threshold_decoding_of_a_block_model_saves_passes(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size(), block_size=4)
    common = {"prompt": "ROMEO:", "length": 16, "steps": 16, "temperature": 0.0}
    fixed = generate(model, tokenizer, remasking="confidence", **common)
    low = generate(model, tokenizer, threshold=1e-6, **common)  # every position clears it: one pass a block
    assert 1 not in low.token_ids[0] and low.lengths == [16]
    assert low.forward_passes < fixed.forward_passes
    assert low.forward_passes <= 2 * 5  # at most one commit and one denoising pass per block


def test_cli_prompt_file_writes_one_record_per_prompt(tokenizer: Tokenizer, tmp_path: Path, monkeypatch: Any) -> None:
    model = transformer(tokenizer.get_vocab_size())
    monkeypatch.setattr("dlm.artifacts.loading.load_model", lambda path, device, dtype: (model, tokenizer))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\n\nTo be\n", encoding="utf-8")
    args = ["sample", "model", "--prompt-file", str(prompts), "--length", "8", "--steps", "8", "--seed", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.output.splitlines()]
    assert [r["prompt"] for r in records] == ["ROMEO:", "To be"]  # a blank line is no prompt
    assert [r["seed"] for r in records] == [3, 4]
    direct = generate(model, tokenizer, prompt="To be", length=8, steps=8, seed=4)
    assert records[1]["tokens"] == 8 and records[1]["stop"] == "length"
    generated = direct.token_ids[0][direct.prompt_tokens[0] :]
    assert records[1]["text"] == tokenizer.decode(generated, skip_special_tokens=False)


@pytest.fixture()
def prompt_file(tokenizer: Tokenizer, tmp_path: Path, monkeypatch: Any) -> Path:
    """Five prompts of different lengths, and a float64 model behind `dlm sample`."""

    model = transformer(tokenizer.get_vocab_size())
    monkeypatch.setattr("dlm.artifacts.loading.load_model", lambda path, device, dtype: (model, tokenizer))
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join([*RANKED, "Two households, both alike"]) + "\n", encoding="utf-8")
    return path


SAMPLE = [
    "--length",
    "8",
    "--steps",
    "8",
    "--seed",
    "3",
    "--num-samples",
    "2",
    "--remasking",
    "confidence",
    "--threshold",
    "0.05",
    "--device",
    "cpu",
]


def test_cli_prompt_file_in_batches_equals_one_batch(prompt_file: Path, run_cli: Any) -> None:
    whole = run_cli("sample", "model", "--prompt-file", prompt_file, *SAMPLE, "--batch-size", "5")
    assert whole.exit_code == 0, whole.stderr
    records = [json.loads(line) for line in whole.stdout.splitlines()]
    assert [r["seed"] for r in records] == [3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert [r["sample"] for r in records[:2]] == [0, 1]
    for size in ("1", "2", "4"):
        chunked = run_cli("sample", "model", "--prompt-file", prompt_file, *SAMPLE, "--batch-size", size)
        assert chunked.exit_code == 0, chunked.stderr
        assert chunked.stdout == whole.stdout, size


def test_cli_prompt_file_prints_each_batch_as_it_ends(prompt_file: Path, run_cli: Any, monkeypatch: Any) -> None:
    import sys

    import dlm.sampling.generation

    printed: list[int] = []  # lines on stdout when each batch starts
    real = dlm.sampling.generation.generate

    def generate_after_counting(*args: Any, **kwargs: Any) -> Any:
        printed.append(sys.stdout.getvalue().count("\n"))  # type: ignore[attr-defined]
        return real(*args, **kwargs)

    monkeypatch.setattr(dlm.sampling.generation, "generate", generate_after_counting)
    result = run_cli("sample", "model", "--prompt-file", prompt_file, *SAMPLE, "--batch-size", "2")
    assert result.exit_code == 0, result.stderr
    assert printed == [0, 4, 8]  # 2 prompts x 2 samples a batch, the last batch holds one prompt


def test_cli_prompt_file_checks_every_prompt_before_printing(prompt_file: Path, run_cli: Any) -> None:
    lines = prompt_file.read_text(encoding="utf-8").splitlines()
    prompt_file.write_text("\n".join([*lines, "ROMEO: <|mask|>"]) + "\n", encoding="utf-8")
    refused = run_cli("sample", "model", "--prompt-file", prompt_file, *SAMPLE, "--batch-size", "1")
    refused.assert_refused("--prompt contains the mask token itself")
    assert refused.stdout == ""  # not the first five prompts' lines, then an error
    run_cli("sample", "model", "--batch-size", "4").assert_refused("--batch-size applies to --prompt-file only")


def test_cli_prompt_file_errors_name_the_file(tmp_path: Path, run_cli: Any) -> None:
    missing = tmp_path / "none.txt"
    run_cli("sample", "model", "--prompt-file", missing).assert_refused("none.txt", "no such prompt file")
    both = run_cli("sample", "model", "--prompt-file", missing, "--prompt", "x")
    both.assert_refused("--prompt-file cannot be combined")


def test_a_committing_pass_computes_the_last_layer_only_where_outputs_are(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size(), dtype=torch.float32)
    tokens = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.zeros_like(tokens, dtype=torch.bool)
    positions[0, 9] = positions[1, 12] = True
    with torch.inference_mode():
        plain = KVCache(committing=True)
        reference = model(tokens, output_positions=torch.ones_like(positions), cache=plain)[positions.flatten()]
        kept = KVCache(committing=True)
        narrowed = model(tokens, output_positions=positions, cache=kept)
        stored = KVCache(committing=True)
        none = model(tokens, output_positions=torch.zeros_like(positions), cache=stored)
    torch.testing.assert_close(narrowed, reference, atol=1e-5, rtol=1e-5)
    assert none.shape == (0, tokenizer.get_vocab_size())
    for cache in (kept, stored):
        assert cache.length == 24
        for (k, v), (k0, v0) in zip(cache.layers, plain.layers, strict=True):  # type: ignore[misc]
            assert torch.equal(k, k0) and torch.equal(v, v0)


def test_a_pass_that_only_reads_a_cache_leaves_it_as_it_was(tokenizer: Tokenizer) -> None:
    # A served request's cache is merged with others' by the layers it holds: a reading pass over an
    # empty cache must not leave placeholder layers in it (a block model's first step reads one).
    model = transformer(tokenizer.get_vocab_size(), dtype=torch.float32)
    tokens = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(2))
    reading = KVCache()
    with torch.inference_mode():
        model(tokens, output_positions=torch.ones_like(tokens, dtype=torch.bool), cache=reading)
        assert reading.layers == [] and reading.length == 0
        stored = KVCache(committing=True)
        model(tokens, cache=stored)
        kept = [(k.clone(), v.clone()) for k, v in stored.layers]  # type: ignore[misc]
        stored.committing = False
        model(tokens[:, :4], cache=stored)
    assert stored.length == 8 and len(stored.layers) == len(kept)
    for (k, v), (k0, v0) in zip(stored.layers, kept, strict=True):  # type: ignore[misc]
        assert torch.equal(k, k0) and torch.equal(v, v0)
