"""Pre-flight checks of an experiment config against the files it names.

`validate_experiment` returns every check's result (what `dlm validate` shows as a table);
`ensure_valid` raises the first failure as a `UserError` (what the training loop calls before it
spends any time or writes anything, so the memory check refuses a model whose state cannot fit
before a single weight is allocated). A check whose input could not be read is not attempted: the
reading failure is the one to fix first.

A check that passes may still warn (`warning`): the sizing checks say when the vocabulary, the model
or the number of epochs is large for the training data. Warnings never fail `dlm validate` or a run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dlm.config.schema import ExperimentConfig, ModelConfig, load_config
from dlm.config.shapes import format_parameter_count
from dlm.data.dataset import PackedDataset, load_packed_dataset, token_counts
from dlm.data.sizing import (
    MAX_EPOCHS,
    Advice,
    budget_advice,
    epoch_limit_steps,
    model_advice,
    packed_vocabulary_advice,
    vocabulary_fit,
)
from dlm.data.tokenizer import (
    MIN_VOCAB_SIZE,
    has_dlm_special_tokens,
    load_tokenizer,
    optional_token_id,
    special_token_id,
    tokenizer_sha256,
)
from dlm.errors import UserError
from dlm.fileio import check_writable_directory
from dlm.runtime.device import resolve_device, resolve_training_precision
from dlm.train.init_from import adopt_source_model
from dlm.train.memory import (
    check_training_memory,
    estimate_checkpoints,
    parameter_entries,
    plan_memory,
)
from dlm.train.plan import TrainingPlan

# The vocabulary check counts every token of a train.bin of up to this many (64M: 0.1 s from the page
# cache, plus the read of 128 MB from disk).
COUNTED_TOKENS_LIMIT = 64 * 2**20


@dataclass(frozen=True)
class CheckResult:
    """One named check: whether it passed, what was found, and how to fix a failure."""

    name: str
    passed: bool
    detail: str
    fix: str = ""
    warning: bool = False  # passed, but with something to change (`fix`)

    @property
    def status(self) -> str:
        return "failed" if not self.passed else "warning" if self.warning else "passed"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


def _failure(name: str, exc: UserError) -> CheckResult:
    """A failed check from a UserError, its fix moved out of the message into its own column."""

    text = str(exc)
    if exc.fix and text.endswith(f" ({exc.fix})"):
        text = text[: -len(f" ({exc.fix})")]
    return CheckResult(name, False, text, exc.fix or "")


def _equal(name: str, found: Any, wanted: Any, what: str, fix: str) -> CheckResult:
    if found == wanted:
        return CheckResult(name, True, f"{what} {found}")
    return CheckResult(name, False, f"{what} {found}, config expects {wanted}", fix)


def _tokenizer_checks(experiment: ExperimentConfig) -> tuple[list[CheckResult], int]:
    """The tokenizer's checks, and the vocabulary size packed data must have been encoded with."""

    model, path = experiment.model, experiment.training.tokenizer
    try:
        tokenizer = load_tokenizer(path)
    except UserError as exc:
        return [_failure("tokenizer", exc)], model.vocab_size
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    mask = special_token_id(tokenizer, "mask")
    if not has_dlm_special_tokens(tokenizer) and vocab < model.vocab_size:
        # An imported model's embedding often has rows past its tokenizer (padding the checkpoint
        # was trained with): they are never fed and the data cannot hold them.
        size = CheckResult(
            "tokenizer vocab_size",
            True,
            f"tokenizer has vocab size {vocab}, within the imported model's {model.vocab_size} embedding rows",
        )
    else:
        size = _equal(
            "tokenizer vocab_size",
            vocab,
            model.vocab_size,
            "tokenizer has vocab size",
            f"set model.vocab_size = {vocab}, or train a tokenizer with --vocab-size {model.vocab_size}",
        )
    kind = "dlm's special tokens" if has_dlm_special_tokens(tokenizer) else "the special tokens its config names"
    return [
        CheckResult("tokenizer", True, f"{path} loads with {kind}"),
        size,
        _equal(
            "tokenizer mask_token_id",
            mask,
            model.mask_token_id,
            "tokenizer mask id is",
            f"set model.mask_token_id = {mask}",
        ),
        *_separator_checks(model.document_separator_id, tokenizer),
    ], vocab if size.passed else model.vocab_size


