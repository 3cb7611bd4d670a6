"""Sizing warnings: a vocabulary, a model or a step count too large for the training text.

`dlm tokenizer train` counts how often each learned token occurs in its corpus; `dlm validate` counts
them in train.bin and compares parameters and epochs with the training tokens. Each warns (a
`warning:` line, a `warning` row) and never changes an exit code.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dlm.assets import shakespeare_files
from dlm.config.schema import load_config
from dlm.config.shapes import count_parameters, format_parameter_count
from dlm.data.dataset import load_packed_dataset, token_counts
from dlm.data.pack import pack_corpus
from dlm.data.sizing import (
    MAX_EPOCHS,
    MAX_PARAMETERS_PER_TOKEN,
    MIN_TOKENS_PER_ENTRY,
    VocabularyFit,
    budget_advice,
    model_advice,
    vocabulary_fit,
)
from dlm.data.tokenizer import MIN_VOCAB_SIZE, train_tokenizer
from dlm.train.preflight import ensure_valid, validate_config_file

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
# All's Well That Ends Well: 134 kB of text, 44,013 tokens with a 2048-token tokenizer trained on
# it (21 an entry, too few); 512 tokens give it 113 an entry.
PLAY = shakespeare_files("train")[:1]
PLAY_WARNING = (
    "2048 tokens for 134 kB of text (44,013 tokens): 21 per entry (62% of the 1,789 learned tokens occur fewer "
    "than 10 times), under 64: too few to learn them; about 512 suit this size (retrain with --vocab-size 512, "
    "or train on more text)"
)


def test_the_vocabulary_is_too_large_under_64_tokens_an_entry() -> None:
    counts = np.zeros(MIN_VOCAB_SIZE + 4, dtype=np.int64)
    counts[:MIN_VOCAB_SIZE] = 60  # bytes and specials count as tokens of the text, not as learned ones
    counts[MIN_VOCAB_SIZE:] = [9, 10, 10, 10]
    fit = vocabulary_fit(counts, MIN_VOCAB_SIZE + 4, MIN_VOCAB_SIZE)
    assert (fit.learned, fit.rare, fit.rare_share, fit.tokens) == (4, 1, 0.25, 60 * MIN_VOCAB_SIZE + 39)
    assert fit.tokens_per_entry < MIN_TOKENS_PER_ENTRY and fit.too_large
    counts[:MIN_VOCAB_SIZE] = 65  # 64.1 tokens an entry
    assert vocabulary_fit(counts, MIN_VOCAB_SIZE + 4, MIN_VOCAB_SIZE).too_large is False
    # A token id the text never reaches counts 0 times: rare, as is the one seen 9 times.
    assert vocabulary_fit(counts[: MIN_VOCAB_SIZE + 2], MIN_VOCAB_SIZE + 4, MIN_VOCAB_SIZE).rare == 3


@pytest.mark.parametrize(
    ("fit", "size"),
    [
        (VocabularyFit(8192, 7933, 6223, 291_851), 4096),  # 1.26 MB of the King James Bible: 4096 scored best
        (VocabularyFit(8192, 7933, 2800, 359_797), 4096),  # 1.33 MB of the Jargon File
        (VocabularyFit(6000, 5741, 1500, 300_000), 4096),  # never the size it warns about, nor above it
        (VocabularyFit(4096, 3837, 3000, 200_000), 2048),
        (VocabularyFit(512, 253, 200, 1_000), MIN_VOCAB_SIZE),  # never below the bytes and specials
    ],
)
def test_the_suggested_size_is_the_largest_power_of_two_with_64_tokens_an_entry(fit: VocabularyFit, size: int) -> None:
    assert fit.suggested_size() == size


def test_tokenizer_train_warns_when_the_vocabulary_is_too_large(tmp_path: Path, run_cli) -> None:
    output = tmp_path / "tokenizer.json"
    result = run_cli("tokenizer", "train", *PLAY, "--vocab-size", "2048", "--output", output, "--json")
    assert result.exit_code == 0 and output.is_file()
    assert result.stderr.splitlines() == [f"warning: {PLAY_WARNING}"]
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["warning"] == PLAY_WARNING
    assert summary["vocab_fit"] == {
        "vocab_size": 2048,
        "tokens": 44_013,
        "tokens_per_entry": 44_013 / 2048,
        "learned_tokens": 1789,
        "rare_tokens": 1105,
        "rare_below": 10,
        "rare_share": 1105 / 1789,
        "too_large": True,
        "suggested_vocab_size": 512,
    }


def test_tokenizer_train_warning_is_one_line_beside_the_human_output(
    tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch, narrow_console: int
) -> None:
    monkeypatch.setattr("dlm.cli.data_cmd.wants_json", lambda flag: False)
    result = run_cli("tokenizer", "train", *PLAY, "--vocab-size", "2048", "--output", tmp_path / "t.json")
    assert result.exit_code == 0
    assert result.stderr.splitlines() == [f"warning: {PLAY_WARNING}"]
    assert "vocab_size = 2048" in result.stdout


def test_a_vocabulary_that_suits_the_text_does_not_warn(tmp_path: Path, run_cli) -> None:
    result = run_cli("tokenizer", "train", *PLAY, "--vocab-size", "512", "--output", tmp_path / "t.json", "--json")
    assert result.exit_code == 0 and result.stderr == ""
    summary = json.loads(result.stdout.splitlines()[-1])
    assert summary["warning"] is None
    assert summary["vocab_fit"]["tokens"] == 66_397 and summary["vocab_fit"]["too_large"] is False
    assert summary["vocab_fit"]["suggested_vocab_size"] is None


def test_a_corpus_above_the_counting_limit_is_not_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dlm.data.tokenizer.COUNTED_BYTES_LIMIT", 1000)
    summary = train_tokenizer(PLAY, 2048, tmp_path / "t.json")
    assert summary.vocab_fit is None and summary.warning is None


@pytest.fixture(scope="module")
def play_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One play packed at seq_len 64 with a 2048-token tokenizer trained on it: 43,968 tokens."""

    output = tmp_path_factory.mktemp("play-data")
    train_tokenizer(PLAY, 2048, output / "tokenizer.json")
    pack_corpus(PLAY, output / "tokenizer.json", 64, output)
    return output


