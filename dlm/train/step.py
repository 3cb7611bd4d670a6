"""One optimizer step of masked-diffusion training, shared by `dlm train` and `dlm bench`.

`TrainingStep` owns the model, optimizer, grad scaler and EMA, and runs gradient accumulation over
micro-batches. Noise is a pure function of (seed, global micro-batch index) and the diffusion times
of one optimizer step are stratified over all its micro-batches on all processes; the configured
noise schedule (`[diffusion]`) turns them into mask probabilities and loss weights. Metrics stay on
the device in a `LogWindow` until someone asks for them, so the step never waits on the host.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from dlm.config.schema import ExperimentConfig, ModelConfig, TrainingConfig
from dlm.diffusion.objective import (
    TokenLosses,
    accumulation_mask_probabilities,
    corrupt_tokens,
    diffusion_cross_entropy,
    draw_exact_count,
    masked_token_losses,
    noise_generator,
    split_batch,
    step_time_offset,
)
from dlm.diffusion.schedules import NOISE_BUCKETS, get_schedule
from dlm.model.attention import AttentionAnneal
from dlm.model.denoiser import block_size, masked_logits
from dlm.model.lora import add_adapters
from dlm.model.transformer import DiffusionTransformer
from dlm.runtime.device import autocast_context, resolve_compile
from dlm.runtime.kernels import attention_kernel_context
from dlm.runtime.rng import seed_everything
from dlm.train.distributed import DistributedContext, build_model, replicated, wrap_model
from dlm.train.optimizer import ModelEMA, build_optimizer, learning_rate


def model_from_weights(
    config: ModelConfig, weights: Mapping[str, Tensor], training: TrainingConfig, device: str = "cpu"
) -> DiffusionTransformer:
    """A model that takes `weights` as its parameters (on the CPU, as a freshly drawn model is), in
    float32, or for a LoRA run with a bfloat16 base its Linear weights (every matrix but the embedding,
    which is only indexed) in bfloat16, as the adapters will store them: no random draw, and no second
    copy where the stored dtype is already the one (`DiffusionTransformer.from_weights`). On `device`
    "meta", their shapes and dtypes alone (an FSDP rank that rank 0 sends the weights to)."""

    lora_base = training.lora.enabled and training.lora.base_dtype == "bfloat16"

    def dtype_of(name: str, tensor: Tensor) -> torch.dtype:
        linear = tensor.dim() == 2 and name != "token_embedding.weight"
        return torch.bfloat16 if lora_base and linear else torch.float32

    return DiffusionTransformer.from_weights(
        config, {name: tensor.to(device, dtype_of(name, tensor)) for name, tensor in weights.items()}
    )


@dataclass(frozen=True)
class OwnData:
    """The data of a step that brings its own instead of packed blocks (an RL run's prompts)."""

    sha256: dict[str, str | None]  # per split: what a resume checks, as packed data's metadata hash
    size: int  # the units of the training split (prompts), for the start event


@dataclass
class RunCounters:
    """Where the run stands; saved in every checkpoint."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0  # over all processes
    micro_batches_seen: int = 0  # over all processes


@dataclass
class LogWindow:
    """Metrics accumulated on the device between two log events (no host sync per step)."""

    device: torch.device
    loss: Tensor = field(init=False)
    accuracy: Tensor = field(init=False)
    grad_norm: Tensor = field(init=False)
    bucket_loss: Tensor = field(init=False)
    bucket_count: Tensor = field(init=False)
    first_bad_step: Tensor = field(init=False)
    steps: int = 0
    tokens: int = 0
    started: float = 0.0

    def __post_init__(self) -> None:
        self.first_bad_step = torch.full((), -1, device=self.device, dtype=torch.long)
        self.reset()

    def reset(self) -> None:
        zeros: dict[str, Any] = {"device": self.device, "dtype": torch.float32}
        self.loss, self.accuracy, self.grad_norm = (torch.zeros((), **zeros) for _ in range(3))
        self.bucket_loss = torch.zeros(NOISE_BUCKETS, **zeros)
        self.bucket_count = torch.zeros(NOISE_BUCKETS, **zeros)
        self.steps, self.tokens, self.started = 0, 0, time.perf_counter()


def attention_anneal(step: int, config: TrainingConfig) -> AttentionAnneal | None:
    """The attention of optimizer step `step` while `training.attention_anneal_steps` open it from
    causal to bidirectional (None after); its random keys are seeded by the run's seed and the step,
    so a resumed run sees the masks of an uninterrupted one."""

    if step >= config.attention_anneal_steps:
        return None
    return AttentionAnneal(step / config.attention_anneal_steps, (config.seed * 1_000_003 + step) % 2**63)


class TrainingStep:
    """Model, optimizer and the arithmetic of one optimizer step on one process."""

    def __init__(
        self,
        experiment: ExperimentConfig,
        device: torch.device,
        precision: str,
        world: DistributedContext,
        initial: Mapping[str, Tensor] | None = None,
    ):
        self.experiment, self.config = experiment, experiment.training
        self.device, self.precision, self.world = device, precision, world
        self.schedule = get_schedule(experiment.diffusion.schedule)
        self.counters = RunCounters()
        seed_everything(self.config.seed, device)
        # A run that starts from trained weights (`initial`, read from training.init_from) takes them as its
        # parameters at once instead of drawing random ones to overwrite (an 8B model's float32 draw alone
        # needs 32 GB of host memory). Under FSDP only rank 0 holds them whole; the others take their shapes.
        self._initial = initial
        # Under FSDP the model comes back sharded: the optimizer and the EMA must see the shards.
        self.model = build_model(self._new_model, device, world, self.config.parallelism)
        self._initial = None
        self.optimizer = build_optimizer(self.model, self.config, device)
        self.scaler = torch.amp.GradScaler("cuda", enabled=device.type == "cuda" and precision == "float16")
        self.ema = ModelEMA(self.model, self.config.ema_decay) if self.config.ema_decay else None
        self.step_model: nn.Module = self.model  # compiled / DDP-wrapped view, see `prepare`
        self.token_losses: TokenLosses = masked_token_losses
        model = experiment.model
        blocks = block_size(model)
        self.blocks_per_sequence = model.max_seq_len // blocks if blocks else 1

    def _new_model(self) -> DiffusionTransformer:
        """The model as seeded, or built from the initial weights; with `[training.lora]` its adapters are
        drawn right after the weights."""

        if self._initial is not None:
            sharded_here = self.world.active and self.config.parallelism == "fsdp" and not self.world.is_main
            device = "meta" if sharded_here else "cpu"  # rank 0 sends these ranks the weights
            model = model_from_weights(self.experiment.model, self._initial, self.config, device)
        else:
            model = DiffusionTransformer(self.experiment.model)
        if self.config.lora.enabled:
            add_adapters(model, self.config.lora)
        return model

    def own_data(self) -> OwnData | None:
        """None: the run trains on `training.train_data` (packed blocks). A workflow whose step makes its
        own batches (`dlm rl`'s rollouts) says what identifies them; the trainer then loads no blocks."""

        return None

    def log_events(self) -> list[Any]:
        """Events of the log window beside the `TrainEvent` (`dlm.artifacts.events`), e.g. an RL run's rollouts."""

        return []

    def validates_itself(self) -> bool:
        """Whether the step has a check of its own (an RL run's held-out prompts) in place of packed validation."""

        return False

    def validation_event(self) -> Any:
        """Run the step's own check (`validates_itself`) and return its event, at each eval_interval."""

        raise NotImplementedError("this step has no check of its own")

    def phase(self) -> str | None:
        """What the step trains, for the dashboard (`TrainEvent.phase`); None for diffusion training."""

        return None

    def prepare(self) -> None:
        """Compile and wrap the model for the step (once, after any checkpoint was loaded)."""

        scope = self.config.compile_scope if resolve_compile(self.config.compile, self.device) else None
        self.step_model = wrap_model(self.model, self.world, self.config.parallelism, scope)
        if scope is not None:
            # The number of masked tokens changes every step: after the first recompile the loss
            # graph is dynamic in it, so there is one recompilation in all, not one per step.
            self.token_losses = torch.compile(masked_token_losses)
        self.model.train()

    def micro_batch(
        self, clean: Tensor, micro_index: int, offset: float, window: LogWindow, loss_mask: Tensor | None = None
    ) -> None:
        """Forward and backward of one micro-batch; its noise depends only on its global index.
        A `loss_mask` (instruction data) leaves its prompt positions clean and unscored."""

        config, world, steps = self.config, self.world, self.config.gradient_accumulation_steps
        eps = self.experiment.diffusion.mask_eps
        low, high = config.clip_mask_min, config.clip_mask_max
        # Rank r's micro-batch m of this step is global micro-batch seen + m * W + r: the very batch
        # the sampler hands it, and the same count whatever world size earlier steps ran with.
        global_index = self.counters.micro_batches_seen + world.rank
        generator = noise_generator(config.seed, global_index, self.device)
        exact_count = config.masking == "exact-count"
        # Stratified over the step: times in [eps, 1] (the linear schedule's time is the mask
        # probability, hence the clipped range), or for exact-count the units in [0, 1) that pick l.
        times = accumulation_mask_probabilities(
            clean.shape[0],
            micro_index,
            steps,
            offset,
            0.0 if exact_count else max(eps, low),
            self.device,
            rank=world.rank,
            world_size=world.world_size,
            blocks=self.blocks_per_sequence,
            high=1.0 if exact_count else high,
        )
        model = self.experiment.model
        size = block_size(model)
        if exact_count:
            corruption = draw_exact_count(
                clean, model.mask_token_id, times, generator, block_size=size, loss_mask=loss_mask
            )
        else:
            corruption = corrupt_tokens(
                clean,
                model.mask_token_id,
                times,
                eps,
                generator,
                schedule=self.schedule,
                block_size=size,
                loss_mask=loss_mask,
            )
        kernel = attention_kernel_context(self.device, config.attention_kernel)
        with autocast_context(self.device, self.precision), kernel:
            logits = masked_logits(self.step_model, corruption.noisy_tokens, corruption.mask, clean, config=model)
        output = diffusion_cross_entropy(logits, clean, corruption, self.token_losses)
        self.scaler.scale(output.loss / steps).backward()

        window.loss += output.loss.detach() / steps
        window.accuracy += output.masked_accuracy.detach() / steps
        # Block models report the loss of each block at its own time.
        nll = output.per_sequence_nll if output.per_block_nll is None else output.per_block_nll
        bucket = (corruption.time.flatten() * NOISE_BUCKETS).long().clamp(max=NOISE_BUCKETS - 1)
        window.bucket_loss.index_add_(0, bucket, nll.detach().float().flatten())
        window.bucket_count.index_add_(0, bucket, torch.ones_like(corruption.time.flatten()))

    def optimizer_step(self, batches: Iterator[Tensor], window: LogWindow) -> None:
        config = self.config
        step = self.counters.step
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        if config.attention_anneal_steps:
            self.model.attention_anneal = attention_anneal(step, config)
        self.optimizer.zero_grad(set_to_none=True)
        offset = step_time_offset(config.seed, step)
        loss_before = window.loss.clone()
        for micro_index in range(config.gradient_accumulation_steps):
            clean, loss_mask = split_batch(next(batches))
            clean = clean.to(self.device, non_blocking=True)
            loss_mask = None if loss_mask is None else loss_mask.to(self.device, non_blocking=True)
            last = micro_index == config.gradient_accumulation_steps - 1
            with self.world.gradient_sync(self.step_model, enabled=last):
                self.micro_batch(clean, micro_index, offset, window, loss_mask)
            self.counters.micro_batches_seen += self.world.world_size
            self.counters.tokens_seen += clean.numel() * self.world.world_size
            window.tokens += clean.numel() * self.world.world_size
        grad_norm = self.apply_gradients(window, ~torch.isfinite(window.loss - loss_before))
        window.grad_norm += grad_norm.detach().float()
        window.steps += 1
        self.counters.step += 1

    def apply_gradients(self, window: LogWindow, bad: Tensor) -> Tensor:
        """Unscale, clip, step the optimizer, the scaler and the EMA; mark the window's first bad step when
        `bad` (a device bool: the step's loss was not finite) or the gradient norm says so. Returns the norm."""

        self.scaler.unscale_(self.optimizer)
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        grad_norm = replicated(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.ema is not None:
            self.ema.update(self.model)
        # float16 overflow is expected now and then (the scaler skips that step); elsewhere a
        # non-finite gradient norm means the run has diverged.
        if not self.scaler.is_enabled():
            bad = bad | ~torch.isfinite(grad_norm)
        step = self.counters.step
        window.first_bad_step.copy_(torch.where(bad & (window.first_bad_step < 0), step + 1, window.first_bad_step))
        return grad_norm