def _separator_checks(separator: int | None, tokenizer: Any) -> list[CheckResult]:
    """Document-aware attention splits rows at the tokenizer's end-of-document token, which `dlm pack` writes."""

    if separator is None:
        return []
    eos = optional_token_id(tokenizer, "eos")
    return [
        _equal(
            "tokenizer document_separator_id",
            eos,
            separator,
            "tokenizer end-of-document id is",
            f"set model.document_separator_id = {eos}"
            if eos is not None
            else "unset model.document_separator_id: the tokenizer has no end-of-document token",
        )
    ]


def _data_checks(
    experiment: ExperimentConfig, split: str, path: Path, tokenizer_hash: str | None, vocab: int
) -> tuple[list[CheckResult], PackedDataset | None]:
    model = experiment.model
    try:
        dataset = load_packed_dataset(path)
    except UserError as exc:
        return [_failure(f"{split} data", exc)], None
    meta = dataset.metadata
    blocks, tokens = int(meta["num_blocks"]), int(meta["num_tokens"])
    checks = [
        CheckResult(f"{split} data", True, f"{path}: {blocks:,} blocks, {tokens:,} tokens, size matches"),
        _equal(
            f"{split} data seq_len",
            int(meta["seq_len"]),
            model.max_seq_len,
            "packed with seq_len",
            f"set model.max_seq_len = {meta['seq_len']}, or re-pack with --seq-len {model.max_seq_len}",
        ),
        _equal(
            f"{split} data vocab_size",
            int(meta["vocab_size"]),
            vocab,
            "encoded with vocab size",
            "re-pack the data with the config's tokenizer",
        ),
    ]
    if tokenizer_hash is not None:
        same = meta["tokenizer_sha256"] == tokenizer_hash
        detail = "same tokenizer file" if same else "encoded with a different tokenizer file"
        fix = "" if same else "re-pack the data with training.tokenizer, or point it at DIR/tokenizer.json"
        checks.append(CheckResult(f"{split} data tokenizer", same, detail, fix))
    return checks, dataset


def _vocabulary_check(dataset: PackedDataset) -> tuple[CheckResult, int | None]:
    """The check, and the vocabulary size it suggests when it warns."""

    name, vocab = "train data vocabulary", int(dataset.metadata["vocab_size"])
    tokens = int(dataset.metadata["num_tokens"])
    if dataset.num_blocks * dataset.seq_len > COUNTED_TOKENS_LIMIT:
        detail = f"{tokens / vocab:,.0f} training tokens per vocabulary entry (not counted)"
        return CheckResult(name, True, detail), None
    fit = vocabulary_fit(token_counts(dataset, vocab), vocab, MIN_VOCAB_SIZE)
    advice = packed_vocabulary_advice(fit, tokens)
    return _advice_check(name, advice), fit.suggested_size() if advice.too_large else None


def _advice_check(name: str, advice: Advice) -> CheckResult:
    """A sizing verdict as a row: passed, a warning when something is too large."""

    return CheckResult(name, True, advice.detail, advice.fix, warning=advice.too_large)


# Document-aware attention paid 0.07 bits/byte on documents of ~40 tokens in 64-token rows and nothing
# on whole plays, for 1.06x the step time (0.11 lab notes, "Document-aware attention": git show
# cece22c:docs/benchmarks.md): it is worth suggesting when a packed row holds more than one document in
# two, on average.
SHORT_DOCUMENT_ROWS = 2


def _document_length_check(model: ModelConfig, dataset: PackedDataset) -> CheckResult | None:
    """Whether the packed documents are short enough for document-aware attention to pay; None for
    data packed without a document count (instruction data: one example a row)."""

    documents, tokens = int(dataset.metadata.get("documents") or 0), int(dataset.metadata["num_tokens"])
    if documents == 0:
        return None
    name, mean = "train data documents", tokens / documents
    detail = f"{documents:,} documents of {mean:,.0f} tokens on average in rows of {dataset.seq_len}"
    if model.document_separator_id is not None:
        return CheckResult(name, True, f"{detail}; each position attends within its own document")
    if mean >= SHORT_DOCUMENT_ROWS * dataset.seq_len:
        return CheckResult(name, True, f"{detail}; few rows cross a document's end")
    eos = dataset.metadata.get("eos_token_id")
    fix = (
        f"set model.document_separator_id = {eos}: each position then attends within its own document "
        '(docs/index.md, "Document-aware attention")'
    )
    return CheckResult(name, True, f"{detail}: most rows hold several documents that see each other", fix, warning=True)


