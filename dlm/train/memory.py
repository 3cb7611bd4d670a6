"""How much memory a training run needs, estimated from its config before any tensor exists.

`dlm train` compares the estimate with the device's free memory before it builds the model or
writes a file: a model far too large would otherwise fail only once allocation does, after the run
directory was created. `dlm validate` reports the same figures as a check.

The estimate is per process, in bytes:

- weights: 4 per parameter (float32 master weights; autocast computes in bf16 / fp16 without a
  second resident copy); a LoRA run's frozen Linear weights 2 with `base_dtype = "bfloat16"`,
- gradients: 4 per trained parameter,
- optimizer state: as its registry entry counts it for the trained parameters (`OptimizerSpec.state_bytes`
  in `dlm/config/optimizer_registry.py`; AdamW's two float32 moments are 8 per parameter),
- EMA: a float32 copy of the trained weights (4 per parameter) when `ema_decay` is set,
- activations: what one micro-batch saves for its backward pass (see `activation_bytes`),
- weight copies: under bfloat16 / float16 autocast, the compute-dtype copy of each float32 matmul
  weight that the backward pass keeps (see `weight_copy_bytes`).

Every parameter trains, except in a LoRA run (`[training.lora]`): there the frozen base needs its
weights alone, and the adapters are the trained parameters. A LoRA run's parameters are counted on
a model built on the meta device with its adapters injected (shapes and dtypes, no storage), so the
figure is the one peft will allocate, whatever the model's shape.

The first four, the model state, exist whatever the batch or the kernels; under FSDP they are
sharded over the processes. Only the model state decides a refusal: it is a lower bound, so a run
refused by it could never have fitted. The activation figure is an approximation (kernels, compile
and the allocator move it), so it is reported, never a reason to refuse.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dlm.config.optimizer_registry import optimizer_spec
from dlm.config.schema import ExperimentConfig, ModelConfig, TrainingConfig
from dlm.config.shapes import count_parameters, format_parameter_count, parameter_shapes
from dlm.fileio import GIB, format_bytes
from dlm.model.denoiser import block_size, pass_copies
from dlm.model.lora import add_adapters
from dlm.model.transformer import DiffusionTransformer

_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ParameterEntry:
    """One parameter of the model a run trains: its elements, bytes per element, and whether it trains."""

    name: str
    size: int
    element_bytes: int
    trainable: bool
    matrix: bool = True  # 2 or more dims: a matmul weight (the embedding is the head's too)


def parameter_entries(model: ModelConfig, training: TrainingConfig) -> list[ParameterEntry]:
    """Every parameter of the run's model. A LoRA run's come from the model built on the meta device
    with its adapters (which also checks `target_modules`); the others from `parameter_shapes`."""

    if not training.lora.enabled:
        return [
            ParameterEntry(name, math.prod(shape), 4, True, len(shape) >= 2) for name, shape in parameter_shapes(model)
        ]

    with torch.device("meta"):
        network = add_adapters(DiffusionTransformer(model), training.lora)
    return [
        ParameterEntry(name, parameter.numel(), parameter.element_size(), parameter.requires_grad, parameter.ndim >= 2)
        for name, parameter in network.named_parameters()
    ]


def trainable_parameter_count(model: ModelConfig, training: TrainingConfig) -> int:
    return sum(entry.size for entry in parameter_entries(model, training) if entry.trainable)


def optimizer_state_bytes(
    model: ModelConfig, training: TrainingConfig, entries: list[ParameterEntry] | None = None
) -> int | None:
    """Bytes of optimizer state for the trained parameters of `model` (before any sharding); None when
    the optimizer's registry entry does not say (`OptimizerSpec.state_bytes`)."""

    state_bytes = optimizer_spec(training.optimizer).state_bytes
    if state_bytes is None:
        return None
    entries = parameter_entries(model, training) if entries is None else entries
    return state_bytes([(entry.name, entry.size) for entry in entries if entry.trainable], training)