def overrides(data: Path, output: Path, *extra: str) -> list[str]:
    return [
        f"training.tokenizer={data / 'tokenizer.json'}",
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}" if (data / "val.bin").is_file() else "training.val_data=null",
        f"training.output_dir={output}",
        *extra,
    ]


def checks(*args: str | Path, run_cli) -> tuple[int, dict, str]:
    result = run_cli("validate", "--config", TINY, *[a for o in args for a in ("--set", o)], "--json")
    return result.exit_code, json.loads(result.stdout), result.stderr


def test_validate_warns_of_a_vocabulary_and_a_model_too_large_for_the_data(
    play_data: Path, tmp_path: Path, run_cli
) -> None:
    code, report, stderr = checks(*overrides(play_data, tmp_path / "run", "model.vocab_size=2048"), run_cli=run_cli)
    assert code == 0 and stderr == "" and report["passed"] is True
    assert report["warnings"] == ["train data vocabulary", "model size for data"]
    by_name = {check["name"]: check for check in report["checks"]}
    vocabulary = by_name["train data vocabulary"]
    assert (vocabulary["passed"], vocabulary["warning"], vocabulary["status"]) == (True, True, "warning")
    assert vocabulary["detail"] == (
        "2048 tokens for 43,968 training tokens: 21 per entry (62% of the 1,789 learned tokens occur fewer than "
        "10 times), under 64: too few to learn them; about 512 suit this size"
    )
    assert vocabulary["fix"] == (
        "train a tokenizer with --vocab-size 512, re-pack, set model.vocab_size = 512; or pack more text"
    )
    size = by_name["model size for data"]
    assert size["status"] == "warning"
    assert size["detail"] == (
        "237.9K parameters for 43,968 training tokens: 5.4 per token, over 5: the model can memorise the data "
        "rather than learn from it"
    )
    assert size["fix"] == (
        "a model of at most 219.8K parameters (e.g. model.d_model = 64 with 512 tokens: 139.6K), or more text"
    )
    assert by_name["training budget"]["status"] == "passed"  # 0.70 epochs


