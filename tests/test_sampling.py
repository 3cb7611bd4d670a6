"""The sampler: reverse process, remasking orders, blocks, infilling, token sampling and `dlm sample`.

Most tests drive a stand-in model whose logits are a fixed table per position, so every
confidence is known in advance and the order in which positions are revealed can be predicted.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from typer.testing import CliRunner

from dlm.cli import app, main
from dlm.cli.sample_cmd import MASK_GLYPH, render_samples
from dlm.config.schema import ModelConfig
from dlm.diffusion.reveal_order import dilated_order
from dlm.errors import UserError
from dlm.sampling.generation import generate
from dlm.sampling.options import SampleResult, SamplingOptions, sampling_remasking
from dlm.sampling.prompting import build_sequence, check_request, parse_template, split_masked
from dlm.sampling.reverse import reveal_count
from dlm.sampling.tokens import filter_logits, sample_tokens

MASK, PAD = 1, 2
CORPUS = [
    "ROMEO: But soft, what light through yonder window breaks?",
    "JULIET: O Romeo, Romeo, wherefore art thou Romeo?",
    "Two households, both alike in dignity, in fair Verona, where we lay our scene.",
] * 20


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A tiny byte-level BPE with the project's special tokens first (ids 0, 1, 2)."""

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|mask|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.token_to_id("<|mask|>") == MASK and tok.token_to_id("<|pad|>") == PAD
    return tok


