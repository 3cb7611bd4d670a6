"""One optimizer step of distillation: `TrainingStep` with SDTT's or certainty forcing's objective.

Everything else of a training step is `dlm.train.step`'s: gradient accumulation, noise seeded by
(seed, global micro-batch index), clipping, the grad scaler, the EMA, the counters.

- `sdtt`: a micro-batch draws its times on the student's sampling grid (stratified over the
  optimizer step), masks the clean text at t, lets the teacher take its two steps from there
  (`dlm.diffusion.distillation`) and trains the student's one step toward them with the configured
  divergence.
- `certainty`: a micro-batch masks the clean text (the teacher's own samples, at best) at its
  stratified times and trains the student toward the text's tokens with the entropy term of
  certainty forcing; the teacher is not run.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from dlm.config.schema import ExperimentConfig
from dlm.data.tokenizer import load_tokenizer, never_sampled_ids, tokenizer_sha256
from dlm.diffusion.distillation import (
    TwoStepTimes,
    allowed_log_probs,
    certainty_forcing_loss,
    draw_tokens,
    first_reveals,
    grid_times,
    per_position,
    planned_masks,
    two_step_log_target,
)
from dlm.diffusion.divergences import get_divergence
from dlm.diffusion.objective import Corruption, accumulation_mask_probabilities, corrupt_tokens, noise_generator
from dlm.diffusion.schedules import NOISE_BUCKETS
from dlm.distill.teacher import RoundTeachers
from dlm.model.denoiser import block_size, masked_logits
from dlm.model.transformer import DiffusionTransformer
from dlm.runtime.device import autocast_context
from dlm.runtime.kernels import attention_kernel_context
from dlm.train.distributed import DistributedContext, build_model
from dlm.train.step import LogWindow, TrainingStep


@dataclass(frozen=True)
class StudentDivergence:
    """One micro-batch's comparison: the objective at each of the N positions masked at t."""

    per_token: Tensor  # [N]
    mask: Tensor  # [B, L] bool: the N positions masked at t
    log_student: Tensor  # [N, V]: the student's one-step log-probabilities
    targets: Tensor  # [N]: the token the target favours (the accuracy's reference)
    t: Tensor  # [B] or [B, blocks]: the times the rows (blocks) were masked at
    log_target: Tensor | None = None  # [N, V]: log of the teacher's two-step prediction (sdtt)


