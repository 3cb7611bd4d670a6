"""`dlm demo`: the whole pipeline on the bundled Shakespeare corpus, in one resumable call.

Each stage is reported as `{"event": "demo_stage", "stage": NAME, "status": "running" | "done" |
"reused", ...}`; the training stage also passes on every event of `dlm.train.loop.train`.

    tokenizer  byte-level BPE of model.vocab_size tokens on the 39 training works
    data       packed at model.max_seq_len; Hamlet, Macbeth and Twelfth Night are the validation split
    validate   the config's pre-flight checks against those files
    calibrate  time a few real training steps on the device
    train      `dlm.train.loop.train` until the planned last step or the end of the time budget
    evaluate   bits per byte on the validation plays (DIR/run/eval.json) beside a unigram baseline
               (`dlm.evaluation.unigram`)
    export     DIR/model: model.safetensors, config.json, tokenizer.json, README.md
    samples    an unconditional sample, one after a prompt and one infilled template (DIR/samples.json)

How the time budget becomes a complete learning-rate schedule (calibration, re-fits on the clock, the
warm restart of a larger --minutes) is `dlm.train.budget`'s concern, shared with `dlm train --minutes`;
the demo reports its stages as `demo_stage`, `demo_replan` and `demo_note` events.

Reuse: every stage checks its artifacts on disk (the tokenizer's vocabulary; the packed metadata's
tokenizer hash and seq_len; the plan and latest.pt; the step recorded in eval.json and in the
export), so a second call only does what is missing. Samples are cheap and always drawn again.

On the CPU the demo trains a smaller model (CPU_MODEL_OVERRIDES) and says so; an explicit --config
is always trained as given. Measured on 2 shared cores: the 14M-parameter config runs 10-50 s per
step of 64 x 256 tokens, a few dozen steps in ten minutes, and ends at the unigram level. Smaller
models at 256 tokens stayed on that plateau too (loss flat over every noise level, i.e. context
unused, after 1.6M tokens): with 256 positions, the signal that teaches attention to look at the
neighbours is diluted. With 64-token blocks, d_model 256 and 4 layers leave the plateau within
~0.5M tokens; d_model 96 (1.2M parameters) takes 1.9x (bfloat16) to 3.3x (float32) the steps of
d_model 256 in the same time and learns more in a CPU's ten minutes. That CPU model is
configs/cpu.toml's (a test keeps the two equal): training on mask probabilities in [0.3, 0.8]
only, and bfloat16 autocast where the CPU multiplies it natively (float32 elsewhere). The
measurements: 0.11 lab notes, "The demo on 2 CPU cores", "The CPU model's width at a CPU's pace" and
"CPU recipe ablation" (git show cece22c:docs/benchmarks.md).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from dlm.artifacts.events import StreamEvent, StreamSink
from dlm.artifacts.export import export_model
from dlm.artifacts.export_layout import CONFIG_NAME, read_export_config
from dlm.artifacts.loading import build_model, load_model, read_model_source
from dlm.artifacts.run_dir import RunDir
from dlm.assets import shakespeare_files
from dlm.bench.throughput import run_benchmark
from dlm.config.schema import ExperimentConfig, load_config, with_overrides
from dlm.data.dataset import load_packed_dataset
from dlm.data.pack import pack_corpus
from dlm.data.tokenizer import load_tokenizer, tokenizer_sha256, train_tokenizer
from dlm.demo.baseline import SpreadBlocks
from dlm.demo.distill import distill_stage
from dlm.errors import UserError
from dlm.evaluation.evaluate import EVAL_FORMAT, evaluate_model, write_report
from dlm.evaluation.likelihood import packed_token_bytes
from dlm.evaluation.sample_quality import corpus_words, pooled, sample_quality
from dlm.evaluation.unigram import unigram_bits_per_byte, unigram_verdict
from dlm.fileio import atomic_write_json
from dlm.runtime.device import resolve_device, resolve_precision, resolve_training_precision
from dlm.sampling.generation import generate
from dlm.sampling.prompting import template_fixed_text
from dlm.train.budget import FORWARD_SHARE, BudgetedTraining, check_minutes
from dlm.train.plan import TrainingPlan
from dlm.train.preflight import validate_experiment

SAMPLES_NAME = "samples.json"
EVAL_SECONDS = 30.0  # evaluation is sized to take about this long (or a tenth of a shorter budget)
EVAL_MC_SAMPLES = 4
PROGRESS_SECONDS = 0.5  # at most one progress event per stage this often
CPU_MODEL_OVERRIDES = (
    # d_model 96: at a CPU's ten minutes, the steps of a smaller model are worth more than the width
    # of a larger one (0.11 lab notes, "The CPU model's width at a CPU's pace": git show cece22c:docs/benchmarks.md).
    "model.d_model=96",
    "model.n_layers=4",
    "model.n_heads=2",
    "model.max_seq_len=64",  # the data is packed to match
    # batch 64 with Muon: level with batch 32 at an AVX2-only CPU's pace and 0.03 bits/byte better at an
    # AVX512-BF16 CPU's, in the same time (0.11 lab notes, "Muon's batch, the demo with Muon, and the gap by
    # budget": git show cece22c:docs/benchmarks.md).
    "training.batch_size=64",
    # Muon (where this torch has it, below) at 4e-3: 0.05-0.07 bits/byte below AdamW at 2e-3 in the same
    # CPU time (0.11 lab notes, "Muon at a CPU's pace": git show cece22c:docs/benchmarks.md).
    "training.learning_rate=4e-3",
    "training.eval_batches=4",
    # configs/cpu.toml's measured winner (0.11 lab notes, "CPU recipe ablation": git show
    # cece22c:docs/benchmarks.md): training draws mask probabilities in [0.3, 0.8] only (the evaluation
    # still covers all of them).
    "diffusion.schedule=linear",
    "training.clip_mask_min=0.3",
    "training.clip_mask_max=0.8",
)
# The demo's CPU optimizer, as its note names it: configs/cpu.toml's Muon, or on a torch before 2.9
# AdamW at the learning rate and batch it was measured at (batch 32: 0.017 bits/byte better than 64
# at an AVX2-only CPU's pace: 0.11 lab notes, "The AVX512-BF16 class's 2.2: the levers left", git show
# cece22c:docs/benchmarks.md).
_OPTIMIZER_NAMES = {"muon": "Muon", "adamw": "AdamW (this torch has no Muon)"}
_OPTIMIZER_OVERRIDES = {
    "muon": ("training.optimizer=muon",),
    "adamw": ("training.optimizer=adamw", "training.learning_rate=2e-3", "training.batch_size=32"),
}
SAMPLE_REQUESTS = (  # (label, prompt, infill template)
    ("unconditional", "", None),
    ("prompt", "ROMEO:", None),
    ("infill", "", "ROMEO: [MASK*16] fair Verona"),
)


def bundled_config() -> Path:
    """The demo's config inside the installed package (configs/shakespeare.toml links to it)."""

    return Path(str(resources.files("dlm.assets") / "shakespeare.toml"))