def _model_size_check(experiment: ExperimentConfig, dataset: PackedDataset, vocab: int | None) -> CheckResult:
    """Parameters per training token; `vocab`: the vocabulary size the vocabulary check suggests, if any."""

    tokens = int(dataset.metadata["num_tokens"])
    return _advice_check("model size for data", model_advice(experiment.model, tokens, vocab))


def _output_check(output_dir: Path) -> CheckResult:
    try:
        check_writable_directory(output_dir)
    except UserError as exc:
        return _failure("output_dir writable", exc)
    return CheckResult("output_dir writable", True, f"{output_dir} can be created and written")


def _budget_check(experiment: ExperimentConfig, dataset: PackedDataset) -> CheckResult:
    training = experiment.training
    if len(dataset) < training.batch_size:
        return CheckResult(
            "training budget",
            False,
            f"{len(dataset)} blocks cannot fill one batch of {training.batch_size}",
            "lower training.batch_size or pack more text",
        )
    blocks_per_step = training.batch_size * training.gradient_accumulation_steps
    if training.budget_minutes > 0:
        return _planned_budget_check(experiment, blocks_per_step, len(dataset))
    advice = budget_advice(training.max_steps, blocks_per_step, experiment.model.max_seq_len, len(dataset))
    return _advice_check("training budget", advice)


def _planned_budget_check(experiment: ExperimentConfig, blocks_per_step: int, blocks: int) -> CheckResult:
    """With training.budget_minutes, max_steps is not what trains: the steps are planned from the pace
    measured when training starts. Judged here: the plan of a run already started, if any."""

    training = experiment.training
    budget = f"training.budget_minutes = {training.budget_minutes:g}"
    try:
        plan = TrainingPlan.load(Path(training.output_dir).expanduser())
    except UserError as exc:
        return _failure("training budget", exc)
    if plan is None:
        limit = epoch_limit_steps(blocks_per_step, blocks)
        return CheckResult(
            "training budget",
            True,
            f"{budget}: the steps are planned from this machine's pace when training starts; up to {limit:,} "
            f"steps of {blocks_per_step} blocks stay within {MAX_EPOCHS} epochs of {blocks:,} blocks",
        )
    advice = budget_advice(
        plan.max_steps,
        blocks_per_step,
        experiment.model.max_seq_len,
        blocks,
        fewer_by="start over with a lower training.budget_minutes, planning at most",
    )
    planned = f"planned for {plan.budget_seconds / 60:g} minutes in {training.output_dir}: "
    return _advice_check("training budget", Advice(planned + advice.detail, advice.fix))


def _memory_check(
    experiment: ExperimentConfig, device: torch.device | None, world_size: int, device_memory_gib: float | None
) -> CheckResult:
    training = experiment.training
    if device_memory_gib is not None:  # planning for another machine's GPU
        plan = plan_memory(experiment, device_memory_gib)
        assert plan.verdict is not None
        return CheckResult("memory", plan.verdict.fits, plan.verdict.detail, plan.verdict.fix)
    try:
        device = device if device is not None else resolve_device(training.device)
        precision = resolve_training_precision(training.precision, device)
    except UserError as exc:
        return _failure("memory", exc)
    shards = world_size if training.parallelism == "fsdp" else 1
    verdict = check_training_memory(experiment, device, precision, shards)
    return CheckResult("memory", verdict.fits, verdict.detail, verdict.fix)


def _checkpoint_check(experiment: ExperimentConfig, world_size: int) -> CheckResult:
    training = experiment.training
    resolved = training.resolved_checkpoint_format(world_size)
    chosen = "dcp async" if resolved == "dcp" and training.async_checkpoint else resolved
    estimates = estimate_checkpoints(experiment, world_size)
    lines = [("* " if estimate.format == chosen else "") + estimate.describe() for estimate in estimates]
    detail = f"{world_size} process(es), checkpoint_format {training.checkpoint_format!r} -> {chosen}; " + "; ".join(
        lines
    )
    return CheckResult("checkpoint size", True, detail)


def _lora_check(experiment: ExperimentConfig) -> CheckResult:
    """The adapters `[training.lora]` asks for, built on the meta device: the trained share of the model."""

    model, lora = experiment.model, experiment.training.lora
    try:
        entries = parameter_entries(model, experiment.training)
    except UserError as exc:
        return _failure("LoRA adapters", exc)
    total, trained = sum(e.size for e in entries), sum(e.size for e in entries if e.trainable)
    detail = (
        f"rank {lora.rank} on {', '.join(lora.target_modules)}: {format_parameter_count(trained)} of "
        f"{format_parameter_count(total)} parameters train ({trained / total:.2%}); the base stays frozen "
        f"({lora.base_dtype} Linear weights)"
    )
    return CheckResult("LoRA adapters", True, detail)


