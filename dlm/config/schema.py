"""Typed experiment configuration: pydantic models, TOML loading and `--set` overrides (the
reference generated from them is `dlm.config.reference`).

One `ExperimentConfig` holds a `ModelConfig` (what the network is) and a `TrainingConfig` (how it is
trained). Every field is bounded; cross-field rules (declared in `dlm.config.rules`) live in
validators that name the field and the fix, and `load_config` turns pydantic's errors into one
readable `UserError` naming the file.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dlm.choices import ElboEstimator
from dlm.config.distill import DistillConfig
from dlm.config.lora import LoraConfig
from dlm.config.optimizer_registry import describe_optimizers, registered_optimizers
from dlm.config.rl import RLConfig
from dlm.config.rope import RopeScaling
from dlm.config.rules import EXPERIMENT_RULES, MODEL_RULES, TRAINING_RULES, FieldProblem
from dlm.config.rules import check_rules as _check_rules
from dlm.diffusion.schedules import DEFAULT_MASK_EPS, DEFAULT_SCHEDULE, describe_schedules, schedule_names
from dlm.errors import UserError, UserNote

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


MaskLogit = Literal["plain", "subs"]
AttentionKind = Literal["bidirectional", "causal"]


class ModelConfig(_Strict):
    """The network: a bidirectional pre-norm transformer with rotary positions and a tied head by default;
    the variant properties (`n_kv_heads` to `shift_logits`) describe imported checkpoints (`dlm import`)."""

    vocab_size: int = Field(8192, ge=4, le=1 << 24, description="Tokens in the tokenizer, special tokens included.")
    mask_token_id: int = Field(1, ge=0, description="Id of the mask (absorbing-state) token.")
    max_seq_len: int = Field(256, ge=2, le=1 << 17, description="Tokens per training sequence (packed block length).")
    d_model: int = Field(384, ge=8, le=65536, description="Width of the residual stream.")
    n_layers: int = Field(6, ge=1, le=512, description="Number of transformer blocks.")
    n_heads: int = Field(6, ge=1, le=1024, description="Attention heads; d_model / n_heads is the head dimension.")
    ffn_hidden_size: int | None = Field(
        None, ge=8, description="SwiGLU hidden width; default 8/3 x d_model rounded up to a multiple of 64."
    )
    rope_theta: float = Field(10000.0, gt=0, description="Base of the rotary position embedding frequencies.")
    norm_eps: float = Field(1e-6, gt=0, lt=1, description="Epsilon of the RMSNorm layers.")
    init_std: float = Field(0.02, gt=0, le=1, description="Standard deviation of the weight initialisation.")
    pad_vocab_multiple: int = Field(
        128, ge=1, le=4096, description="Pad embedding rows to this multiple (padding is never predicted)."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each block in the backward pass: less memory, about 30% more compute."
    )
    block_size: int = Field(
        0,
        ge=0,
        description="Block diffusion: tokens per block, attended bidirectionally inside a block and causally "
        'across blocks; 1 is autoregressive (with attention = "causal", trained in one causal pass), 0 (default) '
        "is the whole sequence (plain masked diffusion).",
    )
    n_kv_heads: int | None = Field(
        None, ge=1, description="Key / value heads (grouped-query attention); default n_heads (one per query head)."
    )
    attention_head_dim: int | None = Field(
        None, ge=2, le=1024, description="Width of one attention head; default d_model / n_heads (Qwen3 sets its own)."
    )
    qkv_bias: bool = Field(False, description="Biases on the query, key and value projections (Qwen2, Dream).")
    qk_norm: bool = Field(False, description="RMSNorm of each query and key head before the rotary embedding (Qwen3).")
    tie_embeddings: bool = Field(True, description="The output head is the token embedding; false gives it its own.")
    rope_scaling: RopeScaling | None = Field(
        None, description="Rotary frequency scaling ([model.rope_scaling]: type linear or llama3); none is plain RoPE."
    )
    attention: AttentionKind = Field(
        "bidirectional",
        description="bidirectional: every position sees the whole sequence (masked diffusion); causal: each sees "
        "itself and the positions before it. With block_size = 1 a causal model is autoregressive: position i "
        "reads token i - 1 (the mask token at position 0) and predicts token i, trained in one pass over the "
        "sequence and sampled one pass per token. With block_size = 0 it is the autoregressive model it was "
        "imported from (sampling refuses it until adapted).",
    )
    shift_logits: bool = Field(
        False, description="Position i's output predicts token i + 1, as the autoregressive model it came from (Dream)."
    )
    document_separator_id: int | None = Field(
        None,
        ge=0,
        description="Document-aware attention: the end-of-document token id (`dlm pack` writes one after every "
        "document; 0 for dlm's tokenizers). Set, a position of a packed row attends only to its own document in "
        'training and evaluation; unset, to the whole row. See the 0.11 lab notes, "Document-aware attention" '
        "(git show cece22c:docs/benchmarks.md).",
    )
    mask_logit: MaskLogit = Field(
        "plain",
        description="plain: the head scores the mask token like any other token (probability the reverse process "
        "never uses); subs: MDLM's SUBS parameterisation, the mask token's logit is -inf and an unmasked position "
        "predicts its own token (probability 1). Plain stays the default: subs scored 0.012 bits/byte worse at "
        'equal steps of configs/cpu.toml (0.11 lab notes, "SUBS parameterisation (`[model] mask_logit`)": '
        "git show cece22c:docs/benchmarks.md).",
    )

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return -(-(8 * self.d_model // 3) // 64) * 64

    @property
    def is_block_model(self) -> bool:
        """Whether attention is block-causal: a block_size shorter than the sequence."""

        return 0 < self.block_size < self.max_seq_len

    @property
    def is_autoregressive(self) -> bool:
        """Whether this is dlm's autoregressive model: causal attention, blocks of one token, inputs shifted by one."""

        return self.attention == "causal" and self.block_size == 1

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // self.pad_vocab_multiple) * self.pad_vocab_multiple

    @model_validator(mode="after")
    def check_rules(self) -> ModelConfig:
        _check_rules(self, MODEL_RULES)
        return self