@dataclass
class DemoResult:
    """How `run_demo` ended and what it produced."""

    output: Path
    status: str  # complete | interrupted
    stages: dict[str, str] = field(default_factory=dict)  # stage -> done | reused
    step: int = 0
    bits_per_byte: float | None = None
    unigram_bits_per_byte: float | None = None
    model_dir: Path | None = None
    verdict: str | None = None  # said when the model ends at the unigram level
    samples: list[dict[str, Any]] = field(default_factory=list)
    # The samples' words pooled (`dlm.evaluation.sample_quality`), beside the held-out plays' words per token.
    sample_quality: dict[str, Any] = field(default_factory=dict)
    sample_length: int = 0  # tokens generated per sample: fits the model's context after a prompt
    comparison: dict[str, Any] | None = None  # --distill-minutes: the teacher's and the student's sample
    seconds: float = 0.0
    exit_code: int = 0

    def to_dict(self) -> dict[str, Any]:
        model_dir = None if self.model_dir is None else str(self.model_dir)
        return {**asdict(self), "output": str(self.output), "model_dir": model_dir}


@dataclass
class _Demo:
    """Paths, config and the event sink shared by the stages of one call."""

    output: Path
    minutes: float
    experiment: ExperimentConfig
    sink: StreamSink
    result: DemoResult

    @property
    def data_dir(self) -> Path:
        return self.output / "data"

    @property
    def run_dir(self) -> Path:
        return self.output / "run"

    @property
    def run(self) -> RunDir:
        return RunDir(self.run_dir)

    @property
    def model_dir(self) -> Path:
        return self.output / "model"

    @property
    def tokenizer_path(self) -> Path:
        return self.data_dir / "tokenizer.json"

    def emit(self, event: StreamEvent) -> None:
        """Pass an event on, noting how each stage ended."""

        if isinstance(event, dict) and event.get("event") == "demo_stage" and event["status"] != "running":
            self.result.stages[event["stage"]] = event["status"]
        self.sink(event)

    def stage(self, name: str, status: str, **figures: Any) -> None:
        self.emit({"event": "demo_stage", "stage": name, "status": status, **figures})

    def progress(self, stage: str) -> Callable[..., None]:
        """A progress callback (done, total, ...) that emits at most one event per PROGRESS_SECONDS."""

        last = {"time": 0.0, "done": -1}

        def report(done: int, total: int, *rest: int) -> None:
            now = time.monotonic()
            if done != last["done"] and (now - last["time"] >= PROGRESS_SECONDS or done >= total):
                last.update(time=now, done=done)
                self.emit({"event": "demo_progress", "stage": stage, "done": done, "total": total})

        return report