class TableModel(nn.Module):
    """Logits that depend only on the position: row j of `table` [max_seq_len, vocab_size]."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.config = ModelConfig(vocab_size=table.shape[1], max_seq_len=table.shape[0])
        self.table = nn.Parameter(table.clone())
        self.calls = 0
        self.saw_eval_inference: list[bool] = []

    def forward(self, tokens: torch.Tensor, output_positions: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        self.saw_eval_inference.append(not self.training and torch.is_inference_mode_enabled())
        batch, length = tokens.shape
        logits = self.table[:length].expand(batch, length, -1)
        return logits if output_positions is None else logits[output_positions]


def random_model(tokenizer: Tokenizer, max_seq_len: int = 64, seed: int = 0) -> TableModel:
    generator = torch.Generator().manual_seed(seed)
    return TableModel(torch.randn(max_seq_len, tokenizer.get_vocab_size(), generator=generator))


def peaked_model(tokenizer: Tokenizer, start: int, peaks: list[float], max_seq_len: int = 64) -> TableModel:
    """Position start + j predicts token 10 + j with logit peaks[j] (all else 0): known confidences."""

    table = torch.zeros(max_seq_len, tokenizer.get_vocab_size())
    for j, peak in enumerate(peaks):
        table[start + j, 10 + j] = peak
    return TableModel(table)


def reveal_order(history: list[torch.Tensor], start: int) -> list[int]:
    """Positions (relative to `start`) in the order they stopped being masked, one per step."""

    order = []
    previous = history[0][0, start:] == MASK
    for tokens in history[1:]:
        now = tokens[0, start:] == MASK
        order += (previous & ~now).nonzero().flatten().tolist()
        previous = now
    return order


def recorded_generate(
    model: nn.Module, tokenizer: Tokenizer, length: int, **options: Any
) -> tuple[list[torch.Tensor], SampleResult]:
    """Unconditional generation of one sample, with the tokens before and after every step."""

    history: list[torch.Tensor] = []
    result = generate(model, tokenizer, length=length, on_step=lambda step, tokens: history.append(tokens), **options)
    return history, result


# ---------------------------------------------------------------------------------------------
# The reverse process


def test_same_seed_same_samples_other_seed_other_samples(tokenizer: Tokenizer) -> None:
    model = random_model(tokenizer)
    options = dict(prompt="ROMEO:", length=16, steps=8, num_samples=3, remasking="random")
    first = generate(model, tokenizer, seed=7, **options)
    again = generate(model, tokenizer, seed=7, **options)
    other = generate(model, tokenizer, seed=8, **options)
    assert first.token_ids == again.token_ids and first.texts == again.texts
    assert first.token_ids != other.token_ids
    # The samples of one batch are independent draws, not copies.
    assert len({tuple(row) for row in first.token_ids}) == 3


@pytest.mark.parametrize("remasking", ["random", "confidence", "margin"])
@pytest.mark.parametrize("block_length", [None, 5])
def test_every_mask_is_resolved_and_mask_pad_never_predicted(
    tokenizer: Tokenizer, remasking: str, block_length: int | None
) -> None:
    model = random_model(tokenizer)
    with torch.no_grad():
        # Make mask and pad the most likely tokens everywhere: they must still never be chosen.
        model.table[:, [MASK, PAD]] = 50.0
    result = generate(
        model, tokenizer, length=20, steps=7, num_samples=2, remasking=remasking, block_length=block_length
    )
    for row in result.token_ids:
        assert len(row) == 20
        assert MASK not in row and PAD not in row
    assert "<|mask|>" not in result.texts[0]


def test_prompt_is_kept_token_for_token(tokenizer: Tokenizer) -> None:
    prompt = "JULIET: O Romeo"
    prompt_ids = tokenizer.encode(prompt).ids
    result = generate(random_model(tokenizer), tokenizer, prompt=prompt, length=10, steps=5, num_samples=2)
    for row, text in zip(result.token_ids, result.texts, strict=True):
        assert row[: len(prompt_ids)] == prompt_ids and len(row) == len(prompt_ids) + 10
        assert text.startswith(prompt)


def test_infill_keeps_the_context_and_fills_only_the_spans(tokenizer: Tokenizer) -> None:
    template = "ROMEO: [MASK*6] fair Verona[MASK], where"
    pieces = [tokenizer.encode(piece).ids for piece in ("ROMEO: ", " fair Verona", ", where")]
    result = generate(random_model(tokenizer), tokenizer, text=template, steps=4, seed=3)
    row = result.token_ids[0]
    expected_layout = pieces[0] + [None] * 6 + pieces[1] + [None] + pieces[2]
    assert len(row) == len(expected_layout)
    for token, expected in zip(row, expected_layout, strict=True):
        if expected is None:
            assert token not in (MASK, PAD)
        else:
            assert token == expected
    assert result.texts[0].startswith("ROMEO: ") and result.texts[0].endswith(", where")


def test_confidence_commits_the_most_probable_positions_first(tokenizer: Tokenizer) -> None:
    peaks = [2.0, 9.0, 5.0, 7.0, 1.0, 3.0]
    model = peaked_model(tokenizer, 0, peaks)
    history, result = recorded_generate(
        model, tokenizer, length=len(peaks), steps=len(peaks), temperature=0.0, remasking="confidence"
    )
    assert reveal_order(history, 0) == sorted(range(len(peaks)), key=lambda j: -peaks[j])
    # Greedy decoding picks each position's peak token.
    assert result.token_ids[0] == [10 + j for j in range(len(peaks))]


def test_margin_ranks_by_top1_minus_top2_not_by_top1(tokenizer: Tokenizer) -> None:
    # Position 0: a high but contested top-1; position 1: a lower top-1 far ahead of the rest.
    table = torch.zeros(8, tokenizer.get_vocab_size())
    table[0, 10], table[0, 11] = 5.0, 4.9
    table[1, 12] = 4.0
    table[2, 13], table[2, 14] = 4.6, 4.0
    probs = table[:3].clone()
    probs[:, [MASK, PAD]] = float("-inf")
    top2 = probs.softmax(-1).topk(2, dim=-1).values
    by_confidence = top2[:, 0].argsort(descending=True).tolist()
    by_margin = (top2[:, 0] - top2[:, 1]).argsort(descending=True).tolist()
    assert by_confidence != by_margin  # the stub really separates the two rules

    for remasking, expected in (("confidence", by_confidence), ("margin", by_margin)):
        history, _ = recorded_generate(
            TableModel(table), tokenizer, length=3, steps=3, temperature=0.0, remasking=remasking
        )
        assert reveal_order(history, 0) == expected, remasking


def test_blocks_are_filled_left_to_right(tokenizer: Tokenizer) -> None:
    # Confidence grows to the right, so without blocks the right end would be revealed first.
    peaks = [float(j) for j in range(12)]
    model = peaked_model(tokenizer, 0, peaks)
    history, result = recorded_generate(
        model, tokenizer, length=12, steps=6, block_length=4, temperature=0.0, remasking="confidence"
    )
    assert len(history) == 1 + 6
    for step, tokens in enumerate(history[1:], start=1):
        revealed = (tokens[0] != MASK).tolist()
        finished_blocks = step // 2  # two steps per block
        assert all(revealed[: 4 * finished_blocks])
        assert not any(revealed[4 * (finished_blocks + (step % 2)) :])
    assert MASK not in result.token_ids[0]


def test_steps_are_split_over_blocks_and_must_cover_them(tokenizer: Tokenizer) -> None:
    model = random_model(tokenizer)
    steps_seen: list[int] = []
    generate(model, tokenizer, length=10, steps=7, block_length=4, on_step=lambda s, t: steps_seen.append(s))
    assert steps_seen == list(range(0, 8))
    with pytest.raises(UserError, match="--steps"):
        generate(model, tokenizer, length=10, steps=2, block_length=4)


@pytest.mark.parametrize("remasking", ["random", "dilated", "confidence", "margin"])
def test_forward_passes_counted_and_skipped_when_nothing_is_revealed(tokenizer: Tokenizer, remasking: str) -> None:
    model = random_model(tokenizer)
    result = generate(model, tokenizer, length=5, steps=40, remasking=remasking, seed=1)
    assert result.forward_passes == model.calls
    assert result.steps == 40
    if remasking == "random":
        assert 1 <= result.forward_passes <= 5
    else:
        assert result.forward_passes == 5  # exactly one token revealed per pass
    few_steps = random_model(tokenizer)
    assert generate(few_steps, tokenizer, length=20, steps=4, remasking=remasking).forward_passes <= 4


def test_the_dilated_order_visits_every_position_and_spreads_every_step() -> None:
    for size in range(1, 70):
        assert sorted(dilated_order(size).tolist()) == list(range(size))
    order = dilated_order(64).tolist()
    assert order[:8] == [0, 32, 16, 48, 8, 40, 24, 56]
    for step in range(8):  # 8 a step: each step's positions lie 8 apart
        revealed = sorted(order[8 * step : 8 * step + 8])
        assert [b - a for a, b in itertools.pairwise(revealed)] == [8] * 7, step
    assert sorted(order[32:]) == list(range(1, 64, 2))  # the odd positions last: both neighbours known


def test_dilated_remasking_reveals_the_planned_positions_one_pass_a_step(tokenizer: Tokenizer) -> None:
    model = random_model(tokenizer)
    history, result = recorded_generate(model, tokenizer, length=16, steps=4, remasking="dilated", seed=3)
    assert result.forward_passes == model.calls == 4
    revealed = []
    for before, after in itertools.pairwise(history):
        revealed.append(sorted(((before[0] == MASK) & (after[0] != MASK)).nonzero().flatten().tolist()))
    assert revealed == [[0, 4, 8, 12], [2, 6, 10, 14], [1, 5, 9, 13], [3, 7, 11, 15]]
    assert MASK not in result.token_ids[0]
    # The order is planned, so the tokens are the only draws: another seed, other tokens, same order.
    other, theirs = recorded_generate(model, tokenizer, length=16, steps=4, remasking="dilated", seed=4)
    assert [(h == MASK).tolist() for h in other] == [(h == MASK).tolist() for h in history]
    assert theirs.token_ids != result.token_ids


def test_reveal_counts_follow_the_linear_schedule() -> None:
    for n in (1, 5, 12, 64):
        for steps in (1, 3, 12, 100):
            counts = [reveal_count(n, steps, step) for step in range(steps)]
            assert sum(counts) == n and min(counts) >= 0
            # floor(n * s) positions are still masked at time s = 1 - (step + 1) / steps.
            masked = n
            for step, count in enumerate(counts):
                masked -= count
                assert masked == (n * (steps - step - 1)) // steps


def test_generate_runs_in_eval_inference_mode_and_restores_training(tokenizer: Tokenizer) -> None:
    model = random_model(tokenizer)
    model.train()
    generate(model, tokenizer, length=4, steps=2)
    assert model.training
    assert model.saw_eval_inference and all(model.saw_eval_inference)


def test_real_transformer_smoke(tokenizer: Tokenizer) -> None:
    from dlm.model.transformer import DiffusionTransformer

    config = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        max_seq_len=32,
        d_model=32,
        n_layers=1,
        n_heads=2,
        pad_vocab_multiple=64,
    )
    torch.manual_seed(0)
    model = DiffusionTransformer(config)
    for remasking in ("random", "margin"):
        result = generate(model, tokenizer, prompt="ROMEO:", length=8, steps=4, num_samples=2, remasking=remasking)
        assert all(MASK not in row and PAD not in row for row in result.token_ids)
        assert 1 <= result.forward_passes <= 4 and result.seconds >= 0


# ---------------------------------------------------------------------------------------------
# Token sampling


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.9)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.1)).tolist() == [[True, False, False, False]]
    # The kept tokens are the most likely ones wherever they sit in the vocabulary.
    shuffled = logits[:, [2, 0, 3, 1]]
    assert torch.isfinite(filter_logits(shuffled, top_k=2)).tolist() == [[False, True, False, True]]
    assert torch.isfinite(filter_logits(shuffled, top_p=0.7)).tolist() == [[False, True, False, True]]

    generator = torch.Generator().manual_seed(0)
    many = logits.expand(4000, -1)
    assert set(sample_tokens(many, top_k=2, generator=generator).tolist()) == {0, 1}
    assert set(sample_tokens(many, top_p=0.9, generator=generator).tolist()) == {0, 1, 2}
    assert set(sample_tokens(many, generator=generator).tolist()) == {0, 1, 2, 3}


def test_gumbel_sampling_matches_the_distribution_and_temperature() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    many = probs.log().expand(20000, -1)
    generator = torch.Generator().manual_seed(0)
    frequencies = torch.bincount(sample_tokens(many, generator=generator), minlength=3) / 20000
    assert torch.allclose(frequencies, probs, atol=0.015)
    # Temperature 0.5 squares the odds: p ∝ (0.36, 0.09, 0.01).
    sharp = torch.bincount(sample_tokens(many, temperature=0.5, generator=generator), minlength=3) / 20000
    assert torch.allclose(sharp, torch.tensor([0.36, 0.09, 0.01]) / 0.46, atol=0.015)
    assert sample_tokens(many[:5], temperature=0.0).tolist() == [0] * 5


# ---------------------------------------------------------------------------------------------
# Templates, prompts and options


def test_template_parsing() -> None:
    assert parse_template("ROMEO: [MASK*20] fair Verona") == ["ROMEO: ", 20, " fair Verona"]
    assert parse_template("[MASK]a[MASK*2][MASK]") == [1, "a", 2, 1]
    assert parse_template("[MASKED] [MASK]") == ["[MASKED] ", 1]
    for bad, message in (("a [MASK*x] b", "malformed"), ("a [MASK*0]", "no tokens"), ("no spans", "no \\[MASK\\]")):
        with pytest.raises(UserError, match=message):
            parse_template(bad)


def test_build_sequence_marks_positions_to_fill(tokenizer: Tokenizer) -> None:
    prompt_ids = tokenizer.encode("Ro").ids
    parts = check_request(prompt="Ro", length=3)
    ids, fill = build_sequence(tokenizer, parts, templated=False, mask_token_id=MASK, max_seq_len=64)
    assert ids == prompt_ids + [MASK] * 3 and fill == [False] * len(prompt_ids) + [True] * 3
    parts = check_request(length=2)
    assert build_sequence(tokenizer, parts, templated=False, mask_token_id=MASK, max_seq_len=64) == (
        [MASK, MASK],
        [True, True],
    )
    parts = check_request(text="Ro[MASK*2]")
    ids, fill = build_sequence(tokenizer, parts, templated=True, mask_token_id=MASK, max_seq_len=64)
    assert ids == prompt_ids + [MASK] * 2 and fill == [False] * len(prompt_ids) + [True] * 2


def test_too_long_or_conflicting_inputs_raise_user_errors(tokenizer: Tokenizer) -> None:
    model = random_model(tokenizer, max_seq_len=16)
    with pytest.raises(UserError, match=r"--prompt .*--length .*max_seq_len \(16\)"):
        generate(model, tokenizer, prompt="ROMEO: But soft", length=14)
    with pytest.raises(UserError, match=r"--text template .*max_seq_len"):
        generate(model, tokenizer, text="ROMEO: [MASK*20]")
    with pytest.raises(UserError, match="cannot be combined"):
        generate(model, tokenizer, prompt="a", text="[MASK]")
    with pytest.raises(UserError, match="mask token itself"):
        generate(model, tokenizer, prompt="a <|mask|> b", length=2)
    for bad, option in (({"num_samples": 0}, "--num-samples"), ({"seed": -1}, "--seed"), ({"length": 0}, "--length")):
        with pytest.raises(UserError, match=option):
            generate(model, tokenizer, **{"length": 2, **bad})


@pytest.mark.parametrize(
    ("options", "option_name"),
    [
        ({"steps": 0}, "--steps"),
        ({"temperature": -1.0}, "--temperature"),
        ({"temperature": float("nan")}, "--temperature"),
        ({"top_k": 0}, "--top-k"),
        ({"top_p": 0.0}, "--top-p"),
        ({"top_p": 1.5}, "--top-p"),
        ({"remasking": "lowest"}, "--remasking"),
        ({"block_length": 0}, "--block-length"),
    ],
)
def test_bad_sampling_options_name_the_option(options: dict[str, object], option_name: str) -> None:
    with pytest.raises(UserError, match=option_name):
        SamplingOptions(**options)  # type: ignore[arg-type]


def test_split_masked_and_live_rendering(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("ROMEO").ids, MASK, MASK, *tokenizer.encode(" fair").ids, MASK]
    assert split_masked(tokenizer, ids, MASK) == ["ROMEO", 2, " fair", 1]
    console = Console(record=True, width=60, color_system=None)
    console.print(render_samples(tokenizer, torch.tensor([ids, ids]), MASK, 3, 8))
    shown = console.export_text()
    assert f"ROMEO{MASK_GLYPH * 2} fair{MASK_GLYPH}" in shown
    assert "sample 2/2" in shown and "step 3/8" in shown


# ---------------------------------------------------------------------------------------------
# The `dlm sample` command


@pytest.fixture()
def fake_export(monkeypatch: pytest.MonkeyPatch, tokenizer: Tokenizer) -> Iterator[list[object]]:
    """`dlm.artifacts.loading.load_model` replaced by one returning a stand-in model and the tiny tokenizer."""

    loaded: list[object] = []

    def load_model(path: object, device: str = "cpu", dtype: torch.dtype | None = None) -> tuple[nn.Module, Tokenizer]:
        loaded.append((path, device))
        return random_model(tokenizer), tokenizer

    monkeypatch.setattr("dlm.artifacts.loading.load_model", load_model)
    yield loaded


def test_cli_sample_json_and_plain(fake_export: list[object]) -> None:
    runner = CliRunner()
    args = ["sample", "model-dir", "--prompt", "ROMEO:", "--length", "6", "--steps", "3", "--seed", "5"]
    result = runner.invoke(app, [*args, "--json", "--num-samples", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert len(payload["texts"]) == 2 and all(text.startswith("ROMEO:") for text in payload["texts"])
    assert payload["steps"] == 3 and 1 <= payload["forward_passes"] <= 3 and payload["seconds"] >= 0
    assert fake_export[0] == (Path("model-dir"), "cpu")

    plain = runner.invoke(app, [*args, "--num-samples", "2", "--device", "cpu"])
    assert plain.exit_code == 0, plain.output
    assert "=== sample 2/2 ===" in plain.output
    assert payload["texts"][0] in plain.output  # same seed, same device: same text


def test_cli_sample_infill_and_user_errors(fake_export: list[object], capsys: pytest.CaptureFixture[str]) -> None:
    result = CliRunner().invoke(app, ["sample", "m", "--text", "ROMEO: [MASK*4] Verona", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ROMEO: ") and result.output.rstrip("\n").endswith(" Verona")

    for argv, option in (
        (["--top-p", "2"], "--top-p"),
        (["--device", "tpu"], "--device"),
        (["--text", "no spans here"], "--text"),
        (["--prompt", "a", "--text", "[MASK]"], "--prompt"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["sample", "m", *argv])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert error.startswith("error:") and option in error and "Traceback" not in error
    assert len(fake_export) == 1  # bad options fail before the model is loaded


def test_cli_sample_live_view_on_a_terminal(fake_export: list[object], monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from dlm.cli import sample_cmd

    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=80, color_system=None)
    monkeypatch.setattr(sample_cmd, "console", terminal)
    frames: list[object] = []
    real_render = sample_cmd.render_samples
    monkeypatch.setattr(sample_cmd, "render_samples", lambda *args: frames.append(args[3]) or real_render(*args))
    # Confidence remasking reveals at every step (random may skip a step's model call).
    result = CliRunner().invoke(
        app, ["sample", "m", "--length", "6", "--steps", "3", "--device", "cpu", "--remasking", "confidence"]
    )
    assert result.exit_code == 0, result.output
    assert frames == [0, 1, 2, 3]  # the all-masked start, then one frame per step
    shown = screen.getvalue()
    assert "3 steps, 3 forward passes" in shown and "sample" in shown


def test_the_measured_defaults_are_those_of_dlm_sample_the_cli_and_the_exported_sampler() -> None:
    import inspect

    from dlm.cli.sample_cmd import sample as sample_command

    # Chosen by scripts/sampler_defaults.py (git history): random (ancestral) reveals with nucleus sampling.
    expected = {"temperature": 1.0, "top_p": 0.9, "remasking": "random"}
    options = SamplingOptions()
    assert {name: getattr(options, name) for name in expected} == expected
    functions: list[Any] = [generate, sample_command]
    try:  # the exported model's sampler needs transformers (the hf extra)
        from dlm.artifacts.hf.modeling_dlm import DlmDiffusionForMaskedLM

        functions.append(DlmDiffusionForMaskedLM.diffusion_generate)
    except ImportError:
        pass
    for function in functions:
        defaults = {name: inspect.signature(function).parameters[name].default for name in expected}
        if defaults["remasking"] is None:  # the model's own: a distilled student's order, else random
            defaults["remasking"] = sampling_remasking(nn.Linear(1, 1), None)
        assert defaults == expected, function


def test_a_sampler_strategy_registered_outside_the_library_runs_the_reverse_process(tokenizer: Tokenizer) -> None:
    from dlm.sampling.dispatch import register_strategy, strategy_names, unregister_strategy
    from dlm.sampling.reverse import ReverseContext, Strategy, sequence_blocks

    def left_to_right(
        model: Any, tokens: torch.Tensor, fill_mask: torch.Tensor, options: SamplingOptions, context: ReverseContext
    ) -> tuple[torch.Tensor, int]:
        """Greedy, one position per forward pass, left to right."""
        tokens, _blocks = sequence_blocks(tokens, fill_mask, options, model.config.mask_token_id)
        for position in fill_mask.nonzero().squeeze(-1).tolist():
            logits = model(tokens)[:, position].clone()
            logits[:, [model.config.mask_token_id, *context.forbidden_token_ids]] = float("-inf")
            tokens[:, position] = logits.argmax(dim=-1)
        return tokens, int(fill_mask.sum())

    model = random_model(tokenizer)
    assert strategy_names() == ("autoregressive", "block model", "fast", "plain")
    register_strategy(Strategy("left to right", lambda model, options, stop: options.temperature == 0, left_to_right))
    try:
        assert strategy_names() == ("left to right", "autoregressive", "block model", "fast", "plain")
        ours = generate(model, tokenizer, prompt="ROMEO:", length=6, steps=3, temperature=0)
        start = ours.prompt_tokens[0]
        table = model.table.detach()[start : start + 6].clone()
        table[:, [1, 2]] = float("-inf")  # the mask and pad tokens are never predicted
        assert ours.forward_passes == 6 and ours.token_ids[0][start:] == table.argmax(dim=-1).tolist()
        sampled = generate(model, tokenizer, prompt="ROMEO:", length=6, steps=3, seed=1)  # temperature 1: plain
        assert sampled.forward_passes <= 3
        with pytest.raises(ValueError, match="already registered"):
            register_strategy(Strategy("left to right", lambda *args: True, left_to_right))
    finally:
        unregister_strategy("left to right")
    assert strategy_names() == ("autoregressive", "block model", "fast", "plain")


def test_a_remasking_strategy_registered_outside_the_library_ranks_the_reveals(tokenizer: Tokenizer) -> None:
    from dlm.sampling.remasking import register_remasking, remasking_names, unregister_remasking

    model = random_model(tokenizer)
    calls: list[int] = []

    def least_confident(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        calls.append(len(tokens))
        return -probs.gather(-1, tokens[:, None]).squeeze(-1)  # reveal the least likely sample first

    register_remasking("least_confident", least_confident)
    try:
        assert remasking_names() == ("random", "dilated", "confidence", "margin", "least_confident")
        ours = generate(model, tokenizer, length=12, steps=4, seed=5, remasking="least_confident")
        theirs = generate(model, tokenizer, length=12, steps=4, seed=5, remasking="confidence")
        assert calls and ours.texts != theirs.texts  # the ranking decided what was revealed
        with pytest.raises(ValueError, match="already registered"):
            register_remasking("least_confident", least_confident)
    finally:
        unregister_remasking("least_confident")
    with pytest.raises(UserError, match="--remasking must be one of random, dilated, confidence, margin"):
        generate(model, tokenizer, length=12, steps=4, seed=5, remasking="least_confident")


def test_sampling_leaves_fsdp_unimported_and_a_sharded_model_runs_without_grad(tmp_path: Path) -> None:
    """A fresh process that samples never imports FSDP (its import alone costs a noticeable part of
    a second); a model FSDP shards is still told apart, and runs under no_grad, since its
    parameters cannot be inference tensors."""

    script = """
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
from dlm.config.schema import ModelConfig
from dlm.model.transformer import DiffusionTransformer
from dlm.sampling.dispatch import inference

config = ModelConfig(vocab_size=64, max_seq_len=16, d_model=16, n_layers=1, n_heads=2, pad_vocab_multiple=1)
model = DiffusionTransformer(config)
with inference(model):
    mode = torch.is_inference_mode_enabled()
print("plain", mode, "torch.distributed.fsdp" in sys.modules)
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1, timeout=timedelta(seconds=60))
from torch.distributed.fsdp import fully_shard
fully_shard(model)
with inference(model):
    print("sharded", torch.is_inference_mode_enabled(), torch.is_grad_enabled())
dist.destroy_process_group()
"""
    rendezvous = (tmp_path / "rendezvous").as_uri()
    done = subprocess.run(
        [sys.executable, "-c", script, rendezvous], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["plain True False", "sharded False False"]