class TrainingConfig(_Strict):
    """Data, optimisation, logging and checkpointing of one training run (the noise is `[diffusion]`)."""

    tokenizer: Path = Field(Path("tokenizer.json"), description="tokenizer.json written by `dlm tokenizer train`.")
    train_data: Path = Field(Path("data/train.bin"), description="Packed training tokens written by `dlm pack`.")
    val_data: Path | None = Field(None, description="Packed validation tokens; none disables validation.")
    output_dir: Path = Field(Path("runs/default"), description="Run directory: config, metrics and checkpoints.")
    init_from: Path | None = Field(
        None,
        description="Start from this trained model's weights (an export directory or a checkpoint) with a new "
        "optimizer and schedule; its tokenizer and model shape must match. A resume never re-applies it.",
    )
    attention_anneal_steps: int = Field(
        0,
        ge=0,
        description="Adapting a causal model: over this many first steps the attention opens from causal to "
        "bidirectional, each later key seen with probability step / N (DiffuLLaMA's anneal); 0 starts bidirectional.",
    )
    device: str = Field("auto", pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$", description="auto, cpu, mps, cuda or cuda:N.")
    precision: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Autocast dtype of training; auto = bfloat16 on CUDA when supported (else float16) and on a "
        "CPU that multiplies bfloat16 natively (AVX512-BF16 or AMX), float32 on other CPUs and on MPS.",
    )
    seed: int = Field(1337, ge=0, lt=2**63, description="Seed for weights, data order and diffusion noise.")
    optimizer: str = Field(
        "adamw", description=f"A registered optimizer (`dlm/config/optimizer_registry.py`): {describe_optimizers()}."
    )
    optimizer_embedding_32bit: bool = Field(
        True, description="adamw8bit: keep 32-bit optimizer state for the embedding and the output head, tied or not."
    )
    optimizer_min_8bit_size: int = Field(
        4096, ge=0, description="adamw8bit: tensors with fewer elements keep 32-bit state."
    )
    learning_rate: float = Field(3e-4, gt=0, le=1, description="Peak learning rate after warmup.")
    min_learning_rate: float = Field(3e-5, ge=0, le=1, description="Floor of the cosine decay.")
    warmup_steps: int = Field(100, ge=0, description="Linear warmup length in optimizer steps.")
    max_steps: int = Field(1000, ge=1, description="Total optimizer steps of the run.")
    decay_anchor_step: int = Field(
        0,
        ge=0,
        description="Set by a time budget's re-plan (`--minutes`), which moves max_steps: from this step on the "
        "cosine continues from decay_anchor_progress of its decay to the floor at max_steps, so the learning "
        "rate never jumps. 0: the plain cosine from the end of warmup.",
    )
    decay_anchor_progress: float = Field(
        0.0, ge=0, lt=1, description="The share of the cosine decay done at decay_anchor_step (see there)."
    )
    budget_minutes: float = Field(
        0,
        ge=0,
        description="`dlm train` trains within this many minutes of wall time, as `--minutes` does (which overrides "
        "it): max_steps, warmup and the intervals are planned from the pace measured on the machine. 0 trains "
        "max_steps as given.",
    )
    weight_decay: float = Field(0.1, ge=0, le=10, description="AdamW decay on weights with 2 or more dims.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, le=1e-2, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables clipping.")
    batch_size: int = Field(32, ge=1, description="Sequences per micro-batch (per process).")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    num_workers: int = Field(0, ge=0, le=64, description="DataLoader worker processes.")
    log_interval: int = Field(10, ge=1, description="Optimizer steps between training log events.")
    eval_interval: int = Field(100, ge=1, description="Optimizer steps between validations.")
    eval_batches: int = Field(8, ge=1, description="Validation batches, one fixed noise level each.")
    save_interval: int = Field(500, ge=1, description="Optimizer steps between checkpoints.")
    keep_last_checkpoints: int = Field(3, ge=0, description="Numbered checkpoints to keep; 0 keeps all.")
    save_inference_checkpoint: bool = Field(
        True, description="Also write a compact bf16 inference-latest.pt (single-file checkpoints only)."
    )
    checkpoint_format: Literal["auto", "single", "dcp"] = Field(
        "auto",
        description="single = one step-N.pt gathered on rank 0; dcp = a step-N/ directory of per-rank shards "
        "(torch.distributed.checkpoint), resumable on any world size; auto = dcp under FSDP with 2 or more "
        "processes or with async_checkpoint, else single.",
    )
    async_checkpoint: bool = Field(
        False,
        description="Write dcp checkpoints in the background while training goes on (at most one in flight; "
        "it completes before the process exits).",
    )
    require_fused_attention: bool = Field(
        False, description="Fail instead of falling back to the quadratic-memory math attention (CUDA)."
    )
    compile: bool | Literal["auto"] = Field(
        "auto", description="torch.compile the model; auto = on for CUDA, off on CPU / MPS."
    )
    compile_scope: Literal["blocks", "model"] = Field(
        "blocks",
        description="What one compiled graph covers: blocks = each transformer block (one graph reused by "
        "every layer, so compile time does not grow with depth) and the loss; model = the whole forward.",
    )
    attention_kernel: Literal["auto", "cudnn", "flash", "efficient"] = Field(
        "auto",
        description="CUDA attention kernel tried first; auto = torch's own order. Others stay as fallbacks.",
    )
    ema_decay: float | None = Field(
        None, gt=0, lt=1, description="Keep an exponential moving average of the weights (e.g. 0.999)."
    )
    parallelism: Literal["ddp", "fsdp"] = Field("ddp", description="Multi-process wrapping under torchrun.")
    clip_mask_min: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Smallest mask probability drawn in training, beta of BD3-LM's clipped schedule (lower gradient "
        "variance; same ELBO weights; linear schedule only; [0.3, 0.8] is configs/cpu.toml's measured winner). "
        "Evaluation covers [mask_eps, 1].",
    )
    clip_mask_max: float = Field(
        1.0, gt=0, le=1, description="Largest mask probability drawn in training, omega of the clipped schedule."
    )
    masking: ElboEstimator = Field(
        "bernoulli",
        description="How training masks a sequence: bernoulli draws a time t and masks each token with probability "
        "m(t), weight 1/t (MDLM); exact-count masks exactly l ~ U{1..n} of its n tokens, weight n/l (LLaDA's "
        "evaluator): the same ELBO, no noise from the masked count (stratified counts; no clipped range).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="`[training.lora]`, below.")

    @model_validator(mode="after")
    def _check_optimizer(self) -> TrainingConfig:
        # Checked here rather than by a Literal so that an optimizer registered at runtime is accepted.
        if self.optimizer not in registered_optimizers():
            raise FieldProblem(
                "optimizer",
                f"{self.optimizer!r} is not a registered optimizer",
                f"use one of: {', '.join(registered_optimizers())}",
            )
        return self

    @model_validator(mode="after")
    def check_rules(self) -> TrainingConfig:
        _check_rules(self, TRAINING_RULES)
        return self

    def resolved_checkpoint_format(self, world_size: int) -> Literal["single", "dcp"]:
        """What `checkpoint_format = "auto"` means for a run of `world_size` processes."""

        if self.checkpoint_format != "auto":
            return self.checkpoint_format
        sharded = self.parallelism == "fsdp" and world_size > 1
        return "dcp" if sharded or self.async_checkpoint else "single"


class DiffusionConfig(_Strict):
    """The masking (forward) process: its noise schedule and smallest time, for training, eval and sampling."""

    schedule: str = Field(
        DEFAULT_SCHEDULE,
        description=f"Noise schedule, a name registered in `dlm/diffusion/schedules.py`: {describe_schedules()}.",
    )
    mask_eps: float = Field(
        DEFAULT_MASK_EPS,
        gt=0,
        lt=1,
        description="Smallest diffusion time: training and evaluation draw t from [mask_eps, 1].",
    )

    @model_validator(mode="after")
    def _check_registered(self) -> DiffusionConfig:
        # Checked here rather than by a Literal so that a schedule registered at runtime is accepted.
        if self.schedule not in schedule_names():
            raise FieldProblem(
                "schedule",
                f"{self.schedule!r} is not a registered noise schedule",
                f"use one of: {', '.join(schedule_names())}",
            )
        return self


class LoggingConfig(_Strict):
    """Experiment trackers beside `metrics.jsonl` (`dlm/train/loggers.py`); none by default, so nothing is sent."""

    tensorboard: bool = Field(False, description="Write TensorBoard files in RUN/tensorboard (`dlm[tensorboard]`).")
    wandb: bool = Field(False, description="Log to Weights & Biases, its files in RUN/wandb (`dlm[wandb]`).")
    wandb_project: str = Field("dlm", min_length=1, description="The W&B project of the run.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline keeps the run on disk (upload it with `wandb sync`); online sends it."
    )
    run_name: str | None = Field(None, description="The run's name in the trackers; default the run directory's name.")


# Fields that moved to another section, old dotted name -> new: configs that use the old name keep
# loading (a run directory's config.json silently, a TOML file or --set with a `MovedFieldNote`).
MOVED_FIELDS = {"training.mask_eps": "diffusion.mask_eps"}


class MovedFieldNote(UserNote):
    """A config names a field by its old place; it is read from there, but should be moved."""


def _move_fields(data: dict[str, Any]) -> list[str]:
    """Move every field of `data` found under its old name to its new place; return the old names."""

    moved = []
    for old, new in MOVED_FIELDS.items():
        (old_section, old_field), (new_section, new_field) = old.split("."), new.split(".")
        source = data.get(old_section)
        if not isinstance(source, dict) or old_field not in source:
            continue
        target = data.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # validation names the malformed section
        if new_field in target:
            raise FieldProblem(old, f"is set as well as {new}", f"delete {old} and keep [{new_section}] {new_field}")
        target[new_field] = source.pop(old_field)
        moved.append(old)
    return moved


class ExperimentConfig(_Strict):
    """A complete experiment: the model, its diffusion process, how to train it and where to log it."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = Field(default_factory=DiffusionConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distill: DistillConfig | None = None  # a few-step distillation run (`dlm distill`)
    rl: RLConfig | None = None  # reinforcement learning with verifiable rewards (`dlm rl`)

    @model_validator(mode="before")
    @classmethod
    def _read_moved_fields(cls, data: Any) -> Any:
        # Checkpoints and run directories written before a field moved must still load and resume.
        if isinstance(data, dict):
            data = {name: dict(value) if isinstance(value, dict) else value for name, value in data.items()}
            _move_fields(data)
        return data

    @model_validator(mode="after")
    def check_rules(self) -> ExperimentConfig:
        _check_rules(self, EXPERIMENT_RULES)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def with_absolute_paths(self) -> ExperimentConfig:
        """A copy whose file paths no longer depend on the working directory (for run dirs)."""

        training = self.training
        updates: dict[str, Any] = {
            name: Path(getattr(training, name)).expanduser().resolve()
            for name in ("tokenizer", "train_data", "output_dir")
        }
        for name in ("val_data", "init_from"):
            if getattr(training, name) is not None:
                updates[name] = Path(getattr(training, name)).expanduser().resolve()
        copy: dict[str, BaseModel] = {"training": training.model_copy(update=updates)}
        if self.distill is not None:
            copy["distill"] = self.distill.model_copy(update={"teacher": self.distill.teacher.expanduser().resolve()})
        if self.rl is not None:
            paths = {"prompts": self.rl.prompts.expanduser().resolve()}
            if self.rl.heldout is not None:
                paths["heldout"] = self.rl.heldout.expanduser().resolve()
            copy["rl"] = self.rl.model_copy(update=paths)
        return self.model_copy(update=copy)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | Path = "<checkpoint>") -> ExperimentConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise UserError(format_validation_error(exc), path=source) from None


def format_validation_error(exc: ValidationError) -> str:
    """Every problem on one line: the dotted field path, what is wrong, and how to fix it.

    One line because a failed command prints exactly one `error:` line; several problems are
    numbered so that each one's fix stays attached to its field.
    """

    lines = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error["loc"])
        problem = (error.get("ctx") or {}).get("error")
        if isinstance(problem, FieldProblem):
            field = f"{location}.{problem.field}" if location else problem.field
            lines.append(f"{field}: {problem.problem}; fix: {problem.fix}")
            continue
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            fix = "remove it or check its spelling (`dlm config show` lists every field)"
            lines.append(f"{location}: unknown field; fix: {fix}")
            continue
        got = error.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{location}: {message}{shown}; fix: set {location} to a valid value")
    if len(lines) == 1:
        return f"invalid config: {lines[0]}"
    numbered = "; ".join(f"({number}) {line}" for number, line in enumerate(lines, 1))
    return f"invalid config, {len(lines)} problems: {numbered}"


def _field_allows_none(section: type[BaseModel], name: str) -> bool:
    annotation = section.model_fields[name].annotation
    return "None" in str(annotation)


def apply_overrides(data: dict[str, Any], overrides: list[str], source: str | Path) -> dict[str, Any]:
    """Apply `section.field=value` strings; pydantic later coerces each value to the field's type."""

    sections: dict[str, type[BaseModel]] = {
        "model": ModelConfig,
        "diffusion": DiffusionConfig,
        "training": TrainingConfig,
        "logging": LoggingConfig,
        "training.lora": LoraConfig,
        "distill": DistillConfig,
        "rl": RLConfig,
    }
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if key in MOVED_FIELDS:
            new = MOVED_FIELDS[key]
            warnings.warn(f"--set {key} has moved: use --set {new}={value.strip()}", MovedFieldNote, stacklevel=2)
            key = new
        section_name, dot, field = key.rpartition(".")  # training.lora.rank: the field of a nested section
        if not sep or not dot:
            raise UserError(
                f"override {item!r} is not of the form section.field=value",
                fix="for example --set training.learning_rate=1e-3",
            )
        section = sections.get(section_name)
        if section is None or field not in section.model_fields:
            raise UserError(
                f"override {item!r} names no config field",
                path=source,
                fix="`dlm config show CONFIG` lists every field",
            )
        value = value.strip()
        parsed: Any = value
        if value.lower() in ("none", "null") and _field_allows_none(section, field):
            parsed = None
        target = data
        for part in section_name.split("."):
            target = target.setdefault(part, {})
        target[field] = parsed
    return data


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise UserError("config file not found", path=path, fix="check the path passed to --config")
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"not valid TOML: {exc}", path=path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read config: {exc}", path=path) from None


def _read_moved_fields(data: Any, path: Path) -> None:
    """Move old field names of a config file to their new place (before any --set names the new one)."""

    try:
        moved = _move_fields(data) if isinstance(data, dict) else []
    except FieldProblem as exc:
        raise UserError(f"invalid config: {exc}", path=path) from None
    if path.suffix == ".json":
        return  # a run directory's config.json: dlm wrote it, and rewrites it when the run resumes
    for old in moved:
        section, field = MOVED_FIELDS[old].split(".")
        note = f"{path}: move {old} to [{section}] {field} (the old place is deprecated)"
        warnings.warn(note, MovedFieldNote, stacklevel=3)


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a TOML (or run-directory JSON) config, apply overrides and validate it."""

    path = Path(path)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError("config file not found", path=path) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"not valid JSON: {exc}", path=path) from None
    else:
        data = _read_toml(path)
    _read_moved_fields(data, path)
    data = apply_overrides(data, list(overrides or []), path)
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc), path=path) from None


def with_overrides(experiment: ExperimentConfig, overrides: list[str], source: str) -> ExperimentConfig:
    """A copy of `experiment` with `section.field=value` overrides, validated like a config file;
    `source` names where the overrides came from in an error (an option, the demo's plan)."""

    if not overrides:
        return experiment
    data = apply_overrides(experiment.to_dict(), overrides, source)
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise UserError(format_validation_error(exc), path=source) from None