def _prompts_check(path: Path) -> CheckResult:
    """An RL run's prompts file exists (its records and rewards are checked when the run builds its step)."""

    if not path.is_file():
        return CheckResult("rl prompts", False, f"{path} does not exist", "set rl.prompts to a JSONL file of prompts")
    return CheckResult("rl prompts", True, f"{path}: {path.stat().st_size:,} bytes of JSONL prompts")


def validate_experiment(
    experiment: ExperimentConfig,
    device: torch.device | None = None,
    world_size: int = 1,
    device_memory_gib: float | None = None,
) -> list[CheckResult]:
    """Every check of `experiment`'s tokenizer, data, output directory and memory, in order.

    `device`: where training will run (default: `training.device` resolved here); `world_size`
    processes share the model state under FSDP; `device_memory_gib`: compare the memory estimate with
    a GPU of that size instead (`dlm validate --device-memory`).
    """

    training = experiment.training
    results, vocab = _tokenizer_checks(experiment)
    tokenizer_hash = tokenizer_sha256(training.tokenizer) if results[0].passed else None
    if experiment.rl is not None:  # the run samples its own batches from its prompts (`dlm rl`)
        results_train, train_dataset = [_prompts_check(experiment.rl.prompts)], None
    else:
        results_train, train_dataset = _data_checks(experiment, "train", training.train_data, tokenizer_hash, vocab)
    results += results_train
    if train_dataset is not None:
        vocabulary, suggested = _vocabulary_check(train_dataset)
        results += [vocabulary, _model_size_check(experiment, train_dataset, suggested)]
        documents = _document_length_check(experiment.model, train_dataset)
        results += [] if documents is None else [documents]
    if training.val_data is None or experiment.rl is not None:
        results.append(CheckResult("val data", True, "none configured: validation is off"))
    else:
        results += _data_checks(experiment, "val", training.val_data, tokenizer_hash, vocab)[0]
    results.append(_output_check(Path(training.output_dir)))
    if train_dataset is not None:
        results.append(_budget_check(experiment, train_dataset))
    if training.lora.enabled:
        results.append(_lora_check(experiment))
    try:  # a LoRA run's estimate builds the model with its adapters: peft and the targets must be right
        results.append(_memory_check(experiment, device, world_size, device_memory_gib))
    except UserError as exc:
        results.append(_failure("memory", exc))
    try:  # sized from the same parameter list as the memory estimate (a LoRA run's adapters included)
        results.append(_checkpoint_check(experiment, world_size))
    except UserError as exc:
        results.append(_failure("checkpoint size", exc))
    return results


def validate_config_file(
    path: str | Path,
    overrides: list[str] | None = None,
    world_size: int = 1,
    device_memory_gib: float | None = None,
) -> tuple[ExperimentConfig | None, list[CheckResult]]:
    """Load and schema-check a config file (with the shape of a Hugging Face `training.init_from`, as
    `dlm train` takes it), then run `validate_experiment` when it is valid."""

    try:
        experiment = adopt_source_model(load_config(path, overrides), overrides or [])
    except UserError as exc:
        return None, [_failure("config schema", exc)]
    schema = CheckResult("config schema", True, f"{path} is a valid config")
    results = validate_experiment(experiment, world_size=world_size, device_memory_gib=device_memory_gib)
    return experiment, [schema, *results]


def ensure_valid(experiment: ExperimentConfig, device: torch.device | None = None, world_size: int = 1) -> None:
    """Raise the first failed check as a UserError (the training loop's pre-flight)."""

    for result in validate_experiment(experiment, device, world_size):
        if not result.passed:
            raise UserError(f"{result.name}: {result.detail}", fix=result.fix or None)


def memory_warning(experiment: ExperimentConfig, device: torch.device) -> str | None:
    """What to tell a run whose activations may not fit the free memory, before its first step (None:
    they fit, or the model state does not, which `ensure_valid` refuses). It is no refusal (the activation
    figure is an estimate), but on the CPU the system would otherwise end the run without a word."""

    result = _memory_check(experiment, device, 1, None)
    return f"memory: {result.detail} ({result.fix})" if result.passed and result.fix else None
