"""`dlm bench --generate`: settings, quality figures and the table, on small stand-in models."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_sampling
import torch
from test_fast_sampling import small_transformer
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from dlm.bench.generation import (
    GenerateReport,
    GenerateRow,
    benchmark_generation,
    judge_nll,
    parse_generate_compare,
    report_table,
    unigram_entropy,
)
from dlm.cli import app
from dlm.config.schema import ModelConfig
from dlm.errors import UserError
from dlm.model.transformer import DiffusionTransformer
from dlm.sampling import generation

tokenizer = pytest.fixture(scope="module")(test_sampling.tokenizer.__wrapped__)


def test_unigram_entropy_in_bits() -> None:
    assert unigram_entropy([[1, 1], [2, 2]]) == 1.0
    assert unigram_entropy([[5, 5, 5]]) == 0.0
    assert math.isclose(unigram_entropy([[1, 2, 3, 4]]), 2.0)


def test_compare_makes_every_combination_with_typed_values() -> None:
    settings = parse_generate_compare(["cache=none,dual", "threshold=none,0.9", "block-length=8"])
    assert settings == [
        {"cache": "none", "threshold": None, "block_length": 8},
        {"cache": "none", "threshold": 0.9, "block_length": 8},
        {"cache": "dual", "threshold": None, "block_length": 8},
        {"cache": "dual", "threshold": 0.9, "block_length": 8},
    ]
    for bad in (["optimizer=adamw"], ["steps"], ["steps=many"]):
        with pytest.raises(UserError, match="--compare"):
            parse_generate_compare(bad)


def test_autoregressive_judge_scores_the_exact_likelihood(tokenizer: Tokenizer) -> None:
    config = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        max_seq_len=16,
        d_model=32,
        n_layers=1,
        n_heads=2,
        pad_vocab_multiple=64,
        block_size=1,
    )
    torch.manual_seed(0)
    judge = DiffusionTransformer(config).eval()
    rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    nll = judge_nll(judge, rows, seed=0)
    assert nll == judge_nll(judge, rows, seed=1)  # no Monte Carlo
    # The same figure token by token: position i predicted from the clean tokens before it alone.
    total = 0.0
    with torch.inference_mode():
        for row in rows:
            for i, token in enumerate(row):
                prefix = torch.tensor([[*row[:i], config.mask_token_id]])
                logits = judge(prefix, output_positions=prefix == config.mask_token_id)
                total -= float(logits.double().log_softmax(-1)[0, token])
    assert math.isclose(nll, total / 9, rel_tol=1e-5)


def test_benchmark_rows_report_speed_and_quality(tokenizer: Tokenizer) -> None:
    model = small_transformer(tokenizer.get_vocab_size())
    runs: list[str] = []
    report = benchmark_generation(
        model,
        tokenizer,
        length=16,
        num_samples=2,
        mc_samples=2,
        repeats=2,
        compare=["block_length=8", "cache=none,dual"],
        progress=runs.append,
    )
    # Interleaved rounds: every setting once per round, so a busy machine slows them alike.
    assert [(run.split(":")[0], "'dual'" in run) for run in runs] == [
        ("round 1/2", False),
        ("round 1/2", True),
        ("round 2/2", False),
        ("round 2/2", True),
    ]
    none, dual = report.rows
    assert none.generated_tokens == dual.generated_tokens == 32
    assert none.tokens_per_second > 0 and 0 < none.passes_per_token <= 1
    assert dual.forward_tokens_per_token < none.forward_tokens_per_token
    assert all(0 < row.cpu_seconds < math.inf and row.tokens_per_cpu_second > 0 for row in report.rows)
    assert all(math.isfinite(row.judge_perplexity) and row.judge_perplexity > 1 for row in report.rows)
    headers, table = report_table(report)
    assert headers[1] == "tokens/s" and table[1][0] == "block_length=8 cache=dual"


@pytest.mark.parametrize("block_size", [1, 2])
def test_block_and_autoregressive_models_bench_with_their_defaults(tokenizer: Tokenizer, block_size: int) -> None:
    # The warm-up, like the default row, takes one step a token: what a model with short blocks accepts.
    config = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        max_seq_len=16,
        d_model=32,
        n_layers=1,
        n_heads=2,
        pad_vocab_multiple=64,
        block_size=block_size,
    )
    torch.manual_seed(0)
    model = DiffusionTransformer(config).eval()
    report = benchmark_generation(model, tokenizer, length=12, num_samples=2, mc_samples=2)
    (row,) = report.rows
    assert report.default_row() is row and row.generated_tokens == 24
    assert math.isfinite(row.judge_perplexity) and row.judge_perplexity > 1
    # One pass a token for the autoregressive model; a block model also stores each finished block.
    assert row.passes_per_token == 1.0 if block_size == 1 else 1.0 < row.passes_per_token <= 1.5


def test_cli_bench_generate_json_and_table(exports: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["bench", "--generate", "m", "--length", "8", "--num-samples", "1", "--compare", "threshold=none,0.5"]
    result = CliRunner().invoke(app, [*args, "--repeats", "2", "--seed", "3", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert [row["setting"] for row in payload["rows"]] == [{"threshold": None}, {"threshold": 0.5}]
    assert payload["judge"] == "the model itself" and payload["length"] == 8 and payload["repeats"] == 2
    assert payload["seed"] == 3 and payload["dtype"] == "float32"  # the stand-in's, as it computed
    monkeypatch.setattr("dlm.cli.bench_cmd.wants_json", lambda flag: flag)  # the table, as on a terminal
    table = CliRunner().invoke(app, [*args, "--repeats", "1"])
    assert table.exit_code == 0 and "the model in float32; judge: the model itself" in " ".join(table.output.split())
    asked = CliRunner().invoke(app, [*args, "--repeats", "1", "--dtype", "bfloat16", "--json"])
    assert asked.exit_code == 0 and json.loads(asked.output)["dtype"] == "bfloat16", asked.output
    missing = CliRunner().invoke(app, ["bench"])
    assert isinstance(missing.exception, UserError) and "--generate" in str(missing.exception)


def word_tokenizer(words: list[str]) -> Tokenizer:
    """A word-level tokenizer with the project's special tokens first: another vocabulary than `tokenizer`'s."""

    vocab = {word: index for index, word in enumerate(["<|endoftext|>", "<|mask|>", "<|pad|>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.fixture()
def exports(monkeypatch: pytest.MonkeyPatch, tokenizer: Tokenizer) -> list[int]:
    """Stand-in exports by name: `m` and `same` share `tokenizer`, `small` and `big` have smaller and larger
    vocabularies of their own. Returns the list the patched `generate` appends to on each call."""

    big = Tokenizer(models.BPE())
    big.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|mask|>", "<|pad|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    big.train_from_iterator([*test_sampling.CORPUS, "other words, other merges: a larger vocabulary"], trainer)
    tokenizers = {
        "m": tokenizer,
        "same": Tokenizer.from_str(tokenizer.to_str()),
        "big": big,
        "small": word_tokenizer(["ROMEO:", "JULIET:", "Verona"]),
    }
    assert tokenizers["small"].get_vocab_size() < tokenizer.get_vocab_size() < big.get_vocab_size()

    def load_model_with_info(path: object, device: str = "cpu", dtype: torch.dtype | None = None) -> SimpleNamespace:
        tok = tokenizers[str(path)]
        config = ModelConfig(
            vocab_size=tok.get_vocab_size(), max_seq_len=16, d_model=32, n_layers=1, n_heads=2, pad_vocab_multiple=1
        )
        torch.manual_seed(0)
        info = SimpleNamespace(tokenizer_path=Path(f"{path}/tokenizer.json"))
        model = DiffusionTransformer(config).to(dtype or torch.float32).eval()  # float32: as stored
        return SimpleNamespace(model=model, tokenizer=tok, info=info)

    def load_model(path: object, device: str = "cpu", dtype: torch.dtype | None = None) -> tuple[object, Tokenizer]:
        loaded = load_model_with_info(path, device, dtype)
        return loaded.model, loaded.tokenizer

    calls: list[int] = []
    real_generate = generation.generate

    def generate(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real_generate(*args, **kwargs)

    monkeypatch.setattr("dlm.artifacts.loading.load_model_with_info", load_model_with_info)
    monkeypatch.setattr("dlm.artifacts.loading.load_model", load_model)
    monkeypatch.setattr(generation, "generate", generate)
    return calls


@pytest.mark.parametrize("judge", ["small", "big"])
def test_a_judge_with_another_tokenizer_is_refused_before_generating(exports: list[int], judge: str, run_cli) -> None:
    # A smaller vocabulary cannot index the generated ids; a larger one scores other text: both refused.
    result = run_cli("bench", "--generate", "m", "--judge", judge, "--length", "8", "--num-samples", "2")
    model, other = Path("m", "tokenizer.json"), Path(judge, "tokenizer.json")
    result.assert_refused(
        f"error: the judge's tokenizer {other} (",
        f"is not the model's {model} (300 tokens)",
        "the judge scores the generated token ids",
    )
    assert result.stdout == "" and exports == []  # nothing generated


def test_a_judge_with_the_same_tokenizer_scores(exports: list[int], run_cli) -> None:
    result = run_cli("bench", "--generate", "m", "--judge", "same", "--length", "8", "--num-samples", "1", "--json")
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["judge"] == "same" and math.isfinite(payload["rows"][0]["judge_perplexity"])
    assert len(exports) == 2  # the warm-up and the one setting


TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
# Each option that one mode reads alone, as given on a command line (the config file need not exist: the
# refusal comes first).
TRAINING_ONLY = {
    "config": ["--config", "tiny.toml"],
    "overrides": ["--set", "training.batch_size=2"],
    "fused_attention": ["--fused-attention"],
    "steps": ["--steps", "3"],
    "warmup": ["--warmup", "0"],
    "batch_size": ["--batch-size", "2"],
    "find_max_batch": ["--find-max-batch"],
    "memory_limit": ["--memory-limit", "1"],
    "measure_peak": ["--measure-peak"],
    "estimate": ["--estimate"],
    "device_memory": ["--device-memory", "24"],
}
GENERATION_ONLY = {
    "judge": ["--judge", "m"],
    "length": ["--length", "8"],
    "num_samples": ["--num-samples", "2"],
    "repeats": ["--repeats", "2"],
    "seed": ["--seed", "0"],
    "dtype": ["--dtype", "float32"],
}


def test_every_bench_option_belongs_to_a_mode_or_to_both() -> None:
    import inspect

    from dlm.cli.bench_cmd import MODE_OPTIONS, bench_command

    both = {"ctx", "compare", "device", "as_json", "generate"}
    assert set(MODE_OPTIONS["training"]) == set(TRAINING_ONLY)
    assert set(MODE_OPTIONS["generation"]) == set(GENERATION_ONLY)
    assert set(inspect.signature(bench_command).parameters) == both | set(TRAINING_ONLY) | set(GENERATION_ONLY)


@pytest.mark.parametrize("name", list(TRAINING_ONLY))
def test_a_training_option_is_refused_with_generate(exports: list[int], name: str, run_cli) -> None:
    # The default value given explicitly is refused too: what counts is that the user gave it.
    result = run_cli("bench", "--generate", "m", "--length", "8", *TRAINING_ONLY[name])
    flag = TRAINING_ONLY[name][0]
    result.assert_refused(f"error: {flag} does not apply to --generate", f"(drop {flag}")
    assert ("--compare steps=N" in result.stderr) == (flag == "--steps")  # where the sampler's steps go
    assert result.stdout == "" and exports == []


@pytest.mark.parametrize("name", list(GENERATION_ONLY))
def test_a_generation_option_is_refused_without_generate(exports: list[int], name: str, run_cli) -> None:
    # A config that would run: the refusal must not depend on the config failing.
    result = run_cli("bench", "--config", TINY, "--steps", "1", "--warmup", "0", *GENERATION_ONLY[name])
    flag = GENERATION_ONLY[name][0]
    result.assert_refused(f"error: {flag} does not apply without --generate", "--generate MODEL")
    assert result.stdout == ""


def test_every_misplaced_option_is_named_in_one_line(exports: list[int], run_cli) -> None:
    result = run_cli("bench", "--generate", "m", "--steps", "3", "--batch-size", "2", "--compare", "steps=4")
    result.assert_refused("error: --steps, --batch-size do not apply to --generate")
    result = run_cli("bench", "--judge", "m", "--seed", "1", "--length", "4")
    result.assert_refused("error: --judge, --length, --seed do not apply without --generate")


def test_a_length_past_the_context_names_benchs_own_options(exports: list[int], run_cli) -> None:
    result = run_cli("bench", "--generate", "m", "--length", "100")
    result.assert_refused("error: --length (100) is more than the model's max_seq_len (16)", "lower --length")
    assert "--prompt" not in result.stderr and exports == []


def _row(setting: dict[str, object], tokens_per_second: float, perplexity: float, entropy: float) -> GenerateRow:
    return GenerateRow(
        setting=setting,
        generated_tokens=64,
        seconds=64 / tokens_per_second,
        tokens_per_second=tokens_per_second,
        passes_per_token=1.0,
        forward_tokens_per_token=64.0,
        judge_perplexity=perplexity,
        unigram_entropy_bits=entropy,
        example="",
        cpu_seconds=32 / tokens_per_second,
        tokens_per_cpu_second=2 * tokens_per_second,
    )


def test_rows_are_compared_with_the_default_sampler_of_the_same_run() -> None:
    report = GenerateReport(
        length=64,
        num_samples=16,
        judge="j",
        rows=[
            _row({"block_length": 8, "cache": "dual", "threshold": None, "steps": 64}, 500.0, 109.0, 7.0),
            _row({"block_length": None, "cache": "none", "threshold": None, "steps": 64}, 100.0, 100.0, 7.0),
            _row({"block_length": None, "cache": "none", "threshold": None, "steps": 16}, 300.0, 120.0, 6.3),
            _row({"block_length": 8, "cache": "dual", "threshold": None, "steps": 32}, 800.0, 105.0, 7.28),
        ],
    )
    assert report.default_row() is report.rows[1]
    relative = report.relative()
    assert relative is not None
    assert [r.speedup for r in relative] == [r.cpu_speedup for r in relative] == [5.0, 1.0, 3.0, 8.0]
    assert [r.perplexity_change for r in relative] == pytest.approx([0.09, 0.0, 0.2, 0.05])
    assert [r.entropy_change for r in relative] == pytest.approx([0.0, 0.0, -0.1, 0.04])
    # The frontier: nothing else is both faster and lower in judge perplexity.
    assert [r.frontier for r in relative] == [False, True, False, True]
    assert [r.within(0.10, 0.05) for r in relative] == [True, True, False, True]
    headers, table = report_table(report)
    assert headers[:4] == ["setting", "tokens/s", "x default", "x default (CPU s)"]
    assert [row[2] for row in table] == [row[3] for row in table] == ["5.00", "1.00", "3.00", "8.00"]
    assert report.to_dict()["relative_to_default"][3]["speedup"] == 8.0
    # Without the default sampler among the settings there is nothing to compare with.
    report.rows.pop(1)
    assert report.default_row() is None and report.relative() is None
    assert "x default" not in report_table(report)[0] and report.to_dict()["relative_to_default"] is None


def test_the_default_row_is_the_sampler_with_no_option_changed() -> None:
    report = GenerateReport(
        length=32,
        num_samples=1,
        judge="j",
        rows=[_row({"steps": 16}, 1.0, 2.0, 3.0), _row({"top_p": 0.5}, 1.0, 2.0, 3.0), _row({}, 1.0, 2.0, 3.0)],
    )
    assert report.default_row() is report.rows[2]
    report.rows[2] = _row({"steps": 32, "top_p": 0.9, "remasking": "random", "cache": "none"}, 1.0, 2.0, 3.0)
    assert report.default_row() is report.rows[2]
