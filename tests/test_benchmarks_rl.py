"""The RL benchmarks (benchmarks/rl.py) at tiny settings on the tiny addition task: they run and write their figures."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest

from benchmarks import harness
from benchmarks.rl import rl_estimators, rl_learning
from tests.helpers import build_addition_task


@pytest.fixture(scope="module")
def addition(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_addition_task(tmp_path_factory.mktemp("addition"))


def test_the_estimators_are_compared_at_equal_passes(addition: Path, tmp_path: Path) -> None:
    heldout = addition / "task" / "heldout.jsonl"
    rl_estimators(model=addition / "sft", prompts=heldout, rows=2, group=2, repeats=3, steps=2, results=tmp_path)
    figures = harness.load("rl-estimators", tmp_path)["figures"]
    estimators = figures["estimators"]
    assert figures["rows"] == 4 and figures["completion_tokens"] > 0
    assert {"one_step", "coupled", "elbo"} <= set(estimators)
    assert all(entry["passes"] == 2 for entry in estimators.values())  # the same passes per estimate for each
    assert estimators["one_step"]["variance_vs_one_step"] == 1.0
    for entry in estimators.values():
        assert math.isfinite(entry["mean_log_likelihood"]) and entry["mean_log_likelihood"] <= 0
        assert entry["per_sequence_variance"] >= 0 and entry["cpu_s_per_estimate"] > 0


@pytest.mark.slow  # two training processes side by side and five evaluations: about a minute on 2 cores
@pytest.mark.skipif(
    shutil.which("taskset") is None or (os.cpu_count() or 1) < 2, reason="the arms run on cores 0 and 1 (taskset)"
)
def test_rl_and_more_sft_are_judged_on_the_held_out_prompts(addition: Path, tmp_path: Path) -> None:
    rl_learning(
        sft=addition / "sft",
        task=addition / "task",
        packed=addition / "packed",
        output=tmp_path / "runs",
        minutes=0.05,
        seeds="0",
        samples=1,
        limit=4,
        set_=["rl.group_size=4", "rl.prompts_per_step=2", "rl.sampling_steps=4", "training.batch_size=4"],
        sft_set=["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "training.batch_size=16"],
        results=tmp_path,
    )
    figures = harness.load("rl-learning", tmp_path)["figures"]
    assert set(figures["by_seed"]) == {"seed_0"}
    for arm in ("rl", "more_sft"):
        assert 0 <= figures[arm]["mean"] <= 1 and figures[arm]["stderr_over_seeds"] == 0
        assert figures[arm]["mean"] == figures["by_seed"]["seed_0"][arm]["pass_at_1"]
    assert 0 <= figures["start"]["pass_at_1"] <= 1