def test_validate_warns_of_many_epochs(tiny_data_dir: Path, tmp_path: Path, run_cli) -> None:
    blocks = json.loads((tiny_data_dir / "train.json").read_text())["num_blocks"]
    steps = 3 * blocks  # 8 blocks a step: 24 epochs
    args = overrides(tiny_data_dir, tmp_path / "run", f"training.max_steps={steps}")
    code, report, _ = checks(*args, run_cli=run_cli)
    assert code == 0 and report["passed"] is True and report["warnings"] == ["training budget"]
    budget = {check["name"]: check for check in report["checks"]}["training budget"]
    assert budget["detail"] == (
        f"{steps:,} steps x 8 blocks = {8 * steps:,} blocks ({8 * steps * 64:,} tokens) = 24.00 epochs of "
        f"{blocks:,} blocks, per process: over 16 epochs, repeats add less than new text and the model may overfit"
    )
    assert budget["fix"] == (
        f"watch the validation loss; lower training.max_steps to about {2 * blocks:,} steps (16 epochs), or pack more "
        "text"
    )
    code, report, _ = checks(
        *overrides(tiny_data_dir, tmp_path / "run", f"training.max_steps={2 * blocks}"), run_cli=run_cli
    )
    assert code == 0 and report["warnings"] == []  # 16 epochs or fewer do not warn


def test_a_time_budget_is_judged_by_its_plan_not_by_max_steps(tiny_data_dir: Path, tmp_path: Path) -> None:
    """With training.budget_minutes the steps are planned when training starts: max_steps (24 epochs
    here) trains nothing. Before a plan exists the row names the steps the data takes; afterwards it
    judges the plan, and the budgeted run itself notes a plan past the epoch rule."""

    from dlm.train.budget import BudgetedTraining
    from dlm.train.plan import TrainingPlan

    blocks = json.loads((tiny_data_dir / "train.json").read_text())["num_blocks"]
    run = tmp_path / "run"
    args = overrides(tiny_data_dir, run, f"training.max_steps={3 * blocks}", "training.budget_minutes=1")
    budget = {result.name: result for result in validate_config_file(TINY, args)[1]}["training budget"]
    assert (budget.status, budget.fix) == ("passed", "")
    assert budget.detail == (
        "training.budget_minutes = 1: the steps are planned from this machine's pace when training starts; up to "
        f"{2 * blocks:,} steps of 8 blocks stay within 16 epochs of {blocks:,} blocks"
    )
    TrainingPlan(60.0, 0.01, "calibration", 1.0, 4 * blocks, 10, 100, 100, 10).save(run)
    budget = {result.name: result for result in validate_config_file(TINY, args)[1]}["training budget"]
    assert budget.status == "warning" and budget.detail.startswith(
        f"planned for 1 minutes in {run}: {4 * blocks:,} steps x 8 blocks"
    )
    assert budget.fix == (
        "watch the validation loss; start over with a lower training.budget_minutes, planning "
        f"at most {2 * blocks:,} steps (16 epochs), or pack more text"
    )
    notes: list[object] = []
    training = BudgetedTraining(load_config(TINY, args), 1, calibrate=lambda *a, **k: None, emit=notes.append)
    training.check_epochs(TrainingPlan(60.0, 0.01, "calibration", 1.0, 2 * blocks, 10, 100, 100, 10))
    assert notes == []  # 16 epochs
    training.check_epochs(TrainingPlan(60.0, 0.01, "calibration", 1.0, 4 * blocks, 10, 100, 100, 10))
    assert notes == [
        {
            "event": "budget_note",
            "message": f"{4 * blocks:,} steps x 8 blocks = {32 * blocks:,} "
            f"blocks ({32 * blocks * 64:,} tokens) = 32.00 epochs of {blocks:,} blocks, per process: over "
            "16 epochs, repeats add less than new text and the model may overfit; watch the validation "
            f"loss; pass fewer minutes, to plan at most {2 * blocks:,} steps (16 epochs), or pack more "
            "text",
        }
    ]


def test_a_model_too_wide_for_data_is_shown_a_narrower_one(tiny_data_dir: Path, tmp_path: Path) -> None:
    _, results = validate_config_file(TINY, overrides(tiny_data_dir, tmp_path / "run", "model.d_model=512"))
    by_name = {result.name: result for result in results}
    assert by_name["train data vocabulary"].status == "passed"
    size = by_name["model size for data"]
    assert size.status == "warning"
    assert size.detail == (
        "6.7M parameters for 259,520 training tokens: 25.8 per token, over 5: the model can memorise the data "
        "rather than learn from it"
    )
    # The halvings of d_model = 512 (2 heads): 256 has 1.7M parameters, 128 fits.
    assert size.fix == "a model of at most 1.3M parameters (e.g. model.d_model = 128: 492.2K), or more text"