def _run_stage(
    demo: _Demo, name: str, reuse: Callable[[], dict[str, Any] | None], work: Callable[[], dict[str, Any]], what: str
) -> dict[str, Any]:
    """Reuse the stage's artifacts when they are there and right, else do the work, reporting both."""

    figures = reuse()
    if figures is not None:
        demo.stage(name, "reused", **figures)
        return figures
    demo.stage(name, "running", detail=what)
    started = time.perf_counter()
    figures = work()
    demo.stage(name, "done", seconds=round(time.perf_counter() - started, 2), **figures)
    return figures


def demo_experiment(output: Path, config_path: Path | None, device: str | None) -> tuple[ExperimentConfig, list[str]]:
    """The config to train, its file paths moved into `output`, and notes on what was changed."""

    overrides = [
        f"training.tokenizer={output / 'data' / 'tokenizer.json'}",
        f"training.train_data={output / 'data' / 'train.bin'}",
        f"training.val_data={output / 'data' / 'val.bin'}",
        f"training.output_dir={output / 'run'}",
    ] + ([] if device is None else [f"training.device={device}"])
    notes = []
    experiment = load_config(config_path or bundled_config(), overrides)
    # Resolved once here, so calibration, training, evaluation and sampling all use the same device.
    resolved = str(resolve_device(experiment.training.device))
    experiment = with_overrides(experiment, [f"training.device={resolved}"], "--device")
    if config_path is None and resolved == "cpu":
        # auto: bfloat16 autocast where the CPU multiplies it natively (more steps a minute), float32 elsewhere.
        precision = resolve_training_precision("auto", torch.device("cpu"))
        # Muon where this torch has it (2.9 and later), else AdamW: the demo runs on any supported torch.
        optimizer = "muon" if hasattr(torch.optim, "Muon") else "adamw"
        overrides = [*CPU_MODEL_OVERRIDES, "training.precision=auto", *_OPTIMIZER_OVERRIDES[optimizer]]
        experiment = with_overrides(experiment, overrides, "the demo's CPU model")
        model, training = experiment.model, experiment.training
        notes.append(
            f"on the CPU the demo trains a smaller model than shakespeare.toml's 14M-parameter one: d_model "
            f"{model.d_model}, {model.n_layers} layers, {model.max_seq_len}-token blocks, batch "
            f"{training.batch_size}, mask probabilities {training.clip_mask_min}-{training.clip_mask_max} in "
            f"training, {precision}, {_OPTIMIZER_NAMES[optimizer]} (configs/cpu.toml); in minutes of CPU the full "
            "model learns no more than token frequencies. A GPU trains the full config; --config trains any config "
            "as given"
        )
    return experiment, notes


