"""One RL step of `dlm rl`: rollouts, rewards, group advantages, then GRPO's inner updates.

The step is a `TrainingStep` (`dlm.train.step`) whose batches it makes itself: the trainer around it
keeps the run directory, checkpoints, exact resume, DDP, signals, budgets and dashboards. Step s
samples the prompts `step_prompts(s)` (a pure function of the seed and s), each with its own
rollout stream (`dlm.rl.rollouts`), so a resumed run repeats an uninterrupted one bit for bit.
Each inner update u draws each row's likelihood-estimate masks from a generator seeded by (seed, s,
u, the row's place in the step), the same draws that scored the rollout policy before the first
update: the ratio compares the two policies on the same masked inputs, and neither the micro-batch
size nor the number of processes changes what a row draws.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from dlm.artifacts.events import HeldoutEvent, RolloutEvent
from dlm.artifacts.sharded_checkpoint import file_sha256
from dlm.config.schema import ExperimentConfig
from dlm.data.tokenizer import load_tokenizer, never_sampled_ids, tokenizer_sha256
from dlm.diffusion.objective import noise_generator, noise_seed
from dlm.diffusion.policy_likelihood import EntryScores, get_estimator, score_draws
from dlm.errors import UserError
from dlm.model.denoiser import block_size
from dlm.model.lora import adapters_disabled
from dlm.rl.evaluation import evaluate_prompts
from dlm.rl.objective import clipped_policy_loss, group_advantages
from dlm.rl.prompts import completion_length, read_prompts
from dlm.rl.rewards import bind_rewards, check_records, score
from dlm.rl.rollouts import Rollouts, rollout_seed, sample_rollouts
from dlm.runtime.device import autocast_context
from dlm.train.distributed import DistributedContext
from dlm.train.init_from import initial_weights
from dlm.train.optimizer import learning_rate
from dlm.train.step import LogWindow, OwnData, TrainingStep, model_from_weights

PROMPT_ORDER_TAG, DRAW_TAG, HELDOUT_TAG = 0x5052, 0x4452, 0x484F


class RLStep(TrainingStep):
    """The policy (`model`, trained), its prompts and rewards, one RL step at a time."""

    def __init__(
        self,
        experiment: ExperimentConfig,
        device: torch.device,
        precision: str,
        world: DistributedContext,
        initial: Mapping[str, Tensor] | None = None,
    ):
        super().__init__(experiment, device, precision, world, initial)
        assert experiment.rl is not None  # `dlm.rl.run` passes only RL configs
        self.rl = rl = experiment.rl
        tokenizer_path = self.config.tokenizer
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.prompts = read_prompts(rl.prompts, self.tokenizer, tokenizer_path)
        self.heldout = (
            None if rl.heldout is None else read_prompts(rl.heldout, self.tokenizer, tokenizer_path, rl.heldout_prompts)
        )
        self.rewards = bind_rewards(rl.rewards)
        for prompt_set in (self.prompts, self.heldout):
            if prompt_set is not None:
                check_records(self.rewards, prompt_set.records, str(prompt_set.path))
        model = experiment.model
        self.length = completion_length(
            self.prompts, model.max_seq_len, rl.completion_length, slides=bool(block_size(model))
        )
        self.estimator = get_estimator(rl.estimator)
        self._check_layout()
        ids = [model.mask_token_id, *never_sampled_ids(self.tokenizer, model.vocab_size)]
        self.forbidden = torch.tensor(sorted(set(ids)), device=device)
        self.reference: torch.nn.Module | None = None  # built on first use (kl_weight > 0, no LoRA)
        self._stats: list[dict[str, float]] = []  # per step since the last log: the rollouts' figures
        self._update_stats: list[Tensor] = []  # per step since the last log: [kl, clipped, variance] on the device
        self._sample = ""

    def _check_layout(self) -> None:
        model, world, rl = self.experiment.model, self.world, self.rl
        if rl.prompts_per_step % world.world_size:
            raise UserError(
                f"rl.prompts_per_step {rl.prompts_per_step} does not split over {world.world_size} processes",
                fix=f"use a multiple of {world.world_size}",
            )
        if self.estimator.needs_token_blocks and not (block_size(model) == 1 or model.is_autoregressive):
            raise UserError(
                f"rl.estimator = {rl.estimator!r} is exact only for a model whose blocks are one token",
                fix="use coupled, one-step or elbo for this model",
            )

    # ----------------------------------------------------------------------------- data
    def own_data(self) -> OwnData:
        return OwnData(
            {
                "train": file_sha256(self.prompts.path),
                "val": None if self.heldout is None else file_sha256(self.heldout.path),
            },
            len(self.prompts),
        )

    def step_prompts(self, step: int) -> tuple[list[int], list[int]]:
        """(positions, prompt indices) of this process's prompts of RL step `step`: a seeded draw without
        replacement over the whole step (position p is the p-th prompt of the step), split evenly across
        the processes."""

        generator = torch.Generator().manual_seed(noise_seed(self.config.seed, step, PROMPT_ORDER_TAG))
        count = self.rl.prompts_per_step
        chosen = torch.randperm(len(self.prompts), generator=generator)[:count]
        if len(chosen) < count:  # fewer prompts than a step asks for: cycle through them
            chosen = chosen.repeat(-(-count // len(chosen)))[:count]
        positions = list(range(count))[self.world.rank :: self.world.world_size]
        return positions, [int(chosen[position]) for position in positions]

    def sampling_options(self) -> dict[str, Any]:
        rl = self.rl
        return {
            "steps": rl.sampling_steps,
            "temperature": rl.temperature,
            "top_p": rl.top_p,
            "remasking": rl.remasking,
            "block_length": rl.block_length,
        }

    def rollouts(self, step: int) -> Rollouts:
        positions, indices = self.step_prompts(step)
        # Seeded by the step and the prompt: the same rollouts on any number of processes.
        seeds = [rollout_seed(self.config.seed, step, position) for position in positions]
        return sample_rollouts(
            self.model,
            self.tokenizer,
            self.prompts,
            indices,
            group_size=self.rl.group_size,
            length=self.length,
            seeds=seeds,
            options=self.sampling_options(),
            positions=positions,
        )

    def rewards_of(self, rollouts: Rollouts) -> tuple[Tensor, Tensor]:
        """(total reward, whether correct) of each rollout [R]; one error naming the prompt if a reward fails."""

        totals, correct = [], []
        for row, completion in enumerate(rollouts.replies):
            index = rollouts.prompt_indices[row // rollouts.group_size]
            where = f"prompt {index + 1} of {self.prompts.path}"
            values = score(self.rewards, completion, self.prompts.records[index], where)
            totals.append(sum(value * reward.weight for value, reward in zip(values, self.rewards, strict=True)))
            correct.append(values[0] > 0)
        return torch.tensor(totals, dtype=torch.float32), torch.tensor(correct, dtype=torch.float32)

    # ----------------------------------------------------------------------------- scoring
    def _chunks(self, rows: int) -> list[slice]:
        size = self.config.batch_size
        return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]

    def _draws(self, rollouts: Rollouts, chunk: slice, step: int, update: int) -> list[Any]:
        """The estimator's draws for the rows of `chunk`, each row's from a generator seeded by (seed, step,
        update, its place in the step): the same masks whatever the micro-batch or the process."""

        group = rollouts.group_size
        generators = [
            noise_generator(
                self.config.seed,
                noise_seed(step, update, rollouts.positions[row // group] * group + row % group, DRAW_TAG),
                self.device,
            )
            for row in range(chunk.start, chunk.stop)
        ]
        return self.estimator.draw(
            rollouts.tokens[chunk],
            rollouts.prompt[chunk],
            rollouts.completion[chunk],
            self.experiment.model.mask_token_id,
            generators,
            samples=self.rl.estimator_samples,
            prompt_mask_probability=self.rl.prompt_mask_probability,
        )

    def _scores(self, model: Any, rollouts: Rollouts, chunk: slice, draws: list[Any]) -> EntryScores:
        pad = rollouts.pad[chunk]
        padded = bool(pad.any())
        tokens = rollouts.tokens[chunk]
        config = self.experiment.model

        def logits_of(noisy: Tensor, scored: Tensor) -> Tensor:
            keywords: dict[str, Any] = {"pad": pad} if padded else {}
            if block_size(config):
                keywords["clean_tokens"] = tokens
            with autocast_context(self.device, self.precision):
                return model(noisy, output_positions=scored, **keywords)

        return score_draws(logits_of, tokens, draws, self.forbidden, self.rl.temperature)

    @torch.no_grad()
    def _fixed_scores(self, model: Any, rollouts: Rollouts, step: int) -> list[list[EntryScores]]:
        """Scores [update][chunk] of `model` on every inner update's draws, before any update."""

        return [
            [
                self._scores(model, rollouts, chunk, self._draws(rollouts, chunk, step, update))
                for chunk in self._chunks(rollouts.tokens.shape[0])
            ]
            for update in range(self.rl.inner_updates)
        ]

    def _reference_scores(self, rollouts: Rollouts, step: int) -> list[list[EntryScores]] | None:
        if self.rl.kl_weight <= 0:
            return None
        if self.config.lora.enabled:
            with adapters_disabled(self.model):
                return self._fixed_scores(self.step_model, rollouts, step)
        if self.reference is None:
            self.reference = self._load_reference()
        return self._fixed_scores(self.reference, rollouts, step)

    def _load_reference(self) -> torch.nn.Module:
        """The starting policy, frozen: `training.init_from` read again (a resumed run's model has moved on)."""

        assert self.config.init_from is not None  # `dlm.rl.run` requires it
        weights = initial_weights(self.config.init_from, self.experiment.model, tokenizer_sha256(self.config.tokenizer))
        reference = model_from_weights(self.experiment.model, weights, self.config).to(self.device)
        return reference.requires_grad_(False).train(self.model.training)

    # ----------------------------------------------------------------------------- the step
    def optimizer_step(self, batches: Iterator[Tensor], window: LogWindow) -> None:
        step, rl, config = self.counters.step, self.rl, self.config
        started = time.perf_counter()
        rollouts = self.rollouts(step)
        rewards, correct = self.rewards_of(rollouts)
        advantages = group_advantages(rewards, rl.group_size, rl.advantage_scale == "std").to(self.device)
        rollout_seconds = time.perf_counter() - started
        old = None if rl.inner_updates == 1 else self._fixed_scores(self.step_model, rollouts, step)
        reference = self._reference_scores(rollouts, step)
        rows = rollouts.tokens.shape[0]
        chunks = self._chunks(rows)
        clipped = torch.zeros((), device=self.device)
        kl = torch.zeros((), device=self.device)
        variance = torch.zeros((), device=self.device)
        loss_total = torch.zeros((), device=self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        for update in range(rl.inner_updates):
            self.optimizer.zero_grad(set_to_none=True)
            for index, chunk in enumerate(chunks):
                with self.world.gradient_sync(self.step_model, enabled=index == len(chunks) - 1):
                    new = self._scores(self.step_model, rollouts, chunk, self._draws(rollouts, chunk, step, update))
                    before = new.log_probs.detach() if old is None else old[update][index].log_probs
                    result = clipped_policy_loss(
                        new.log_probs,
                        before,
                        new.weights,
                        new.rows,
                        advantages[chunk],
                        rl.clip_epsilon,
                        None if reference is None else reference[update][index].log_probs,
                        rl.kl_weight,
                        rows_total=rows,
                    )
                    # A micro-batch without a scored token still reaches every parameter (DDP's reduction).
                    loss = result.loss if new.log_probs.numel() else self._zero_loss()
                    self.scaler.scale(loss).backward()
                if update == 0:
                    spread = new.sample_variance(chunk.stop - chunk.start)
                    if spread is not None:
                        variance += spread.detach() * (chunk.stop - chunk.start) / rows
                loss_total += loss.detach() / rl.inner_updates
                share = (chunk.stop - chunk.start) / rows / rl.inner_updates
                clipped += result.clipped * share
                kl += result.kl / rl.inner_updates
            finite = torch.isfinite(loss_total).to(self.device)
            grad_norm = self.apply_gradients(window, ~finite)
            window.grad_norm += grad_norm.detach().float() / rl.inner_updates
        self.counters.micro_batches_seen += len(chunks) * self.world.world_size
        fed = int(rollouts.tokens.numel()) * self.world.world_size
        self.counters.tokens_seen += fed
        window.tokens += fed
        window.loss += loss_total
        window.accuracy += correct.mean().to(self.device)
        window.steps += 1
        self.counters.step += 1
        update_seconds = time.perf_counter() - started - rollout_seconds
        self._record(rewards, correct, torch.stack([kl, clipped, variance]), rollout_seconds, update_seconds)
        first = rollouts.prompt_indices[0]
        self._sample = f"{self.prompts.texts[first]}{rollouts.replies[0]}"

    def _zero_loss(self) -> Tensor:
        """A zero that still reaches every trained parameter, so that DDP's reduction sees the same graph."""

        return torch.stack([p.sum() for p in self.model.parameters() if p.requires_grad]).sum() * 0.0

    def _record(
        self,
        rewards: Tensor,
        correct: Tensor,
        on_device: Tensor,
        rollout_seconds: float,
        update_seconds: float,
    ) -> None:
        """Keep one step's figures: the rewards' (host tensors) as numbers, the update's ([kl, clipped,
        variance] on the device) as they are, read only when the window is logged (no sync per step)."""

        groups = rewards.view(-1, self.rl.group_size)
        spread = groups.std(dim=1)
        self._stats.append(
            {
                "reward_sum": float(rewards.sum()),
                "correct_sum": float(correct.sum()),
                "count": float(rewards.numel()),
                "std_sum": float(spread.sum()),
                "flat_sum": float((spread == 0).float().sum()),
                "groups": float(groups.shape[0]),
                "rollout_seconds": rollout_seconds,
                "update_seconds": update_seconds,
            }
        )
        self._update_stats.append(on_device.detach())

    # ----------------------------------------------------------------------------- reporting
    def log_events(self) -> list[Any]:
        stats, self._stats = self._stats, []
        updates, self._update_stats = self._update_stats, []
        if not stats:
            return []
        names = ("reward_sum", "correct_sum", "count", "std_sum", "flat_sum", "groups")
        host = torch.tensor([sum(entry[name] for entry in stats) for name in names], dtype=torch.float32)
        local = torch.cat([host.to(self.device), torch.stack(updates).sum(dim=0).float()])
        figures = self.world.sum_over_ranks([local])[0].tolist()  # the window's one host sync
        total = dict(zip((*names, "kl", "clipped", "variance"), figures, strict=True))
        steps = len(stats) * self.world.world_size
        return [
            RolloutEvent(
                step=self.counters.step,
                mean_reward=total["reward_sum"] / total["count"],
                accuracy=total["correct_sum"] / total["count"],
                reward_std=total["std_sum"] / total["groups"],
                flat_groups=total["flat_sum"] / total["groups"],
                kl=total["kl"] / steps,
                clip_fraction=total["clipped"] / steps,
                rollout_seconds=sum(entry["rollout_seconds"] for entry in stats) / len(stats),
                update_seconds=sum(entry["update_seconds"] for entry in stats) / len(stats),
                sample=self._sample,
                estimator_variance=total["variance"] / steps if self.rl.estimator_samples > 1 else None,
            )
        ]

    def validates_itself(self) -> bool:
        return self.heldout is not None

    def validation_event(self) -> HeldoutEvent:
        """One sample per held-out prompt (seeded by the prompt alone: every evaluation asks the same), scored."""

        assert self.heldout is not None
        result = evaluate_prompts(
            self.model,
            self.tokenizer,
            self.heldout,
            self.rewards,
            samples=1,
            length=self.length,
            seed=noise_seed(self.config.seed, HELDOUT_TAG),
            batch_size=max(self.config.batch_size, 1),
            options=self.sampling_options(),
        )
        return HeldoutEvent(
            step=self.counters.step,
            accuracy=result.pass_at[1],
            stderr=result.stderr[1],
            mean_reward=result.mean_reward,
            prompts=result.prompts,
        )

    def phase(self) -> str:
        rl = self.rl
        return (
            f"GRPO: {rl.prompts_per_step} prompts x {rl.group_size} rollouts per step, {rl.inner_updates} update(s), "
            f"{rl.estimator} likelihood; loss is the clipped policy objective, accuracy the rollouts'"
        )
