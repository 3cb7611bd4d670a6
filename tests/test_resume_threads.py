"""A CPU run resumes bit for bit whatever the machine's load: the checkpoint records the intra-op threads
that shaped its float sums, and the resume takes them instead of what the load would choose now."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_same_weights, tiny_experiment, train_losses

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.events import Event, StartEvent
from dlm.runtime import threads
from dlm.train.loop import train

# Batch 16: the tiny model's sums then split over threads, so one thread and two give other weights.
SETTINGS = (
    "training.max_steps=8",
    "training.warmup_steps=1",
    "training.save_interval=4",
    "training.eval_interval=100",
    "training.log_interval=1",
    "training.batch_size=16",
)


def with_load(monkeypatch: pytest.MonkeyPatch, busy: float) -> None:
    """Two usable cores with `busy` cores' worth of other work on them, as the thread plan will see it."""

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "busy_cores", lambda sample_seconds=0.0: busy)


@pytest.fixture(autouse=True)
def threads_restored() -> object:
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def test_a_resume_under_more_load_continues_bit_identically(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_load(monkeypatch, 0.0)  # an idle machine: two threads
    straight_events: list[Event] = []
    straight = train(tiny_experiment(tiny_data_dir, tmp_path / "straight", *SETTINGS), sink=straight_events.append)
    split = tiny_experiment(tiny_data_dir, tmp_path / "split", *SETTINGS)
    first: list[Event] = []
    paused = train(split, max_run_steps=4, sink=first.append)
    assert load_checkpoint(paused.checkpoint)["cpu_threads"] == 2
    with_load(monkeypatch, 1.0)  # a busier machine: the load alone would choose one thread
    assert threads.plan_cpu_threads().threads == 1
    second: list[Event] = []
    resumed = train(split, resume=paused.checkpoint, sink=second.append)
    start = next(event for event in second if isinstance(event, StartEvent))
    assert start.cpu_threads == "2 cores, as the checkpoint recorded: 2 threads"
    assert_same_weights(straight.checkpoint, resumed.checkpoint)
    assert train_losses(first) + train_losses(second) == train_losses(straight_events)


def test_a_run_gives_back_the_process_settings_it_changed(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a GPU a run turns TF32 on and, with require_fused_attention, the math attention kernel off; a
    # program that trains and then runs its own float32 attention (transformers) must find them as before.
    def as_on_a_gpu(device: torch.device, require_fused_attention: bool) -> None:  # as if it were required
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cuda.enable_math_sdp(False)

    monkeypatch.setattr("dlm.train.loop.configure_cuda_backends", as_on_a_gpu)
    tf32, math_kernel = torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.math_sdp_enabled()
    try:
        torch.set_num_threads(3)
        torch.backends.cuda.matmul.allow_tf32 = False
        seen: list[tuple[bool, bool]] = []
        experiment = tiny_experiment(tiny_data_dir, tmp_path / "run", "training.max_steps=2", "training.warmup_steps=1")
        monkeypatch.setattr(
            "dlm.train.loop.ensure_valid",
            lambda *args, **kwargs: seen.append(
                (torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.math_sdp_enabled())
            ),
        )
        assert train(experiment).status == "complete"
        assert seen == [(True, False)]  # changed for the run
        assert torch.get_num_threads() == 3 and torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.backends.cuda.math_sdp_enabled() == math_kernel
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cuda.enable_math_sdp(math_kernel)
