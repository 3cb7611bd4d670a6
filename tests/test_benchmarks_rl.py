"""The RL benchmarks (benchmarks/rl.py) at tiny settings on the tiny addition task: they run and write their figures."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import typer

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
    assert set(figures["by_seed"]) == {"seed_0"} and set(figures["arms"]) == {"rl_coupled", "sft"}
    for arm, summary in figures["arms"].items():
        assert 0 <= summary["mean"] <= 1 and summary["stderr_over_seeds"] == 0
        assert summary["mean"] == figures["by_seed"]["seed_0"][arm]["pass_at_1"]
    assert 0 <= figures["start"]["pass_at_1"] <= 1
    per_step = figures["by_seed"]["seed_0"]["rl_coupled"]["per_step"]  # read from the run's rollout events
    assert per_step["steps"] >= 1 and per_step["rollout_s"] > 0 and per_step["update_s"] > 0
    assert figures["by_seed"]["seed_0"]["sft"]["per_step"] is None


def test_an_arm_is_more_sft_or_a_known_estimator(tmp_path: Path) -> None:
    with pytest.raises(typer.BadParameter, match="rl:ESTIMATOR"):
        rl_learning(arms="rl:coupled,rl:telepathy", results=tmp_path)
    assert not (tmp_path / "rl-learning.json").exists()