def activation_bytes(model: ModelConfig, training: TrainingConfig, precision: str) -> int:
    """Approximate bytes one training micro-batch keeps for its backward pass.

    Per token and block, with `a` bytes per element of the compute dtype, d = d_model and
    f = the SwiGLU width: the float32 residual stream at both sublayer inputs and the float32
    rotary intermediates of q and k (16d), and in the compute dtype the two norm outputs, q, k, v,
    the rotated q and k, the attention output (8d) and the gate / up output, the gate activation
    and their product (4f): a(8d + 4f) + 16d. With activation checkpointing a block keeps only its
    float32 input (4d), and one block's full set exists while it is recomputed. The head adds, for
    masked tokens, the logits and their float32 copy and log-softmax (a + 8 per vocabulary entry):
    memory peaks at the micro-batch with the most, `peak_masked_share` of its tokens. A fused
    attention kernel is assumed: the math fallback also keeps batch x heads x L x L scores per block.
    A block diffusion model's transformer blocks run over 2L tokens (the noisy and the clean copy),
    so their share doubles; the head sees the noisy copy only.
    """

    a = 4 if precision == "float32" else 2
    d, ffn = model.d_model, model.ffn_size
    tokens = training.batch_size * model.max_seq_len
    full_block = a * (8 * d + 4 * ffn) + 16 * d
    # Checkpointed: every block's float32 input, plus the block being recomputed.
    blocks = model.n_layers * 4 * d + full_block if model.activation_checkpointing else model.n_layers * full_block
    copies = pass_copies(model)
    head = (a + 8) * model.padded_vocab_size * peak_masked_share(model, training)
    return int(tokens * (copies * blocks + head))


def peak_masked_share(model: ModelConfig, training: TrainingConfig) -> float:
    """The largest share of a micro-batch's tokens the head scores, on average, in one process.

    An autoregressive model scores every token. A whole-sequence model's step stratifies its mask
    probabilities over all its micro-batches (`dlm.diffusion.objective.accumulation_mask_probabilities`),
    each taking a consecutive 1 / A of the noise range: the highest takes the top, 1 - 1 / (2A) masked on
    average (a half with A = 1). Under DDP or FSDP the range splits over the processes too, so the highest
    lies closer still to 1; the estimate is per process and counts one. A block model gives each
    sequence's blocks times spread over the whole range: a half in every micro-batch."""

    if getattr(model, "is_autoregressive", False):
        return 1.0
    if block_size(model) and model.max_seq_len > block_size(model):
        return 0.5
    return 1.0 - 1.0 / (2 * training.gradient_accumulation_steps)