class DistillStep(TrainingStep):
    """The student (`model`, trained) and the round's teacher (frozen), one optimizer step at a time."""

    def __init__(
        self,
        experiment: ExperimentConfig,
        device: torch.device,
        precision: str,
        world: DistributedContext,
        initial: Mapping[str, Tensor] | None = None,
    ):
        super().__init__(experiment, device, precision, world, initial)
        assert experiment.distill is not None  # `dlm.distill.run` passes only distillation configs
        self.distill = experiment.distill
        self.divergence = get_divergence(self.distill.divergence)
        # The teacher takes its weights when its round begins (`RoundTeachers.ensure`): it is built
        # without drawing any, which costs no time, and leaves the global generator where it was.
        empty = functools.partial(DiffusionTransformer.empty, experiment.model)
        teacher = build_model(empty, device, world, self.config.parallelism)
        teacher.requires_grad_(False)
        self.teacher = teacher.eval()
        tokenizer = self.config.tokenizer
        self.teachers = RoundTeachers(
            teacher, self.distill, experiment.model, tokenizer_sha256(tokenizer), self.config.output_dir, world
        )
        model = experiment.model
        ids = [model.mask_token_id, *never_sampled_ids(load_tokenizer(tokenizer), model.vocab_size)]
        self.forbidden = torch.tensor(sorted(set(ids)), device=device)

    def phase(self) -> str:
        # The round of the last completed step: the one the logged figures belong to.
        round_index = self.teachers.round_of(max(self.counters.step - 1, 0))
        teacher, student = self.distill.round_steps(round_index)
        if not self.distill.halving:
            return (
                f"certainty forcing for threshold decoding; loss is the cross-entropy to the data plus "
                f"{self.distill.certainty_weight:g} x the entropy where the student is right"
            )
        return (
            f"round {round_index + 1}/{self.distill.rounds}: {teacher} -> {student} sampling steps; loss is the "
            f"{self.distill.divergence} divergence to the teacher's two steps"
        )

    def optimizer_step(self, batches: Iterator[Tensor], window: LogWindow) -> None:
        self.teachers.ensure(self.counters.step, self.model)
        super().optimizer_step(batches, window)

    def micro_batch(
        self, clean: Tensor, micro_index: int, offset: float, window: LogWindow, loss_mask: Tensor | None = None
    ) -> None:
        config, world = self.config, self.world
        steps = config.gradient_accumulation_steps
        generator = noise_generator(config.seed, self.counters.micro_batches_seen + world.rank, self.device)
        units = accumulation_mask_probabilities(
            clean.shape[0],
            micro_index,
            steps,
            offset,
            0.0,
            self.device,
            rank=world.rank,
            world_size=world.world_size,
            blocks=self.blocks_per_sequence,
        )
        if self.distill.halving:
            _, student_steps = self.distill.round_steps(self.teachers.round_of(self.counters.step))
            result = self.divergence_at(clean, grid_times(units, student_steps), generator, loss_mask)
        else:
            result = self.certainty_at(clean, units, generator, loss_mask)
        # No masked position (a batch of nothing but loss-masked prompts): a zero loss that still
        # reaches every parameter, so DDP's gradient reduction sees the same graph on every rank.
        per_token = result.per_token
        loss = per_token.mean() if per_token.numel() else result.log_student.sum() * 0.0
        self.scaler.scale(loss / steps).backward()

        window.loss += loss.detach() / steps
        agree = (result.log_student.argmax(dim=-1) == result.targets).float()
        window.accuracy += (agree.mean() if agree.numel() else agree.sum()).detach() / steps
        # The divergence by time: each kept position in the bucket of its own row's (block's) t.
        position_time = per_position(result.t, clean.shape[1], block_size(self.experiment.model))[result.mask]
        bucket = (position_time * NOISE_BUCKETS).long().clamp(max=NOISE_BUCKETS - 1)
        window.bucket_loss.index_add_(0, bucket, per_token.detach().float())
        window.bucket_count.index_add_(0, bucket, torch.ones_like(per_token, dtype=torch.float32))

    def divergence_at(
        self, clean: Tensor, times: TwoStepTimes, generator: torch.Generator, loss_mask: Tensor | None = None
    ) -> StudentDivergence:
        """The student's divergence from the teacher's two steps on `clean` masked at `times.t`, the mask and
        the teacher's first step drawn from `generator` (the micro-batch's; a test's fixed one)."""

        revealed = None
        if self.distill.remasking == "dilated":
            corruption, revealed = self._planned(clean, times, loss_mask)
        else:
            corruption = self._corrupt(clean, times.t, generator, loss_mask)
        mask = corruption.mask
        log_target = self.teacher_target(clean, corruption.noisy_tokens, mask, times, generator, revealed)
        log_student = self._student(corruption, clean)
        return StudentDivergence(
            self.divergence(log_target, log_student), mask, log_student, log_target.argmax(dim=-1), times.t, log_target
        )

    def certainty_at(
        self, clean: Tensor, times: Tensor, generator: torch.Generator, loss_mask: Tensor | None = None
    ) -> StudentDivergence:
        """Certainty forcing on `clean` masked at `times` [B] (or [B, blocks]), the mask drawn from `generator`."""

        corruption = self._corrupt(clean, times, generator, loss_mask)
        log_student = self._student(corruption, clean)
        targets = clean[corruption.mask]
        per_token = certainty_forcing_loss(log_student, targets, self.distill.certainty_weight)
        return StudentDivergence(per_token, corruption.mask, log_student, targets, times)

    def _corrupt(self, clean: Tensor, t: Tensor, generator: torch.Generator, loss_mask: Tensor | None) -> Corruption:
        """`clean` masked at the times `t` of its rows (blocks), as training masks it."""

        model = self.experiment.model
        return corrupt_tokens(
            clean,
            model.mask_token_id,
            t,
            self.experiment.diffusion.mask_eps,
            generator,
            schedule=self.schedule,
            block_size=block_size(model),
            loss_mask=loss_mask,
        )

    def _planned(self, clean: Tensor, times: TwoStepTimes, loss_mask: Tensor | None) -> tuple[Corruption, Tensor]:
        """`clean` masked where the dilated order has masks at `times.t`, and which of the masked positions
        the teacher's first step reveals [N]: no random draw, as the dilated sampler draws none. Positions
        outside `loss_mask` (a prompt) stay clean; the order still ranks them."""

        model = self.experiment.model
        _, student_steps = self.distill.round_steps(self.teachers.round_of(self.counters.step))
        planned = planned_masks(times, clean.shape[1], block_size(model), student_steps, self.schedule)
        mask, first = planned.masked, planned.first
        if loss_mask is not None:
            mask, first = mask & loss_mask, first & loss_mask
        t = times.t.float()
        corruption = Corruption(
            noisy_tokens=clean.masked_fill(mask, model.mask_token_id),
            mask=mask,
            time=t,
            mask_probability=self.schedule.mask_probability(t),
            mask_rate=self.schedule.mask_rate(t),
            loss_mask=loss_mask,
            block_size=block_size(model),
        )
        return corruption, first[mask]

    def _student(self, corruption: Corruption, clean: Tensor) -> Tensor:
        """The student's log-probabilities [N, V] at the masked positions (forbidden tokens at probability 0)."""

        kernel = attention_kernel_context(self.device, self.config.attention_kernel)
        with autocast_context(self.device, self.precision), kernel:
            logits = masked_logits(
                self.step_model, corruption.noisy_tokens, corruption.mask, clean, config=self.experiment.model
            )
        return allowed_log_probs(logits, self.forbidden)

    @torch.no_grad()
    def teacher_target(
        self,
        clean: Tensor,
        noisy: Tensor,
        mask: Tensor,
        times: TwoStepTimes,
        generator: torch.Generator,
        revealed: Tensor | None = None,
    ) -> Tensor:
        """The log of the teacher's two-step prediction [N, V] at the N positions of `mask` (`noisy` is
        `clean` masked there at `times.t`), its first step's tokens drawn from `generator`, and its reveals
        too unless `revealed` [N] plans them (the dilated order)."""

        size, length = block_size(self.experiment.model), clean.shape[1]
        if revealed is None:
            revealed = first_reveals(
                per_position(times.first_reveal_probability(self.schedule), length, size)[mask], generator
            )
        with autocast_context(self.device, self.precision):
            first_logits = masked_logits(self.teacher, noisy, mask, clean)
        middle = noisy.clone()
        middle[mask] = noisy[mask].masked_scatter(
            revealed, draw_tokens(first_logits[revealed], self.forbidden, generator)
        )
        still_masked = mask.clone()
        still_masked[mask] = ~revealed
        with autocast_context(self.device, self.precision):
            second_logits = masked_logits(self.teacher, middle, still_masked, clean)
        first = allowed_log_probs(first_logits, self.forbidden)
        return two_step_log_target(first, allowed_log_probs(second_logits, self.forbidden), revealed)
