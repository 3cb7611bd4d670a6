"""Evaluation: known answers from a uniform model, error scaling, determinism, real checkpoints, CLI."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import train_tiny_run
from torch import Tensor, nn

from dlm.artifacts.export import export_model
from dlm.artifacts.loading import load_model
from dlm.config.schema import ModelConfig
from dlm.data.dataset import load_packed_dataset
from dlm.data.tokenizer import load_tokenizer
from dlm.diffusion.schedules import NOISE_BUCKETS
from dlm.errors import UserError
from dlm.evaluation.evaluate import EVAL_FORMAT, evaluate_model, evaluate_source, write_report
from dlm.evaluation.likelihood import likelihood_figures, packed_token_bytes
from dlm.model.transformer import DiffusionTransformer

ROOT = Path(__file__).resolve().parents[1]
VOCAB, LENGTH, SEQUENCES = 32, 64, 256


class UniformModel(nn.Module):
    """Predicts every token with probability 1 / V: its ELBO is exactly log V per token."""

    def __init__(self) -> None:
        super().__init__()
        self.config = ModelConfig(
            vocab_size=VOCAB, mask_token_id=1, max_seq_len=LENGTH, d_model=8, n_layers=1, n_heads=2
        )
        self.calls = 0

    def forward(self, tokens: Tensor, output_positions: Tensor | None = None) -> Tensor:
        self.calls += 1
        rows = int(output_positions.sum()) if output_positions is not None else tokens.numel()
        return torch.zeros(rows, VOCAB)


@pytest.fixture(scope="module")
def uniform_data() -> Tensor:
    # Ids from 3 up: the uniform model's argmax (id 0) is never right, so its accuracy is exactly 0.
    return torch.randint(3, VOCAB, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(0))


TOKEN_BYTES = np.arange(VOCAB) % 4  # id i decodes to i mod 4 UTF-8 bytes


def uniform_report(data: Tensor, mc_samples: int, **options: object) -> object:
    settings: dict[str, object] = {"batches": 4, "batch_size": 64, "mask_eps": 0.05, "token_bytes": TOKEN_BYTES}
    settings.update(options)
    return evaluate_model(UniformModel(), data, mc_samples=mc_samples, **settings)  # type: ignore[arg-type]


def test_uniform_model_gives_log_v_and_exact_bits_per_byte(uniform_data: Tensor) -> None:
    report = uniform_report(uniform_data, mc_samples=8)
    log_v = math.log(VOCAB)
    assert report.sequences == SEQUENCES and report.tokens == SEQUENCES * LENGTH
    assert abs(report.nll - log_v) < 4 * report.nll_stderr and report.nll_stderr < 0.02 * log_v
    assert report.perplexity_bound == pytest.approx(math.exp(report.nll))
    assert report.fixed_noise_loss == pytest.approx(log_v, rel=0.05)
    assert report.fixed_noise_accuracy == 0.0
    # Bits per byte from the formula, over the bytes of exactly the scored tokens.
    assert report.bytes == int(TOKEN_BYTES[uniform_data.numpy()].sum())
    assert report.bits_per_byte == pytest.approx(report.nll * report.tokens / (report.bytes * math.log(2)), rel=1e-12)
    assert report.bits_per_byte_stderr == pytest.approx(report.bits_per_byte * report.nll_stderr / report.nll)
    # Every masked token costs exactly log V, whatever the noise level.
    assert len(report.loss_by_t) == NOISE_BUCKETS
    assert sum(bucket.sequences for bucket in report.loss_by_t) == SEQUENCES
    for index, bucket in enumerate(report.loss_by_t):
        assert bucket.masked_ce == pytest.approx(log_v, rel=1e-5)
        assert bucket.t_high == pytest.approx((index + 1) / NOISE_BUCKETS)
    assert report.loss_by_t[0].t_low == 0.05


def test_standard_error_shrinks_like_one_over_sqrt_k(uniform_data: Tensor) -> None:
    small, large = uniform_report(uniform_data, mc_samples=4), uniform_report(uniform_data, mc_samples=16)
    # 4x the samples: half the error (1.76 .. 2.27 over 40 seeds of this setup).
    assert 1.6 < small.nll_stderr / large.nll_stderr < 2.5
    assert 1.6 < small.nll_mc_stderr / large.nll_mc_stderr < 2.5
    assert abs(large.nll - math.log(VOCAB)) < 4 * large.nll_stderr


def test_evaluation_is_deterministic_and_leaves_global_rng_alone(uniform_data: Tensor) -> None:
    model = UniformModel().train()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    first = evaluate_model(model, uniform_data, batches=2, batch_size=16, mc_samples=3, token_bytes=TOKEN_BYTES)
    assert torch.equal(before, torch.get_rng_state())
    assert model.training  # the caller's mode comes back
    again = evaluate_model(model, uniform_data, batches=2, batch_size=16, mc_samples=3, token_bytes=TOKEN_BYTES)
    assert first.to_dict() == again.to_dict()
    # 2 batches: one fixed-noise, K Monte Carlo and one bucket forward pass each.
    assert model.calls == 2 * 2 * (1 + 3 + 1)


def test_short_data_missing_metadata_and_k1_are_reported_not_hidden(uniform_data: Tensor) -> None:
    report = evaluate_model(UniformModel(), uniform_data[:20], batches=5, batch_size=8, mc_samples=1)
    assert report.batches == 3 and report.sequences == 20  # the last batch is short
    assert report.bits_per_byte is None and report.nll_mc_stderr is None
    assert any("20 blocks" in note for note in report.notes)
    assert any("bits per byte skipped" in note for note in report.notes)
    data = report.to_dict()
    assert data["format"] == EVAL_FORMAT and data["bits_per_byte"] is None and data["bytes"] is None
    json.dumps(data, allow_nan=False)  # strict JSON: no NaN anywhere
    table, why = packed_token_bytes({"num_tokens": 10}, [])
    assert table is None and why in report.notes
    with pytest.raises(UserError, match="--mc-samples"):
        evaluate_model(UniformModel(), uniform_data, mc_samples=0)


# --------------------------------------------------------------------------- real checkpoints


@pytest.fixture(scope="module")
def run_dir(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_data_dir, tmp_path_factory.mktemp("eval-run") / "run")


def test_checkpoint_eval_repeats_the_runs_last_validation(run_dir: Path) -> None:
    report = evaluate_source(run_dir, mc_samples=2)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    validation = [event for event in map(json.loads, lines) if event["event"] == "validation"][-1]
    assert report.fixed_noise_loss == validation["loss"]
    assert report.fixed_noise_accuracy == validation["masked_accuracy"]
    assert report.batches == validation["batches"] and report.context["step"] == 4
    assert report.bits_per_byte is not None and 0 < report.bits_per_byte < report.nll / math.log(2)
    assert report.context["data"].endswith("val.bin")


def test_exported_model_needs_data_and_then_matches_the_checkpoint(
    run_dir: Path, tiny_data_dir: Path, tmp_path: Path
) -> None:
    exported = export_model(run_dir, tmp_path / "model", dtype="float32")
    with pytest.raises(UserError, match="--data"):
        evaluate_source(exported)
    from_export = evaluate_source(exported, tiny_data_dir, batches=2, batch_size=8, mc_samples=2).to_dict()
    from_checkpoint = evaluate_source(run_dir, mc_samples=2).to_dict()
    for key in ("nll", "nll_stderr", "fixed_noise_loss", "bits_per_byte"):
        assert from_export[key] == pytest.approx(from_checkpoint[key], rel=1e-5), key
    losses = [[bucket["loss"] for bucket in report["loss_by_t"]] for report in (from_export, from_checkpoint)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_data_from_another_tokenizer_is_refused(run_dir: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_data_dir / "val.bin", tmp_path / "val.bin")
    metadata = json.loads((tiny_data_dir / "val.json").read_text())
    (tmp_path / "val.json").write_text(json.dumps({**metadata, "tokenizer_sha256": "0" * 64}))
    with pytest.raises(UserError, match="another tokenizer"):
        evaluate_source(run_dir, tmp_path / "val.bin")


def test_cli_eval_json_output_file_and_errors(run_dir: Path, tmp_path: Path, run_cli) -> None:
    result = run_cli(
        "eval", run_dir, "--mc-samples", "2", "--batches", "1", "--output", tmp_path / "eval.json", "--json"
    )
    assert result.exit_code == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed == json.loads((tmp_path / "eval.json").read_text())
    assert printed["batches"] == 1 and printed["context"]["kind"] == "training"
    bad = run_cli("eval", run_dir, "--mc-samples", "0")
    assert bad.exit_code == 2 and bad.stderr.startswith("error:") and "--mc-samples" in bad.stderr
    missing = run_cli("eval", tmp_path / "absent")
    assert missing.exit_code == 2 and "Traceback" not in missing.stderr
    with pytest.raises(UserError, match="directory"):
        write_report(evaluate_model(UniformModel(), torch.full((1, LENGTH), 5), batches=1), tmp_path)


# --------------------------------------------------------------------------- exact bytes


def test_token_byte_table_sums_to_the_utf8_size_of_any_text(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    from dlm.data.tokenizer import token_byte_lengths

    tokenizer = load_tokenizer(tiny_tokenizer_path)
    tokenizer.add_tokens(["日本", "<|extra|>"])  # added tokens: outside and inside the byte alphabet
    tokenizer.encode_special_tokens = True  # special-token text is text here, as `dlm pack` encodes it
    table = token_byte_lengths(tokenizer)
    assert table.shape == (514,) and list(table[:3]) == [0, 0, 0]  # eos, mask, pad stand for no text
    assert table[tokenizer.token_to_id("日本")] == 6 and table[tokenizer.token_to_id("<|extra|>")] == 9
    texts = ["accents é à ü, CJK 日本語の文章, emoji 🙂👍🏽, RTL שלום\r\n\ttabs", "<|mask|> as text", "日本 <|extra|>"]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert int(table[ids].sum()) == len(text.encode("utf-8")) == len(tokenizer.decode(ids).encode("utf-8"))


@pytest.mark.parametrize(("batches", "batch_size"), [(2, 8), (1, 3)])
def test_bits_per_byte_count_the_bytes_of_exactly_the_scored_blocks(
    run_dir: Path, tiny_data_dir: Path, batches: int, batch_size: int
) -> None:
    report = evaluate_source(run_dir, batches=batches, batch_size=batch_size, mc_samples=2)
    # Decoded independently: each scored block's text without the end-of-document tokens.
    tokenizer = load_tokenizer(tiny_data_dir / "tokenizer.json")
    blocks = np.asarray(load_packed_dataset(tiny_data_dir, split="val").tokens[: batches * batch_size])
    texts = [tokenizer.decode(block.tolist(), skip_special_tokens=True) for block in blocks]
    assert all("\ufffd" not in text for text in texts)  # whole characters: the decoded size is exact
    assert report.tokens == blocks.size == batches * batch_size * 64
    assert report.bytes == sum(len(text.encode("utf-8")) for text in texts)
    to_bits = report.tokens / (report.bytes * math.log(2))  # nats per token -> bits per byte
    assert report.bits_per_byte == report.nll * to_bits
    assert report.nll_stderr is not None and report.bits_per_byte_stderr == report.nll_stderr * to_bits
    saved = report.to_dict()
    assert (saved["tokens"], saved["bytes"]) == (report.tokens, report.bytes) and "text_bytes" not in saved


def test_bits_per_byte_need_the_datas_tokenizer(run_dir: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    (data / "tokenizer.json").unlink()
    # The model's own tokenizer (the run's training.tokenizer) has the data's hash: still exact.
    assert evaluate_source(run_dir, data, mc_samples=1).bytes == evaluate_source(run_dir, mc_samples=1).bytes
    model, _ = load_model(run_dir)
    report = evaluate_model(model, load_packed_dataset(data, split="val"), batches=1, batch_size=2, mc_samples=1)
    assert report.bits_per_byte is None and report.bytes is None and report.tokens == 2 * 64
    assert f"no tokenizer.json with the data's sha256 (looked at {data / 'tokenizer.json'})" in report.notes[0]


def test_cli_eval_human_output_shows_the_counts_behind_bits_per_byte(
    run_dir: Path, run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dlm.cli.eval_cmd.wants_json", lambda flag: False)
    result = run_cli("eval", run_dir, "--mc-samples", "2", "--batches", "1", "--batch-size", "4")
    assert result.exit_code == 0, result.stderr
    report = evaluate_source(run_dir, mc_samples=2, batches=1, batch_size=4)
    counts = f"NLL {report.nll:.6f} x {report.tokens:,} tokens / ({report.bytes:,} bytes x ln 2)"
    line = f"bits per byte = {counts} = {report.bits_per_byte:.4f}"
    assert line in result.stdout.splitlines()  # one line, never wrapped: it is copied


def test_cli_eval_says_which_weights_it_scored(tiny_data_dir: Path, tmp_path: Path, run_cli, monkeypatch) -> None:
    from helpers import tiny_experiment

    from dlm.train.loop import train

    overrides = ("training.max_steps=3", "training.warmup_steps=1", "training.ema_decay=0.9")
    run = train(tiny_experiment(tiny_data_dir, tmp_path / "run", *overrides), sink=lambda event: None).run_dir
    options = ("--mc-samples", "1", "--batches", "1", "--batch-size", "2")
    monkeypatch.setattr("dlm.cli.eval_cmd.wants_json", lambda flag: flag)  # tables unless --json
    for flag, weights, shown in (("--ema", "ema", "EMA"), ("--no-ema", "live", "live")):
        printed = run_cli("eval", run, flag, *options, "--json")
        assert printed.exit_code == 0, printed.stderr
        assert json.loads(printed.stdout)["context"]["weights"] == weights
        human = run_cli("eval", run, flag, *options)
        assert human.exit_code == 0, human.stderr
        row = [line for line in human.stdout.splitlines() if line.strip("│ ").startswith("weights")]
        assert len(row) == 1 and f" {shown} " in row[0], human.stdout


def test_cli_eval_progress_partial_split_and_all(run_dir: Path, run_cli, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    result = run_cli("eval", run_dir, "--mc-samples", "1", "--batches", "1", "--batch-size", "4", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)  # progress goes to stderr: stdout stays one document
    progress = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert progress[-1]["event"] == "progress" and progress[-1]["batches"] == progress[-1]["total_batches"] == 3
    assert all("batches_per_s" in line and "eta_s" in line for line in progress)
    total = report["context"]["data_sequences"]
    assert f"scored 4 of {total} sequences; --batches N or --all for all" in report["notes"]
    monkeypatch.setattr("dlm.cli.eval_cmd.wants_json", lambda flag: flag)  # tables unless --json
    human = run_cli("eval", run_dir, "--mc-samples", "1", "--batches", "1", "--batch-size", "4")
    assert f"note: scored 4 of {total} sequences; --batches N or --all for all\n" in human.stdout
    every = json.loads(run_cli("eval", run_dir, "--mc-samples", "1", "--all", "--batch-size", "512", "--json").stdout)
    assert every["sequences"] == total and not any(note.startswith("scored") for note in every["notes"])
    both = run_cli("eval", run_dir, "--all", "--batches", "2")
    assert both.exit_code == 2 and "--all" in both.stderr


def test_cli_eval_ctrl_c_prints_one_line_exits_130_and_writes_nothing(
    run_dir: Path, tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("dlm.evaluation.evaluate.evaluate_source", interrupted)
    result = run_cli("eval", run_dir, "--output", tmp_path / "eval.json")
    assert result.exit_code == 130
    assert result.stderr == "interrupted: evaluation stopped, nothing written\n"
    assert not (tmp_path / "eval.json").exists()


def test_cli_eval_output_is_checked_before_evaluating(
    run_dir: Path, tmp_path: Path, run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    evaluated: list[object] = []
    monkeypatch.setattr("dlm.evaluation.evaluate.evaluate_source", lambda *args, **kwargs: evaluated.append(args))
    (tmp_path / "outdir").mkdir()
    (tmp_path / "keep.json").write_text('{"mine": 1}\n')
    refusals = {
        tmp_path / "outdir": "--output is a directory",
        tmp_path / "absent" / "x" / "eval.json": "the directory of --output does not exist",
        tmp_path / "keep.json": "output exists and is not an eval report dlm wrote",
    }
    for output, message in refusals.items():
        run_cli("eval", run_dir, "--output", output).assert_refused(message)
    assert evaluated == [] and (tmp_path / "keep.json").read_text() == '{"mine": 1}\n'
    assert not (tmp_path / "absent").exists() and list((tmp_path / "outdir").iterdir()) == []


def test_cli_eval_replaces_an_earlier_report_and_another_file_only_with_overwrite(
    run_dir: Path, tmp_path: Path, run_cli
) -> None:
    output = tmp_path / "eval.json"
    output.write_text('{"mine": 1}\n')
    arguments = ("eval", run_dir, "--mc-samples", "2", "--batches", "1", "--output", output, "--json")
    assert run_cli(*arguments, "--overwrite").exit_code == 0
    first = json.loads(output.read_text())
    assert first["format"].startswith("dlm-eval") and first["batches"] == 1
    output.write_text(json.dumps({**first, "batches": 7}))  # an earlier report: replaced without --overwrite
    assert run_cli(*arguments).exit_code == 0
    assert json.loads(output.read_text()) == first


@pytest.mark.parametrize(("batches", "batch_size"), [(2, 8), (1, 3)])
def test_eval_reports_the_unigram_level_of_exactly_the_scored_blocks(
    run_dir: Path, tiny_data_dir: Path, batches: int, batch_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dlm.data.dataset.COUNT_CHUNK_TOKENS", 1000)  # counted in many chunks: the same counts
    report = evaluate_source(run_dir, batches=batches, batch_size=batch_size, mc_samples=2)
    train = np.asarray(load_packed_dataset(tiny_data_dir, split="train").tokens).ravel()
    scored = np.asarray(load_packed_dataset(tiny_data_dir, split="val").tokens[: batches * batch_size]).ravel()
    counts = np.bincount(train, minlength=512) + 1.0
    nats = -np.log(counts[scored] / counts.sum()).sum()
    assert report.bytes is not None and report.unigram_bits_per_byte is not None
    assert report.unigram_bits_per_byte == pytest.approx(nats / (report.bytes * math.log(2)), rel=1e-12)
    assert report.to_dict()["unigram_bits_per_byte"] == report.unigram_bits_per_byte


def test_eval_says_when_the_model_is_no_better_than_the_unigram_level(
    run_dir: Path, run_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = evaluate_source(run_dir, mc_samples=2, batches=1, batch_size=4)
    assert report.unigram_bits_per_byte is not None and report.bits_per_byte is not None
    verdicts = [note for note in report.notes if "unigram level" in note]
    if report.bits_per_byte < report.unigram_bits_per_byte - 0.02:
        assert verdicts == []
    else:  # four steps of training: at the level, said with what to do
        assert len(verdicts) == 1 and "dlm resume" in verdicts[0] and "--minutes" not in verdicts[0]
    monkeypatch.setattr("dlm.cli.eval_cmd.wants_json", lambda flag: False)
    result = run_cli("eval", run_dir, "--mc-samples", "2", "--batches", "1", "--batch-size", "4")
    assert result.exit_code == 0, result.stderr
    assert f"{report.unigram_bits_per_byte:.4f}" in result.stdout and "unigram level" in result.stdout


# --------------------------------------------------------------------------- instruction data


def test_likelihood_figures_are_total_nll_over_total_tokens() -> None:
    # Three replies of 4, 14 and 2 tokens at 2.0, 0.5 and 1.0 nats per token: 8 + 7 + 2 = 17 nats
    # over 20 tokens, not the 1.1667 of the per-sequence mean; 40 bytes in all.
    means = torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64)
    errors = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    counts = torch.tensor([4, 14, 2, 0])  # the last sequence has nothing to score
    notes: list[str] = []
    figures = likelihood_figures(
        torch.cat((means, torch.zeros(1))), torch.cat((errors, torch.zeros(1))), counts, 8, 40, notes
    )
    assert figures["nll"] == pytest.approx(17 / 20, rel=1e-12) and figures["tokens"] == 20
    assert figures["bits_per_byte"] == pytest.approx(17 / (40 * math.log(2)), rel=1e-12)
    # Ratio estimator: residuals n_s (m_s - 0.85) = 4.6, -4.9, 0.3 over 3 sequences.
    stderr = math.sqrt((4.6**2 + 4.9**2 + 0.3**2) * 3 / 2) / 20
    assert figures["nll_stderr"] == pytest.approx(stderr, rel=1e-12)
    assert figures["bits_per_byte_stderr"] == pytest.approx(stderr * 20 / (40 * math.log(2)), rel=1e-12)
    assert figures["nll_mc_stderr"] == pytest.approx(math.sqrt(0.4**2 + 2.8**2 + 0.6**2) / 20, rel=1e-12)
    assert figures["sequences"] == 3 and notes == [
        "1 of 4 sequences hold no scored token (a loss mask of zeros): left out"
    ]
    # Equal counts (plain text): the plain mean and its usual standard error.
    plain = likelihood_figures(means, errors, torch.full((3,), 64), 8, None, [])
    assert plain["nll"] == pytest.approx(float(means.mean()), rel=1e-12)
    assert plain["nll_stderr"] == pytest.approx(float(means.std() / math.sqrt(3)), rel=1e-12)


def test_bits_per_byte_of_replies_of_unequal_length_are_the_exact_likelihood_of_a_block_size_one_model() -> None:
    # Block size 1 makes the ELBO the exact left-to-right likelihood, so bits per byte must be
    # the replies' total -log2 p over their total bytes.
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=64,
        mask_token_id=1,
        max_seq_len=16,
        d_model=32,
        n_layers=2,
        n_heads=4,
        pad_vocab_multiple=64,
        block_size=1,
    )
    model = DiffusionTransformer(config).double().eval()
    ids = torch.randint(2, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    masks = torch.zeros(2, 16, dtype=torch.bool)
    masks[0, 12:], masks[1, 2:] = True, True  # replies of 4 and 14 tokens after their prompts
    token_bytes = np.arange(64) % 5 + 1
    total, text_bytes = 0.0, 0
    with torch.no_grad():
        for row, position in masks.nonzero().tolist():
            prefix = ids[row : row + 1, : position + 1].clone()
            prefix[0, -1] = 1
            total -= float(model(prefix)[0, -1].log_softmax(-1)[ids[row, position]])
            text_bytes += int(token_bytes[ids[row, position]])
    data = [(ids[0], masks[0]), (ids[1], masks[1])]
    report = evaluate_model(
        model,
        data,
        batches=1,
        batch_size=2,
        mc_samples=2,
        token_bytes=token_bytes,
        metadata={"loss_mask": "val.mask.bin"},
    )
    assert report.tokens == 18 and report.bytes == text_bytes and report.sequences == 2
    assert report.nll == pytest.approx(total / 18, rel=1e-5)
    assert report.bits_per_byte == pytest.approx(total / (text_bytes * math.log(2)), rel=1e-5)


def test_cli_eval_of_loss_masks_without_a_token_to_score_is_one_error_line(
    run_dir: Path, tiny_data_dir: Path, tmp_path: Path, run_cli
) -> None:
    from dlm.data.chat_pack import pack_chat
    from dlm.data.pack import mask_path

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"say {w}", "response": w}) + "\n" for w in ("to", "be")))
    val = tmp_path / "val.jsonl"
    val.write_bytes(chat.read_bytes())  # the same examples held out: a file cannot be both inputs
    data = tmp_path / "chat"
    pack_chat([chat], tiny_data_dir / "tokenizer.json", 64, data, val_inputs=[val])
    masks = mask_path(data / "val.bin")
    kept = masks.read_bytes()
    masks.write_bytes(bytes(64) + kept[64:])  # the first example's loss mask all 0: it is left out
    partly = run_cli("eval", run_dir, "--data", data, "--mc-samples", "2", "--json")
    assert partly.exit_code == 0, partly.stderr
    report = json.loads(partly.stdout)
    assert report["sequences"] == 1 and report["tokens"] == sum(kept[64:])
    assert "1 of 2 sequences hold no scored token (a loss mask of zeros): left out" in report["notes"]
    masks.write_bytes(bytes(len(kept)))  # every loss mask all 0: nothing to evaluate
    output = tmp_path / "eval.json"
    result = run_cli("eval", run_dir, "--data", data, "--mc-samples", "2", "--output", output)
    result.assert_refused("none of the 2 sequences", "loss mask is all 0", "val.mask.bin", "dlm pack --chat")
    assert not output.exists()