def weight_copy_bytes(entries: list[ParameterEntry], model: ModelConfig, precision: str) -> int:
    """Bytes of the compute-dtype copies autocast makes of float32 matmul weights, which the backward
    pass keeps (it needs them for the input's gradient, frozen or not): every block's, or with activation
    checkpointing one block's at a time, plus the head's (the embedding when tied; an untied embedding is
    only indexed, never a matmul weight). None in float32, and none for weights stored in the compute
    dtype already (a LoRA run's bfloat16 base)."""

    if precision == "float32":
        return 0
    indexed_only = set() if model.tie_embeddings else {"token_embedding.weight"}
    cast = [entry for entry in entries if entry.matrix and entry.element_bytes == 4 and entry.name not in indexed_only]
    in_blocks = sum(entry.size for entry in cast if entry.name.startswith("blocks."))
    outside = sum(entry.size for entry in cast) - in_blocks
    if model.activation_checkpointing:
        in_blocks //= model.n_layers
    return 2 * (in_blocks + outside)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one training process needs, by kind (see the module docstring)."""

    parameters: int
    optimizer: str
    weights: int
    gradients: int
    optimizer_state: int
    ema: int
    activations: int
    optimizer_state_estimated: bool = True  # False: the optimizer's state size is unknown, counted as 0
    trainable: int | None = None  # trained parameters when fewer than all (a LoRA run's adapters)
    weight_copies: int = 0  # autocast's compute-dtype copies of float32 matmul weights (`weight_copy_bytes`)
    teacher: int = 0  # a distillation run's frozen teacher (`[distill]`), a second copy of the weights

    @property
    def model_state(self) -> int:
        """Weights, gradients, optimizer state, EMA and any teacher: the part no batch size or kernel changes."""

        return self.weights + self.gradients + self.optimizer_state + self.ema + self.teacher

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.weight_copies

    def breakdown(self) -> str:
        parts = [
            f"weights {format_bytes(self.weights)}",
            f"gradients {format_bytes(self.gradients)}",
            f"{self.optimizer} state "
            + (format_bytes(self.optimizer_state) if self.optimizer_state_estimated else "not estimated"),
        ]
        if self.ema:
            parts.append(f"EMA {format_bytes(self.ema)}")
        if self.teacher:
            parts.append(f"teacher {format_bytes(self.teacher)}")
        counted = f"{format_parameter_count(self.parameters)} parameters"
        if self.trainable is not None:
            counted += f" ({format_parameter_count(self.trainable)} trained, {self.trainable_share:.2%})"
        return f"{counted}: " + " + ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "model_state": self.model_state, "total": self.total}

    @property
    def trainable_share(self) -> float:
        return (self.parameters if self.trainable is None else self.trainable) / self.parameters


def estimate_training_memory(experiment: ExperimentConfig, precision: str, shards: int = 1) -> MemoryEstimate:
    """The memory of one training process; `shards` processes split the model state (FSDP)."""

    model, training = experiment.model, experiment.training
    entries = parameter_entries(model, training)
    parameters = sum(entry.size for entry in entries)
    trainable = sum(entry.size for entry in entries if entry.trainable)
    state = optimizer_state_bytes(model, training, entries)

    def per_shard(total: int) -> int:
        return -(-total // shards)

    weights = per_shard(sum(entry.size * entry.element_bytes for entry in entries))
    return MemoryEstimate(
        parameters=parameters,
        optimizer=training.optimizer,
        weights=weights,
        gradients=per_shard(4 * trainable),
        optimizer_state=per_shard(state or 0),
        ema=per_shard(4 * trainable) if training.ema_decay else 0,
        activations=activation_bytes(model, training, precision),
        optimizer_state_estimated=state is not None,
        trainable=trainable if trainable < parameters else None,
        weight_copies=weight_copy_bytes(entries, model, precision),
        teacher=weights if experiment.distill is not None else 0,  # its activations: no gradients, fewer
    )


@dataclass(frozen=True)
class AvailableMemory:
    """Bytes a new allocation can still get, and where the figure comes from."""

    bytes: int
    source: str


def available_memory(device: torch.device) -> AvailableMemory | None:
    """Free memory of `device` now; None where it cannot be told."""

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return AvailableMemory(int(free), f"free on {device}")
    if device.type == "mps":
        if not hasattr(torch.mps, "recommended_max_memory"):
            return None
        free = torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
        return AvailableMemory(max(0, int(free)), "available to mps")
    return available_ram()


def available_ram() -> AvailableMemory | None:
    """MemAvailable (or the OS's free pages), lowered to the headroom of a cgroup memory limit."""

    found = _meminfo_available()
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            return None
    headroom = _cgroup_headroom()
    if headroom is not None and headroom < found:
        return AvailableMemory(headroom, "left under the cgroup memory limit")
    return AvailableMemory(found, "of RAM available")


def _meminfo_available() -> int | None:
    try:
        text = _MEMINFO.read_text(encoding="ascii")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    return None


def _cgroup_headroom() -> int | None:
    # cgroup v2: a container's limit is invisible in /proc/meminfo, yet exceeding it kills the run.
    try:
        limit = (_CGROUP / "memory.max").read_text(encoding="ascii").strip()
        used = int((_CGROUP / "memory.current").read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(0, int(limit) - used)


@dataclass(frozen=True)
class MemoryVerdict:
    """Whether a run can fit, what the estimate found, and the fix when it cannot."""

    fits: bool
    detail: str
    fix: str = ""


def check_training_memory(
    experiment: ExperimentConfig,
    device: torch.device,
    precision: str,
    shards: int = 1,
    available: AvailableMemory | None = None,
) -> MemoryVerdict:
    """Compare the estimate with the free memory of `device` (or with `available`, a device planned
    for: `device_capacity`); only the model state can refuse."""

    estimate = estimate_training_memory(experiment, precision, shards)
    available = available if available is not None else available_memory(device)
    activations = f"~{format_bytes(estimate.activations)} of activations per micro-batch"
    if estimate.weight_copies:
        activations += f" and {format_bytes(estimate.weight_copies)} of {precision} weight copies"
    if available is None:
        return MemoryVerdict(
            True,
            f"needs ~{format_bytes(estimate.total)} ({estimate.breakdown()}; {activations}); "
            f"the free memory of {device} is unknown, not compared",
        )
    if estimate.model_state > available.bytes:
        return MemoryVerdict(
            False,
            f"the run needs at least {format_bytes(estimate.model_state)} for the model state "
            f"({estimate.breakdown()}) plus {activations}, but only {format_bytes(available.bytes)} "
            f"{available.source}",
            _model_state_fix(experiment, device),
        )
    detail = (
        f"needs ~{format_bytes(estimate.total)} ({estimate.breakdown()}; {activations}), "
        f"{format_bytes(available.bytes)} {available.source}"
    )
    if estimate.total <= available.bytes:
        return MemoryVerdict(True, detail)
    return MemoryVerdict(True, f"{detail}; the activations may not fit", _activation_fix(experiment))


def _model_state_fix(experiment: ExperimentConfig, device: torch.device) -> str:
    training = experiment.training
    fixes = ["use a smaller model (model.d_model, model.n_layers)"]
    lora = training.lora
    if not lora.enabled and training.init_from is not None:
        fixes.append("train LoRA adapters on it instead of every weight ([training.lora] rank = 16)")
    if lora.enabled and lora.base_dtype == "float32":
        fixes.append('store the frozen weights in bfloat16 (training.lora.base_dtype and precision "bfloat16")')
    if training.optimizer == "adamw":
        fixes.append('set training.optimizer = "adamw8bit" (2 bytes of state per parameter instead of 8)')
    if training.ema_decay:
        fixes.append("set training.ema_decay = none")
    if device.type == "cuda" or training.parallelism == "fsdp":
        fixes.append('run more processes under torchrun with training.parallelism = "fsdp" (it shards the model state)')
    return "; or ".join(fixes) + "; training.batch_size and model.activation_checkpointing shrink only the activations"


def _activation_fix(experiment: ExperimentConfig) -> str:
    fix = "lower training.batch_size (raise gradient_accumulation_steps to keep the batch)"
    if not experiment.model.activation_checkpointing:
        fix += " or set model.activation_checkpointing = true"
    return fix


# ---------------------------------------------------------------------------------------------
# Checkpoints: size on disk and host memory during a save, for either format
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointEstimate:
    """One save of a run: bytes on disk, written per rank, and rank 0's extra host memory."""

    format: str  # "single" | "dcp" | "dcp async"
    world_size: int
    total_bytes: int  # the whole checkpoint on disk
    bytes_per_rank: int  # what the busiest rank writes
    rank0_host_bytes: int  # host memory rank 0 holds beyond training's own during a save

    def describe(self) -> str:
        writers = "rank 0 writes it all" if self.format == "single" else f"{format_bytes(self.bytes_per_rank)} per rank"
        return (
            f"{self.format}: {format_bytes(self.total_bytes)} ({writers}), "
            f"rank 0 holds {format_bytes(self.rank0_host_bytes)} more host memory while saving"
        )


def checkpoint_state_bytes(experiment: ExperimentConfig) -> int:
    """Bytes of one checkpoint's tensors: float32 weights, optimizer state and EMA (RNG is noise)."""

    parameters = count_parameters(experiment.model)
    state = optimizer_state_bytes(experiment.model, experiment.training) or 0
    return 4 * parameters + state + (4 * parameters if experiment.training.ema_decay else 0)


def estimate_checkpoints(experiment: ExperimentConfig, world_size: int) -> list[CheckpointEstimate]:
    """Both formats (and async DCP) for a run of `world_size` processes.

    single: under FSDP on 2+ processes the full state is gathered into rank 0's CPU memory first;
    otherwise rank 0 serialises its own tensors in place (about nothing extra on the CPU, one
    tensor at a time from a GPU). dcp: every rank writes its 1 / world_size share (DCP spreads
    replicated DDP tensors over the ranks too) straight from its tensors; async first copies that
    share into CPU memory so training can go on.
    """

    total = checkpoint_state_bytes(experiment)
    gathered = experiment.training.parallelism == "fsdp" and world_size > 1
    share = -(-total // world_size)
    return [
        CheckpointEstimate("single", world_size, total, total, total if gathered else 0),
        CheckpointEstimate("dcp", world_size, total, share, 0),
        CheckpointEstimate("dcp async", world_size, total, share, share),
    ]


def device_capacity(gib: float) -> AvailableMemory:
    """A device of `gib` GiB, all of it free: what a run planned for another machine is compared with."""

    return AvailableMemory(int(gib * GIB), f"on a {gib:g} GiB device")


@dataclass(frozen=True)
class MemoryPlan:
    """The estimate of a config on a GPU it is planned for, from the config alone (no weights, no data)."""

    estimate: MemoryEstimate
    precision: str
    device_memory_gib: float | None
    verdict: MemoryVerdict | None

    @property
    def fits(self) -> bool | None:
        """Whether everything estimated fits the planned device; None when none was given."""

        if self.device_memory_gib is None:
            return None
        return self.estimate.total <= device_capacity(self.device_memory_gib).bytes

    def to_dict(self) -> dict[str, Any]:
        verdict = None if self.verdict is None else asdict(self.verdict)
        return {
            "precision": self.precision,
            "device_memory_gib": self.device_memory_gib,
            "fits": self.fits,
            "estimate": self.estimate.to_dict(),
            "verdict": verdict,
        }


def plan_memory(experiment: ExperimentConfig, device_memory_gib: float | None = None) -> MemoryPlan:
    """The memory of one training process of `experiment` on a CUDA device of `device_memory_gib` GiB.
    Precision `auto` is counted as bfloat16, what it resolves to on a current GPU."""

    precision = experiment.training.precision
    precision = "bfloat16" if precision == "auto" else precision
    estimate = estimate_training_memory(experiment, precision)
    verdict = None
    if device_memory_gib is not None:
        capacity = device_capacity(device_memory_gib)
        verdict = check_training_memory(experiment, torch.device("cuda"), precision, available=capacity)
    return MemoryPlan(estimate, precision, device_memory_gib, verdict)