def test_a_model_and_vocabulary_that_suit_the_data_do_not_warn(tiny_data_dir: Path, tmp_path: Path, run_cli) -> None:
    code, report, _ = checks(*overrides(tiny_data_dir, tmp_path / "run"), run_cli=run_cli)
    assert code == 0 and report["warnings"] == []
    by_name = {check["name"]: check for check in report["checks"]}
    assert by_name["train data vocabulary"]["status"] == "passed"
    assert by_name["train data vocabulary"]["fix"] == ""
    assert by_name["model size for data"]["status"] == "passed"
    assert by_name["model size for data"]["detail"].startswith("139.6K parameters for ")


def test_data_above_the_counting_limit_is_not_counted(
    play_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dlm.train.preflight.COUNTED_TOKENS_LIMIT", 1000)
    _, results = validate_config_file(TINY, overrides(play_data, tmp_path / "run", "model.vocab_size=2048"))
    vocabulary = {result.name: result for result in results}["train data vocabulary"]
    assert (vocabulary.status, vocabulary.detail) == ("passed", "21 training tokens per vocabulary entry (not counted)")


def test_train_bin_is_counted_in_chunks_with_the_same_counts(play_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = load_packed_dataset(play_data / "train.bin")
    whole = np.bincount(np.asarray(dataset.tokens).ravel(), minlength=2048)
    monkeypatch.setattr("dlm.data.dataset.COUNT_CHUNK_TOKENS", 64 * 5)  # 5 blocks a chunk, of 687
    assert np.array_equal(token_counts(dataset, 2048), whole) and whole.sum() == 43_968


def test_warning_rows_in_the_table_keep_exit_code_0(
    play_data: Path, tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch, narrow_console: int
) -> None:
    monkeypatch.setattr("dlm.cli.data_cmd.wants_json", lambda flag: False)
    args = overrides(play_data, tmp_path / "run", "model.vocab_size=2048")
    result = run_cli("validate", "-c", TINY, *[a for o in args for a in ("-s", o)])
    assert result.exit_code == 0 and result.stderr == ""
    assert result.stdout.count("warning") == 2 and "failed" not in result.stdout
    ensure_valid(load_config(TINY, args))  # warnings never stop a run
    assert not (tmp_path / "run").exists()


def test_the_epoch_rule_warns_past_its_limit_and_names_the_steps_that_fit() -> None:
    blocks, per_step = 1000, 10  # 100 steps an epoch
    fits = budget_advice(MAX_EPOCHS * 100, per_step, 64, blocks)
    assert not fits.too_large and fits.fix == ""
    assert fits.detail.endswith(f"= {MAX_EPOCHS:.2f} epochs of 1,000 blocks, per process")
    over = budget_advice(MAX_EPOCHS * 100 + 1, per_step, 64, blocks)
    assert over.too_large and f"over {MAX_EPOCHS} epochs" in over.detail
    assert f"lower training.max_steps to about {MAX_EPOCHS * 100:,} steps ({MAX_EPOCHS} epochs)" in over.fix


def test_the_model_rule_counts_parameters_per_training_token_and_halves_the_width() -> None:
    model = load_config(TINY).model.model_copy(update={"d_model": 256, "n_heads": 4})
    parameters = count_parameters(model)
    fits = model_advice(model, math.ceil(parameters / MAX_PARAMETERS_PER_TOKEN))
    assert not fits.too_large and fits.detail.startswith(f"{format_parameter_count(parameters)} parameters for ")
    tokens = parameters // (2 * MAX_PARAMETERS_PER_TOKEN)  # room for about half the parameters
    over = model_advice(model, tokens)
    narrower = count_parameters(model.model_copy(update={"d_model": 128}))
    assert narrower <= MAX_PARAMETERS_PER_TOKEN * tokens < parameters
    assert over.too_large and f"(e.g. model.d_model = 128: {format_parameter_count(narrower)})" in over.fix
    # With the smaller vocabulary the vocabulary rule suggests, the same width is tried first.
    smaller_vocab = model_advice(model, tokens, vocab=model.vocab_size // 2)
    assert "with " + str(model.vocab_size // 2) + " tokens" in smaller_vocab.fix


def test_tokenizer_train_never_imports_torch(tmp_path: Path) -> None:
    # `dlm tokenizer train` sizes the vocabulary with dlm.data.sizing, which counts no torch tensors.
    script = (
        "import sys\nfrom dlm.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n"
        "    assert not exc.code, exc.code\nprint('torch' in sys.modules)\n"
    )
    args = ["tokenizer", "train", str(PLAY[0]), "--vocab-size", "1024", "--output", str(tmp_path / "t.json")]
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False" and (tmp_path / "t.json").is_file()
