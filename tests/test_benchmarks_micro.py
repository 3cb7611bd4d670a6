"""The micro-benchmarks of `python -m benchmarks` (checkpoint, token-draw, threshold-cost, cpu-precision,
cpu-inference) at
tiny settings: each writes its result file where it is told, with figures that make sense.
elbo-variance is run in tests/test_estimators.py, on the tiny trained model there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from benchmarks import checkpoint, cpu_inference, cpu_precision, elbo_variance, sampling_cost

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "checkpoint": checkpoint.checkpoint,
    "token-draw": sampling_cost.token_draw,
    "threshold-cost": sampling_cost.threshold_cost,
    "cpu-precision": cpu_precision.cpu_precision,
    "cpu-inference": cpu_inference.cpu_inference,
    "elbo-variance": elbo_variance.elbo_variance,
}


def invoke(name: str, results: Path, *arguments: str) -> dict[str, Any]:
    """Run one benchmark's command line as `python -m benchmarks NAME` would; its figures."""

    app = typer.Typer(add_completion=False)
    app.command(name)(COMMANDS[name])
    app.command("unused")(lambda: None)  # two commands: the name is then a subcommand, as in the registry
    outcome = CliRunner().invoke(app, [name, *arguments, "--results", str(results)])
    assert outcome.exit_code == 0, outcome.output
    assert "wrote" in outcome.output
    result: dict[str, Any] = json.loads((results / f"{name}.json").read_text())
    assert result["benchmark"] == name and result["machine"]["cores"] >= 1
    figures: dict[str, Any] = result["figures"]
    return figures


def test_every_command_has_its_help() -> None:
    for name in COMMANDS:
        app = typer.Typer(add_completion=False)
        app.command(name)(COMMANDS[name])
        app.command("unused")(lambda: None)
        outcome = CliRunner().invoke(app, [name, "--help"])
        assert outcome.exit_code == 0 and "--results" in outcome.output, outcome.output


def test_token_draw(tmp_path: Path) -> None:
    figures = invoke("token-draw", tmp_path, "--rows", "4", "--vocab", "256", "--rounds", "2", "--draws", "2000")
    assert set(figures["total_variation"]) == set(figures["cpu_ms"]) == {"textbook", "dlm"}
    assert all(0 <= distance < 0.1 for distance in figures["total_variation"].values())  # 2,000 draws of 64 tokens
    assert all(ms > 0 for ms in figures["cpu_ms"].values())
    ratio = figures["textbook_over_dlm"]
    assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]


def test_threshold_cost(tmp_path: Path) -> None:
    figures = invoke("threshold-cost", tmp_path, "--vocab", "128", "--length", "8", "--samples", "2", "--rounds", "2")
    names = {"plain", "plain_confidence", "threshold"}
    assert set(figures["per_pass_ms"]) == set(figures["passes"]) == names
    assert all(ms > 0 for ms in figures["per_pass_ms"].values())
    assert all(1 <= passes <= 8 for passes in figures["passes"].values())  # at most one pass per token
    best = figures["per_pass_ms"]
    assert figures["threshold_over_plain"] == pytest.approx(best["threshold"] / best["plain"])
    assert figures["threshold_over_plain_confidence"] > 0 and figures["threshold_over_plain_rounds"]["median"] > 0


def test_cpu_precision(tmp_path: Path) -> None:
    config = ROOT / "configs" / "tiny.toml"
    arguments = ["--config", str(config), "--rounds", "2", "--threads", "1", "--set", "training.batch_size=1"]
    figures = invoke("cpu-precision", tmp_path, *arguments)
    assert figures["threads"] == 1 and isinstance(figures["native_bfloat16"], bool)
    steps = figures["median_step_s"]
    assert set(steps) == {"float32", "bfloat16"} and all(seconds > 0 for seconds in steps.values())
    assert figures["float32_over_bfloat16"] == pytest.approx(steps["float32"] / steps["bfloat16"])
    assert figures["float32_over_bfloat16_rounds"]["median"] > 0


@pytest.mark.slow
def test_checkpoint(tmp_path: Path) -> None:
    arguments = ["--d-model", "64", "--layers", "1", "--vocab", "256", "--rounds", "2", "--dir", str(tmp_path)]
    figures = invoke("checkpoint", tmp_path, *arguments)
    assert figures["world_size"] == 2 and figures["state_mib"] == pytest.approx(figures["parameters"] * 12 / 2**20)
    kinds = figures["kinds"]
    assert set(kinds) == {"single", "dcp", "dcp_async"}
    assert kinds["single"]["blocked_vs_single"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    for row in kinds.values():
        assert 0 < row["blocked_s"] <= row["complete_s"] and row["blocked_vs_single"]["median"] > 0
    assert kinds["single"]["written_mib_per_rank"][1] == 0  # the whole state through rank 0
    assert all(mib > 0 for kind in ("dcp", "dcp_async") for mib in kinds[kind]["written_mib_per_rank"])
    assert [path.name for path in tmp_path.iterdir()] == ["checkpoint.json"]  # the checkpoints are gone


def test_cpu_inference(tiny_data_dir: Path, tmp_path: Path) -> None:
    from helpers import train_tiny_run

    from dlm.artifacts.export import export_model

    model = export_model(train_tiny_run(tiny_data_dir, tmp_path / "run"), tmp_path / "model")
    arguments = [str(model), "--length", "4", "--rows", "2", "--rounds", "2", "--quality-seeds", "1"]
    figures = invoke("cpu-inference", tmp_path, *arguments)
    assert figures["threads"] == 1 and isinstance(figures["native_bfloat16"], bool)
    assert figures["load_dtype"] == {
        "bfloat16": "bfloat16" if figures["native_bfloat16"] else "float32",
        "float16": "float16" if figures["native_float16"] else "float32",
    }
    for batch in ("one_row", "batch"):
        seconds = figures[batch]["median_cpu_s"]
        assert set(seconds) == {"bfloat16", "float16", "float32"} and all(value > 0 for value in seconds.values())
        for half in ("bfloat16", "float16"):
            ratio = figures[batch][f"{half}_over_float32"]
            assert ratio == pytest.approx(seconds[half] / seconds["float32"])
            assert figures[batch][f"{half}_rounds"]["median"] > 0
    quality = figures["quality"]  # beside the speed, from the same run
    assert set(quality) == {"bfloat16", "float16", "float32"}
    assert all(row["judge_perplexity"] > 1 and row["unigram_entropy_bits"] > 0 for row in quality.values())
    for half in ("bfloat16", "float16"):
        expected = quality[half]["judge_perplexity"] / quality["float32"]["judge_perplexity"] - 1
        assert quality[half]["perplexity_change"] == pytest.approx(expected)