def _check_existing_run(demo: _Demo) -> None:
    """Refuse a directory whose run trained another model before any stage packs over its data
    (the CPU model and the full config share the tokenizer but not the block length)."""

    path = demo.run.config
    if path.exists() and load_config(path).model != demo.experiment.model:
        raise UserError(
            "this demo directory holds a run of another model (made on another device, or with another --config)",
            path=demo.run_dir,
            fix="choose another --output, or delete that directory to start over",
        )


# ------------------------------------------------------------------------------ tokenizer, data


def _tokenizer_stage(demo: _Demo) -> None:
    wanted = demo.experiment.model.vocab_size

    def reuse() -> dict[str, Any] | None:
        if not demo.tokenizer_path.exists():
            return None
        vocab = load_tokenizer(demo.tokenizer_path).get_vocab_size(with_added_tokens=True)
        if vocab != wanted:
            raise UserError(
                f"this demo directory holds a {vocab}-token tokenizer, the config asks for {wanted}",
                path=demo.tokenizer_path,
                fix="choose another --output, or delete that directory to start over",
            )
        return {"vocab_size": vocab, "path": str(demo.tokenizer_path)}

    def work() -> dict[str, Any]:
        files = shakespeare_files("train")
        summary = train_tokenizer(files, wanted, demo.tokenizer_path, progress=demo.progress("tokenizer"))
        return {"vocab_size": summary.vocab_size, "path": str(summary.path), "input_bytes": summary.input_bytes}

    _run_stage(demo, "tokenizer", reuse, work, f"byte-level BPE of {wanted} tokens on the 39 training works")


def _read_split_metadata(demo: _Demo) -> dict[str, dict[str, Any]] | None:
    metadata = {}
    for split in ("train", "val"):
        path = demo.data_dir / f"{split}.json"
        if not path.exists():
            return None
        metadata[split] = json.loads(path.read_text(encoding="utf-8"))
    return metadata


