"""`training.masking = "exact-count"`: each sequence (each block) masks exactly l ~ U{1..n} of its
n tokens, weight n / l, with the counts stratified over the optimizer step like bernoulli's times."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_same_weights, check_resume_is_exact, tiny_experiment

from dlm.diffusion.objective import draw_exact_count
from dlm.errors import UserError
from dlm.train.loop import train

STEPS = (
    "training.max_steps=6",
    "training.warmup_steps=1",
    "training.log_interval=1",
    "training.eval_interval=100",
    "training.save_interval=100",
    "training.masking=exact-count",
)


def _spy(seen: list[tuple[torch.Tensor, torch.Tensor]]):
    def recording(clean: torch.Tensor, *args: object, **kwargs: object):
        corruption = draw_exact_count(clean, *args, **kwargs)  # type: ignore[arg-type]
        seen.append((corruption.mask, corruption.mask_probability))
        return corruption

    return recording


@pytest.mark.parametrize("block_size", [None, 16])
def test_every_sequence_masks_a_stratified_exact_count(tiny_data_dir: Path, tmp_path: Path, block_size) -> None:
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    extra = () if block_size is None else (f"model.block_size={block_size}",)
    experiment = tiny_experiment(
        tiny_data_dir, tmp_path / "run", *STEPS, "training.gradient_accumulation_steps=2", *extra
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("dlm.train.step.draw_exact_count", _spy(seen))
        result = train(experiment)
    assert result.status == "complete" and len(seen) == 12  # 6 steps x 2 micro-batches
    size = 64 if block_size is None else block_size
    for (first_mask, first_p), (second_mask, second_p) in zip(seen[::2], seen[1::2], strict=True):
        counts = []
        for mask, probability in ((first_mask, first_p), (second_mask, second_p)):
            per_unit = mask.view(mask.shape[0], -1, size).sum(dim=2)  # masked tokens per sequence (block)
            assert torch.equal(per_unit.float() / size, probability.reshape(per_unit.shape))
            counts.append(per_unit.flatten())
        # The step's 2 x 8 sequences (x blocks) take evenly spaced counts: every l in 1..size is
        # reached by about as many slots, none twice as often as another.
        spread = torch.bincount(torch.cat(counts) - 1, minlength=size)
        slots = sum(c.numel() for c in counts)
        assert spread.sum() == slots and int(spread.max()) <= -(-slots // size) + 1


def test_exact_count_training_learns_and_resumes_bit_identically(tiny_data_dir: Path, tmp_path: Path) -> None:
    losses = check_resume_is_exact(tiny_data_dir, tmp_path, STEPS, pause_at=3)
    assert all(loss is not None and 0 < loss < 10 for loss in losses) and losses[-1] < losses[0]
    bernoulli = train(tiny_experiment(tiny_data_dir, tmp_path / "bernoulli", *STEPS[:-1]))
    with pytest.raises(AssertionError):  # a different estimator draws different noise
        assert_same_weights(bernoulli.checkpoint, tmp_path / "straight" / "latest.pt")


def test_exact_count_refuses_a_clipped_range(tiny_data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="masking") as refused:
        tiny_experiment(
            tiny_data_dir,
            tmp_path / "run",
            "training.masking=exact-count",
            "training.clip_mask_min=0.3",
            "training.clip_mask_max=0.8",
        )
    assert "bernoulli" in str(refused.value)
    with pytest.raises(UserError, match="masking"):
        tiny_experiment(tiny_data_dir, tmp_path / "run", "training.masking=binomial")
