"""The teacher of each round of a distillation run, and the snapshots that let a run resume mid-round.

Round 0's teacher is the model `[distill] teacher` names. Round r > 0's teacher is the student as
round r began: when the run crosses into round r its weights are copied into the teacher and saved
to `teacher-round-RR.safetensors` in the run directory (`RunDir.teacher_snapshot`), so that a run
resumed anywhere in round r reloads exactly the teacher an uninterrupted run used. Only the current
round's snapshot and those of the rounds the run's checkpoints are in are kept, so any checkpoint a
resume may start from finds its round's teacher.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from dlm.artifacts.checksum import weights_sha256
from dlm.artifacts.run_dir import RunDir
from dlm.config.distill import DistillConfig
from dlm.config.schema import ModelConfig
from dlm.errors import UserError
from dlm.fileio import atomic_path
from dlm.train.distributed import DistributedContext, full_model_state
from dlm.train.init_from import initial_weights, load_initial_weights


class RoundTeachers:
    """Keeps `teacher` (a frozen model of the student's shape) the teacher of the current round."""

    def __init__(
        self,
        teacher: nn.Module,
        distill: DistillConfig,
        model: ModelConfig,
        tokenizer_sha256: str,
        run_dir: Path,
        world: DistributedContext,
    ):
        self.teacher, self.distill, self.model = teacher, distill, model
        self.tokenizer_sha256, self.run, self.world = tokenizer_sha256, RunDir(run_dir), world
        self.round: int | None = None  # the round whose teacher `teacher` holds

    def round_of(self, step: int) -> int:
        """The round optimizer step `step` (0-based) belongs to."""

        return min(step // self.distill.steps_per_round, self.distill.rounds - 1)

    @torch.no_grad()
    def ensure(self, step: int, student: nn.Module) -> None:
        """Make the teacher that of the round of optimizer step `step`; `student` is the model being trained."""

        round_index = self.round_of(step)
        if round_index == self.round:
            return
        if round_index == 0:
            weights = initial_weights(self.distill.teacher, self.model, self.tokenizer_sha256, option="distill.teacher")
            self._check_unchanged(weights)
            load_initial_weights(self.teacher, weights)
        elif step == round_index * self.distill.steps_per_round:  # the round begins: the student teaches it
            self.teacher.load_state_dict(student.state_dict())
            self._save_snapshot(round_index)
        else:
            self._load_snapshot(round_index)
        self.round = round_index

    def _check_unchanged(self, weights: dict[str, Tensor]) -> None:
        """Refuse a teacher whose weights are not those the run began with (a resume after the model moved on)."""

        recorded = self.distill.teacher_sha256
        if recorded is not None and weights_sha256(weights) != recorded:
            raise UserError(
                f"distill.teacher's weights changed since this run began (sha256 {recorded[:12]} recorded)",
                path=self.distill.teacher,
                fix="point distill.teacher at the model the run began with, or distil again into a new run",
            )

    def _save_snapshot(self, round_index: int) -> None:
        state = full_model_state(self.teacher)  # a collective under FSDP: every rank calls it
        if self.world.is_main:
            path = self.run.teacher_snapshot(round_index)
            # Tied weights are stored twice: safetensors refuses shared storage, and a load restores both names.
            tensors = {name: tensor.detach().to("cpu").clone().contiguous() for name, tensor in state.items()}
            with atomic_path(path, durable=True) as temporary:
                save_file(tensors, str(temporary), metadata={"round": str(round_index)})
            # A checkpoint at step s resumes into round_of(s): those rounds' teachers stay.
            needed = {round_index, *(self.round_of(step) for step in self.run.checkpoint_steps())}
            for older_round, older in self.run.teacher_snapshots().items():
                if older_round not in needed:
                    older.unlink(missing_ok=True)
        self.world.barrier()  # no rank trains on a teacher whose snapshot is not yet on disk

    def _load_snapshot(self, round_index: int) -> None:
        path = self.run.teacher_snapshot(round_index)
        try:
            weights = load_file(str(path), device="cpu")
        except (OSError, SafetensorError) as exc:
            raise UserError(
                f"round {round_index}'s teacher cannot be read ({exc}); the run cannot continue this round exactly",
                path=path,
                fix=f"resume from the checkpoint at step {round_index * self.distill.steps_per_round} (--checkpoint), "
                "where the round begins, or distil again",
            ) from None
        load_initial_weights(self.teacher, weights)
