"""Evaluation: fixed-noise validation, Monte Carlo ELBO likelihood, bits per byte, loss by noise level.

`fixed_noise_validation` is what the training loop reports at every `eval_interval`: batch i of the
validation set is corrupted at the fixed diffusion time eps + (1 - eps) * (i + 0.5) / n (the noise
schedule turns it into a mask probability), with masks drawn from a generator seeded 0, so the same
checkpoint and data always give the same numbers and the whole noise range is covered even with few
batches. It never touches the global RNG.

`evaluate_model` (behind `dlm eval`) adds the figures that compare models:

- the negative ELBO per token, a bound on the true NLL, estimated per sequence from K antithetic
  Monte Carlo samples (`dlm.diffusion.objective.elbo_nll`; `estimator` picks how a sample masks the
  sequence), with its standard error, and exp(NLL), a bound on perplexity;
- bits per byte, NLL x tokens / (bytes x ln 2): the figure that compares across tokenizers (the NLL
  is total NLL over total tokens, so this is total NLL over total bytes, in bits). `bytes`
  are the exact UTF-8 bytes of the tokens scored (byte-level BPE decodes every id to fixed bytes;
  special tokens count 0), so the figure is exact for any number of blocks, and the report holds
  `tokens` and `bytes` to recompute it;
- the loss in `NOISE_BUCKETS` buckets of the diffusion time t (how hard denoising is at each level).

The byte counting and the likelihood figures themselves live in `dlm.evaluation.likelihood`.

Every figure comes from one noise schedule (`dlm.diffusion.schedules`), the one the model was trained with.

All noise comes from seeded generators: the Monte Carlo ELBO's (the bits per byte) by (seed, pass,
sequence index), so that its figures do not depend on the batch size; the fixed-noise pass and the
loss-by-noise buckets by (seed, pass, batch index), as training's validation draws them. The same
checkpoint and data give the same report on every run, and the global RNG is left alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dlm.artifacts.eval_report import check_report_path
from dlm.artifacts.export_layout import checked_tokenizer
from dlm.artifacts.loading import build_model, read_model_source
from dlm.data.dataset import load_packed_dataset
from dlm.diffusion.objective import (
    ESTIMATORS,
    Batch,
    corrupt_tokens,
    diffusion_cross_entropy,
    elbo_nll,
    noise_seed,
    split_batch,
)
from dlm.diffusion.schedules import DEFAULT_MASK_EPS, DEFAULT_SCHEDULE, NOISE_BUCKETS, Schedule, get_schedule
from dlm.errors import UserError
from dlm.evaluation.likelihood import byte_table, likelihood_figures, packed_token_bytes, scored_counts
from dlm.evaluation.unigram import TRAINING_ADVICE, unigram_bits_per_byte, unigram_verdict
from dlm.fileio import atomic_write_json
from dlm.model.denoiser import block_size, masked_logits
from dlm.runtime.allocator import keep_freed_memory
from dlm.runtime.device import autocast_context, resolve_precision

if TYPE_CHECKING:
    from dlm.model.denoiser import Denoiser

# v2: `bytes` (exact UTF-8 bytes of the scored tokens) replaced v1's estimated `text_bytes`.
EVAL_FORMAT = "dlm-eval-v2"
# Each pass draws from its own generator stream, so adding a pass never shifts another's noise.
_ELBO_PASS, _BUCKET_PASS, _EXACT_COUNT_PASS = 1, 2, 3
Progress = Callable[[int, int], None]  # (batches done, batches in all)


def fixed_noise_level(batch_index: int, num_batches: int, mask_eps: float) -> float:
    """The diffusion time of validation batch `batch_index` out of `num_batches`."""

    return mask_eps + (1.0 - mask_eps) * (batch_index + 0.5) / num_batches


@torch.no_grad()
def fixed_noise_validation(
    model: Denoiser,
    batches: Iterable[Batch],
    device: torch.device,
    precision: str,
    mask_eps: float,
    max_batches: int,
    *,
    schedule: Schedule | None = None,
) -> dict[str, Any]:
    """Masked cross-entropy (ELBO weighted) and masked accuracy at fixed noise levels of `schedule`
    (default linear)."""

    was_training = model.training
    model.eval()
    generator = torch.Generator(device=device).manual_seed(0)
    schedule = get_schedule(schedule or DEFAULT_SCHEDULE)
    mask_token_id = model.config.mask_token_id
    # Sums stay on the device (no host sync per batch); MPS has no float64, so float32 there.
    accumulate = torch.float32 if device.type == "mps" else torch.float64
    loss_sum = torch.zeros((), device=device, dtype=accumulate)
    correct = torch.zeros((), device=device, dtype=accumulate)
    masked = torch.zeros((), device=device, dtype=accumulate)
    count = 0
    try:
        for batch_index, batch in enumerate(batches):
            if batch_index >= max_batches:
                break
            clean, loss_mask = _on_device(batch, device)
            level = fixed_noise_level(batch_index, max_batches, mask_eps)
            times = torch.full((clean.shape[0],), level, device=device, dtype=torch.float32)
            corruption = corrupt_tokens(
                clean,
                mask_token_id,
                times,
                mask_eps,
                generator,
                schedule=schedule,
                block_size=block_size(model.config),
                loss_mask=loss_mask,
            )
            logits = _logits_fn(model, device, precision, clean)(corruption.noisy_tokens, corruption.mask)
            output = diffusion_cross_entropy(logits, clean, corruption)
            loss_sum += output.loss.to(accumulate)
            correct += output.masked_accuracy.to(accumulate) * output.masked_tokens
            masked += output.masked_tokens
            count += 1
    finally:
        model.train(was_training)
    if count == 0:
        return {"loss": float("nan"), "masked_accuracy": float("nan"), "batches": 0}
    return {
        "loss": float(loss_sum / count),
        "masked_accuracy": float(correct / masked.clamp(min=1)),
        "batches": count,
    }


# ---------------------------------------------------------------------------------------------
# The full evaluation
# ---------------------------------------------------------------------------------------------


@dataclass
class NoiseBucket:
    """The loss of the sequences whose diffusion time t fell in [t_low, t_high)."""

    t_low: float
    t_high: float
    sequences: int
    loss: float | None  # ELBO-weighted loss per token (as training's loss_by_t), nats
    masked_ce: float | None  # plain cross-entropy per masked token, nats


@dataclass
class EvalReport:
    """Everything `dlm eval` reports; `to_dict()` is its JSON form (`eval.json`)."""

    sequences: int  # sequences scored (with a loss mask, those holding at least one loss token)
    tokens: int
    batches: int
    batch_size: int
    mc_samples: int
    estimator: str  # how each Monte Carlo sample masks a sequence (`dlm.diffusion.objective.ESTIMATORS`)
    mask_eps: float
    schedule: str  # the noise schedule every figure was computed with
    precision: str
    device: str
    fixed_noise_loss: float
    fixed_noise_accuracy: float
    nll: float  # negative ELBO per token (nats), total over tokens: an upper bound on the model's NLL
    nll_stderr: float | None  # over sequences and Monte Carlo samples together
    nll_mc_stderr: float | None  # Monte Carlo part only: how much a larger K would still move nll
    perplexity_bound: float
    bits_per_byte: float | None
    bits_per_byte_stderr: float | None
    bytes: int | None  # exact UTF-8 bytes of the scored tokens: bits_per_byte = nll x tokens / (bytes x ln 2)
    loss_by_t: list[NoiseBucket] = field(default_factory=list)
    # Bits per byte of the training split's token frequencies on the same scored tokens (`dlm.evaluation.unigram`).
    unigram_bits_per_byte: float | None = None
    notes: list[str] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)  # model and data it came from

    def to_dict(self) -> dict[str, Any]:
        return {"format": EVAL_FORMAT, **_finite_or_none(asdict(self))}


def _finite_or_none(value: Any) -> Any:
    """NaN and inf become None: JSON has no spelling for them."""

    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(item) for item in value]
    return value


def _batches(dataset: Any, batch_size: int, count: int) -> Iterator[Batch]:
    """The first `count` batches in order (the last may be short), as the training validation
    reads them. Indexing directly, not through a DataLoader: its iterator draws a base seed from
    the global RNG. Instruction data gives (tokens, loss mask) pairs."""

    end = min(len(dataset), count * batch_size)
    for start in range(0, end, batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, end))]
        if isinstance(items[0], tuple):
            yield torch.stack([ids for ids, _ in items]), torch.stack([mask for _, mask in items])
        else:
            yield torch.stack([torch.as_tensor(item) for item in items])


def _on_device(batch: Batch, device: torch.device) -> tuple[Tensor, Tensor | None]:
    clean, loss_mask = split_batch(batch)
    return clean.to(device, non_blocking=True), None if loss_mask is None else loss_mask.to(device)


def _reported(batches: Iterable[Batch], progress: Progress | None, start: int, total: int) -> Iterator[Batch]:
    for done, batch in enumerate(batches, start + 1):  # a batch is scored when the next is asked for
        yield batch
        if progress is not None:
            progress(done, total)


def _logits_fn(
    model: Denoiser, device: torch.device, precision: str, clean: Tensor
) -> Callable[[Tensor, Tensor], Tensor]:
    """Logits at the masked positions of a corruption of `clean` (a block model also reads `clean`)."""

    def logits(noisy_tokens: Tensor, mask: Tensor) -> Tensor:
        with autocast_context(device, precision):
            return masked_logits(model, noisy_tokens, mask, clean)

    return logits


def _pass_generator(seed: int, pass_id: int, batch_index: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(noise_seed(seed, pass_id, batch_index))


@torch.no_grad()
def _elbo_pass(
    model: Denoiser,
    batches: Iterable[Batch],
    device: torch.device,
    precision: str,
    mask_eps: float,
    mc_samples: int,
    seed: int,
    schedule: Schedule,
    estimator: str = "bernoulli",
) -> tuple[Tensor, Tensor]:
    """Per-sequence Monte Carlo NLL per token and its standard error, both [S] float64."""

    means, errors = [], []
    first = 0  # index of the batch's first sequence in the data
    blocks = block_size(model.config)
    for batch in batches:
        (clean, loss_mask), mask_id = _on_device(batch, device), model.config.mask_token_id
        # One generator per sequence, seeded by its index in the data: no dependence on the batch size.
        pass_id = _EXACT_COUNT_PASS if estimator == "exact-count" else _ELBO_PASS
        generator = [_pass_generator(seed, pass_id, row, device) for row in range(first, first + clean.shape[0])]
        first += clean.shape[0]
        logits = _logits_fn(model, device, precision, clean)
        mean, error = elbo_nll(
            logits,
            clean,
            mask_id,
            mc_samples,
            mask_eps,
            generator,
            schedule=schedule,
            block_size=blocks,
            loss_mask=loss_mask,
            estimator=estimator,
        )
        means.append(mean.cpu().double())  # float64 on the host (MPS has none)
        errors.append(error.cpu().double())
    return torch.cat(means), torch.cat(errors)


@torch.no_grad()
def _bucket_pass(
    model: Denoiser,
    batches: Iterable[Batch],
    device: torch.device,
    precision: str,
    mask_eps: float,
    batch_size: int,
    seed: int,
    schedule: Schedule,
) -> list[NoiseBucket]:
    """One corruption per sequence, sequence s in bucket s mod NOISE_BUCKETS at a uniform t within it."""

    edges = [j / NOISE_BUCKETS for j in range(NOISE_BUCKETS + 1)]  # exact decimals in the report
    low = torch.tensor(edges[:-1], dtype=torch.float64).clamp(min=mask_eps)
    high = torch.tensor(edges[1:], dtype=torch.float64)
    totals = torch.zeros(4, NOISE_BUCKETS, dtype=torch.float64)  # loss, ce, masked, sequences
    blocks = block_size(model.config)
    for index, batch in enumerate(batches):
        clean, loss_mask = _on_device(batch, device)
        generator = _pass_generator(seed, _BUCKET_PASS, index, device)
        bucket = (torch.arange(clean.shape[0]) + index * batch_size) % NOISE_BUCKETS
        unit = torch.rand(clean.shape[0], generator=generator, device=device).cpu().double()
        times = (low[bucket] + (high[bucket] - low[bucket]) * unit).float()
        corruption = corrupt_tokens(
            clean,
            model.config.mask_token_id,
            times.to(device),
            mask_eps,
            generator,
            schedule=schedule,
            block_size=blocks,
            loss_mask=loss_mask,
        )
        logits = _logits_fn(model, device, precision, clean)(corruption.noisy_tokens, corruption.mask)
        output = diffusion_cross_entropy(logits, clean, corruption)
        nll = output.per_sequence_nll.cpu().double()
        scored = clean.shape[1] if loss_mask is None else loss_mask.sum(dim=1).clamp(min=1).cpu().double()
        masked = corruption.mask.sum(dim=1).cpu().double()
        # per_sequence_nll = sum(CE x rate / m) / L, so the plain CE sum is nll x L x m / rate (a block
        # model's blocks share the sequence's time here, so its first block's weight is everyone's).
        probability = corruption.mask_probability.reshape(clean.shape[0], -1)[:, 0]
        rate = corruption.mask_rate.reshape(clean.shape[0], -1)[:, 0]
        weight_inverse = probability.cpu().double() / rate.cpu().double()
        ce = nll * scored * weight_inverse
        for row, values in enumerate((nll, ce, masked, torch.ones_like(nll))):
            totals[row].index_add_(0, bucket, values)
    loss, ce, masked, count = totals
    return [
        NoiseBucket(
            t_low=float(low[j]),
            t_high=float(high[j]),
            sequences=int(count[j]),
            loss=float(loss[j] / count[j]) if count[j] else None,
            masked_ce=float(ce[j] / masked[j]) if masked[j] else None,
        )
        for j in range(NOISE_BUCKETS)
    ]


def _check_counts(batches: int, mc_samples: int, batch_size: int, estimator: str = "bernoulli") -> None:
    for option, value in (("--batches", batches), ("--mc-samples", mc_samples), ("--batch-size", batch_size)):
        if value < 1:
            raise UserError(f"{option} must be at least 1 (got {value})", fix=f"pass {option} 1 or more")
    if estimator not in ESTIMATORS:
        raise UserError(
            f"--estimator must be one of {', '.join(ESTIMATORS)} (got {estimator!r})",
            fix="pass --estimator exact-count for the lower-variance one",
        )


def evaluate_model(
    model: Denoiser,
    dataset: Any,
    *,
    batches: int = 8,
    mc_samples: int = 8,
    batch_size: int = 8,
    estimator: str = "bernoulli",
    device: str | torch.device = "cpu",
    precision: str = "float32",
    mask_eps: float = DEFAULT_MASK_EPS,
    schedule: str | Schedule = DEFAULT_SCHEDULE,
    metadata: Mapping[str, Any] | None = None,
    seed: int = 0,
    token_bytes: Any = None,
    progress: Progress | None = None,
) -> EvalReport:
    """Evaluate `model` on the first `batches` batches of `dataset` (blocks of token ids).

    Bits per byte need the UTF-8 bytes of every token id: `token_bytes` (a table indexed by id, as
    `dlm.data.tokenizer.token_byte_lengths` makes), else the table of the tokenizer.json beside a packed
    `dataset` whose sha256 `metadata` (default: `dataset.metadata`) records. `schedule` and
    `mask_eps` are the model's `[diffusion]` settings. `estimator` (`dlm.diffusion.objective.ESTIMATORS`) is
    how the ELBO's Monte Carlo samples mask a sequence. `progress(done, total)` counts the batches
    scored over the three passes.
    """

    _check_counts(batches, mc_samples, batch_size, estimator)
    device = torch.device(device)
    keep_freed_memory(device)  # on the CPU every batch's passes reuse the memory of the last
    schedule = get_schedule(schedule)
    if metadata is None:
        metadata = getattr(dataset, "metadata", None)
    available = -(-len(dataset) // batch_size)
    count = min(batches, available)
    notes = [] if count == batches else [f"the data holds only {len(dataset)} blocks: evaluated {count} batches"]
    if count == 0:
        raise UserError("the evaluation data holds no blocks", fix="pass --data with a packed split")
    if (metadata or {}).get("loss_mask"):
        notes.append("instruction data: the conditional ELBO of the responses given their prompts, per response token")
    table, why = byte_table(token_bytes, dataset, metadata)
    notes += [why] if why else []
    counts, text_bytes = scored_counts(_batches(dataset, batch_size, count), table)
    if not bool(counts.any()):
        raise UserError(
            f"none of the {counts.numel()} sequences evaluated holds a token to score: their loss mask is all 0",
            path=getattr(dataset, "mask_path", None) or getattr(dataset, "path", None),
            fix="pack the instruction data again with `dlm pack --chat`, which keeps only examples with a reply",
        )
    was_training = model.training
    model.eval()
    try:
        data = [_reported(_batches(dataset, batch_size, count), progress, i * count, 3 * count) for i in range(3)]
        fixed = fixed_noise_validation(model, data[0], device, precision, mask_eps, count, schedule=schedule)
        means, errors = _elbo_pass(model, data[1], device, precision, mask_eps, mc_samples, seed, schedule, estimator)
        buckets = _bucket_pass(model, data[2], device, precision, mask_eps, batch_size, seed, schedule)
    finally:
        model.train(was_training)
    return EvalReport(
        batches=count,
        batch_size=batch_size,
        mc_samples=mc_samples,
        estimator=estimator,
        mask_eps=mask_eps,
        schedule=schedule.name,
        precision=precision,
        device=str(device),
        fixed_noise_loss=fixed["loss"],
        fixed_noise_accuracy=fixed["masked_accuracy"],
        **likelihood_figures(means, errors, counts, mc_samples, text_bytes, notes),
        loss_by_t=buckets,
        notes=notes,
    )


def _evaluation_dataset(data: str | Path | None, info: Any) -> Any:
    """The packed split to evaluate on: `data` (a `dlm pack` directory's val split, or a .bin), or
    the run's own validation data; refuse data tokenized for another model."""

    if data is None:
        if info.experiment is None:
            raise UserError(
                "an exported model does not know which data to evaluate on",
                path=info.path,
                fix="pass --data DIR_OR_BIN (a `dlm pack` output directory or one of its .bin files)",
            )
        data = info.experiment.training.val_data
        if data is None:
            raise UserError(
                "the run has no validation data (training.val_data is unset)",
                path=info.path,
                fix="pass --data DIR_OR_BIN",
            )
    dataset = load_packed_dataset(data, info.model.max_seq_len, split="val")
    if dataset.metadata["tokenizer_sha256"] != info.tokenizer_sha256:
        raise UserError(
            "the data was packed with another tokenizer than the model was trained with",
            path=dataset.path,
            fix="pack the text again with the model's tokenizer.json",
        )
    return dataset


def evaluate_source(
    source: str | Path,
    data: str | Path | None = None,
    *,
    batches: int | str | None = None,
    mc_samples: int = 8,
    batch_size: int | None = None,
    estimator: str = "bernoulli",
    device: str | torch.device = "cpu",
    precision: str = "auto",
    use_ema: bool = True,
    progress: Progress | None = None,
) -> EvalReport:
    """`dlm eval`: evaluate a checkpoint, run dir or exported model on `data` (default: the run's
    validation data). Batches and batch size default to the run's validation settings, so the
    fixed-noise figures of a training checkpoint repeat its last validation event; `batches="all"`
    scores the whole split; the context's `data_sequences` is the split's size."""

    info, weights = read_model_source(source, use_ema)
    checked_tokenizer(info)  # the model's own, present and fitting it, before the data is compared with it
    dataset = _evaluation_dataset(data, info)
    training = info.experiment.training if info.experiment is not None else None
    batches = batches if batches is not None else (training.eval_batches if training else 8)
    batch_size = batch_size if batch_size is not None else (training.batch_size if training else 8)
    batches = -(-len(dataset) // max(batch_size, 1)) if batches == "all" else int(batches)
    _check_counts(batches, mc_samples, batch_size, estimator)
    device = torch.device(device)
    # float32 weights: `precision` alone decides the compute dtype (autocast), whatever was stored.
    model = build_model(info.model, weights, device, torch.float32, source=info.path)
    del weights
    # The copy `dlm pack` keeps beside the data, else the model's own (same hash: checked above).
    beside = [dataset.path.parent / "tokenizer.json", Path(info.tokenizer_path)]
    token_bytes, why = packed_token_bytes(dataset.metadata, dict.fromkeys(beside))
    report = evaluate_model(
        model,
        dataset,
        batches=batches,
        mc_samples=mc_samples,
        batch_size=batch_size,
        estimator=estimator,
        device=device,
        precision=resolve_precision(precision, device),
        mask_eps=info.diffusion.mask_eps,
        schedule=info.diffusion.schedule,
        metadata=dataset.metadata,
        token_bytes=token_bytes,
        progress=progress,
    )
    if why:  # evaluate_model looked beside the data only: name every place looked at
        report.notes = [note for note in report.notes if not note.startswith("bits per byte skipped")] + [why]
    report.context = {**info.to_dict(), "data": str(dataset.path), "data_sequences": len(dataset)}
    _add_unigram_level(report, dataset, token_bytes)
    return report


def _add_unigram_level(report: EvalReport, dataset: Any, token_bytes: Any) -> None:
    """The unigram level of the scored sequences beside the model's bits per byte, from the
    training split packed with the data, with a verdict when the model is no better."""

    train = dataset.path.parent / "train.bin"
    if report.bits_per_byte is None or dataset.metadata.get("loss_mask"):
        return  # no byte count, or instruction data: responses given prompts have no unigram analogue
    if not train.is_file():
        report.notes.append("unigram level skipped: no train.bin beside the data to count frequencies in")
        return
    scored = range(report.sequences)  # the first sequences, in order, as the passes read them
    report.unigram_bits_per_byte = unigram_bits_per_byte(train.parent, scored, token_bytes, evaluated=dataset)
    verdict = unigram_verdict(report.bits_per_byte, report.unigram_bits_per_byte, TRAINING_ADVICE)
    report.notes += [verdict] if verdict else []


def write_report(report: EvalReport, path: str | Path) -> Path:
    """Write `report` as JSON under a temporary name, then rename it to `path`."""

    path = Path(path)
    check_report_path(path)
    return atomic_write_json(path, report.to_dict())