def _data_stage(demo: _Demo) -> dict[str, Any]:
    seq_len = demo.experiment.model.max_seq_len

    def figures(metadata: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {f"{split}_{key}": meta[key] for split, meta in metadata.items() for key in ("num_blocks", "num_tokens")}

    def reuse() -> dict[str, Any] | None:
        metadata = _read_split_metadata(demo)
        digest = tokenizer_sha256(demo.tokenizer_path)
        if metadata is None or any(
            meta.get("tokenizer_sha256") != digest or meta.get("seq_len") != seq_len for meta in metadata.values()
        ):
            return None  # missing or made from other settings: packing again is cheap and safe
        return figures(metadata)

    def work() -> dict[str, Any]:
        pack_corpus(
            shakespeare_files("train"),
            demo.tokenizer_path,
            seq_len,
            demo.data_dir,
            val_inputs=shakespeare_files("val"),
            overwrite=True,
            progress=demo.progress("data"),
        )
        metadata = _read_split_metadata(demo)
        assert metadata is not None  # pack_corpus writes both splits or raises
        return figures(metadata)

    return _run_stage(
        demo, "data", reuse, work, f"packing blocks of {seq_len} tokens; Hamlet, Macbeth, Twelfth Night held out"
    )


def _validate_stage(demo: _Demo) -> None:
    def work() -> dict[str, Any]:
        results = validate_experiment(demo.experiment)
        for result in results:
            if not result.passed:
                raise UserError(f"{result.name}: {result.detail}", fix=result.fix or None)
        return {"checks": len(results)}

    _run_stage(demo, "validate", lambda: None, work, "checking the config against the tokenizer and data")


# ------------------------------------------------------------------------------ evaluate, export, samples


def _eval_figures(report: dict[str, Any], path: Path) -> dict[str, Any]:
    context = report.get("context", {})
    figures = {key: report.get(key) for key in ("bits_per_byte", "bits_per_byte_stderr", "nll", "sequences")}
    return {
        **figures,
        "unigram_bits_per_byte": context.get("unigram_bits_per_byte"),
        "step": context.get("step"),
        "path": str(path),
    }


def _evaluate(demo: _Demo, sequences: int) -> dict[str, Any]:
    """Evaluate the run's latest.pt on `sequences` spread validation blocks and write eval.json."""

    device = torch.device(demo.experiment.training.device)
    info, weights = read_model_source(demo.run_dir)
    model = build_model(info.model, weights, device, torch.float32, source=info.path)
    val = load_packed_dataset(demo.data_dir, info.model.max_seq_len, split="val")
    blocks = SpreadBlocks(val, sequences)
    batch_size = min(demo.experiment.training.batch_size, len(blocks))
    token_bytes, _ = packed_token_bytes(val.metadata, [demo.data_dir / "tokenizer.json"])
    report = evaluate_model(
        model,
        blocks,
        batches=math.ceil(len(blocks) / batch_size),
        mc_samples=EVAL_MC_SAMPLES,
        batch_size=batch_size,
        device=device,
        precision=resolve_precision("auto", device),
        mask_eps=info.diffusion.mask_eps,
        schedule=info.diffusion.schedule,
        metadata=val.metadata,
        token_bytes=token_bytes,
    )
    unigram = unigram_bits_per_byte(demo.data_dir, blocks.indices, token_bytes)
    report.unigram_bits_per_byte = unigram  # where `dlm eval` writes it, and `dlm report` reads it
    report.context = {
        **info.to_dict(),
        "data": str(val.path),
        "val_blocks": len(val),
        "blocks": blocks.indices,
        "unigram_bits_per_byte": unigram,
    }
    write_report(report, demo.run.eval_report)
    return _eval_figures(report.to_dict(), demo.run.eval_report)


def _evaluate_stage(demo: _Demo, plan: TrainingPlan, step: int, val_blocks: int) -> dict[str, Any]:
    path = demo.run.eval_report
    # Sized to take about EVAL_SECONDS: each sequence gets two fixed-noise passes plus
    # EVAL_MC_SAMPLES Monte Carlo ones, each pass about FORWARD_SHARE of a training step.
    passes = (2 + EVAL_MC_SAMPLES) * FORWARD_SHARE
    per_sequence = passes * plan.seconds_per_step / demo.experiment.training.batch_size
    seconds = min(EVAL_SECONDS, 0.1 * demo.minutes * 60.0)
    sequences = max(16, min(val_blocks, int(seconds / per_sequence)))

    def reuse() -> dict[str, Any] | None:
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        # An older format's bits per byte were estimated, not counted: evaluate again.
        if not isinstance(report, dict) or report.get("format") != EVAL_FORMAT:
            return None
        if report.get("context", {}).get("step") != step:
            return None
        return _eval_figures(report, path)

    what = f"bits per byte on {min(sequences, val_blocks)} of {val_blocks} validation blocks, spread evenly"
    return _run_stage(demo, "evaluate", reuse, lambda: _evaluate(demo, sequences), what)


def _export_stage(demo: _Demo, step: int) -> None:
    def reuse() -> dict[str, Any] | None:
        if not (demo.model_dir / CONFIG_NAME).exists() or read_export_config(demo.model_dir).get("step") != step:
            return None
        return {"path": str(demo.model_dir), "step": step}

    def work() -> dict[str, Any]:
        export_model(demo.run_dir, demo.model_dir, overwrite=True)
        return {"path": str(demo.model_dir), "step": step}

    _run_stage(demo, "export", reuse, work, f"step {step} to {demo.model_dir}")


def _samples_stage(demo: _Demo) -> list[dict[str, Any]]:
    device = demo.experiment.training.device
    length = demo.result.sample_length = min(64, demo.experiment.model.max_seq_len * 3 // 4)  # room for a prompt
    demo.stage("samples", "running", detail=f"{len(SAMPLE_REQUESTS)} samples of {length} tokens")
    started = time.perf_counter()
    # float32 on the CPU: sampling is cheap there and float32 is exact; elsewhere the exported bf16 as stored.
    model, tokenizer = load_model(demo.model_dir, device=device, dtype=torch.float32 if device == "cpu" else None)
    training, held_out = corpus_words(shakespeare_files("train")), corpus_words(shakespeare_files("val"), tokenizer)
    samples, qualities = [], []
    for seed, (label, prompt, template) in enumerate(SAMPLE_REQUESTS):
        result = generate(model, tokenizer, prompt=prompt, text=template, length=length, steps=length, seed=seed)
        fixed = prompt if template is None else template_fixed_text(template)
        quality = sample_quality(result.texts[0], fixed, result.lengths[0], training.vocabulary)
        qualities.append(quality)
        sample = {
            "label": label,
            "prompt": prompt,
            "template": template,
            "text": result.texts[0],
            "forward_passes": result.forward_passes,
            "seconds": round(result.seconds, 2),
            "quality": quality.to_dict(),
        }
        samples.append(sample)
        demo.emit({"event": "demo_sample", **sample})
    demo.result.sample_quality = {
        **pooled(qualities).to_dict(),
        "held_out_words_per_token": round(held_out.words_per_token, 4),
    }
    atomic_write_json(demo.output / SAMPLES_NAME, samples, ensure_ascii=False)
    demo.stage("samples", "done", seconds=round(time.perf_counter() - started, 2), path=str(demo.output / SAMPLES_NAME))
    return samples


# ------------------------------------------------------------------------------ the pipeline


def run_demo(
    output: str | Path = "runs/demo",
    minutes: float = 10.0,
    device: str | None = None,
    config_path: str | Path | None = None,
    sink: StreamSink | None = None,
    distill_minutes: float | None = None,
) -> DemoResult:
    """Run (or finish) the demo in `output`; `minutes` bounds the training stage, calibration included.

    `device` None keeps the config's training.device (auto for the bundled config). `distill_minutes`
    then distils the model into a few-step student within that budget (`dlm.demo.distill`)."""

    check_minutes(minutes)
    started = time.perf_counter()
    output = Path(output).expanduser().resolve()
    experiment, notes = demo_experiment(output, None if config_path is None else Path(config_path), device)
    demo = _Demo(output, minutes, experiment, sink or (lambda event: None), DemoResult(output, "complete"))
    demo.emit(
        {
            "event": "demo_start",
            "output": str(output),
            "minutes": minutes,
            "device": experiment.training.device,
            "config": str(config_path or bundled_config()),
            "model": experiment.model.model_dump(),
        }
    )
    for message in notes:
        demo.emit({"event": "demo_note", "message": message})
    _check_existing_run(demo)
    _tokenizer_stage(demo)
    val_blocks = _data_stage(demo)["val_num_blocks"]
    _validate_stage(demo)

    training = BudgetedTraining(
        experiment,
        minutes,
        calibrate=run_benchmark,
        emit=demo.emit,
        val_blocks=val_blocks,
        event_prefix="demo",
        output_option="--output",
        start_over="delete that directory to start over",
    )
    plan, step, trained = training.run()
    result = demo.result
    result.step = step
    if trained is not None and trained.status == "interrupted":
        result.status, result.exit_code = "interrupted", trained.exit_code
        result.seconds = time.perf_counter() - started
        demo.emit({"event": "demo_interrupted", "step": step, "continue": "run the same `dlm demo` command again"})
        return result
    figures = _evaluate_stage(demo, plan, step, val_blocks)
    result.bits_per_byte, result.unigram_bits_per_byte = figures["bits_per_byte"], figures["unigram_bits_per_byte"]
    result.verdict = unigram_verdict(result.bits_per_byte, result.unigram_bits_per_byte)
    if result.verdict is not None:
        demo.emit({"event": "demo_note", "message": result.verdict})
    _export_stage(demo, step)
    result.model_dir = demo.model_dir
    result.samples = _samples_stage(demo)
    if distill_minutes is not None:
        result.comparison = distill_stage(
            demo.model_dir, demo.data_dir, output, distill_minutes, result.sample_length or 64, demo.emit
        )
    result.seconds = time.perf_counter() - started
    demo.emit({"event": "demo_done", **result.to_dict()})
    return result
