"""The CPU table's benchmarks through `python -m benchmarks`, at tiny settings, into a scratch results folder."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import train_tiny_run
from typer.testing import CliRunner

from benchmarks import demo as demo_benchmark
from benchmarks.__main__ import BENCHMARKS, app
from dlm.artifacts.export import export_model
from dlm.config.schema import load_config

ROOT = Path(__file__).resolve().parents[1]


def invoke(*arguments: str) -> None:
    result = CliRunner().invoke(app, list(arguments))
    assert result.exit_code == 0, result.output


def result(folder: Path, name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
    assert loaded["benchmark"] == name and loaded["machine"]["cores"] >= 1
    return loaded


def test_every_registered_benchmark_has_help() -> None:
    for name in BENCHMARKS:
        help_text = CliRunner().invoke(app, [name, "--help"])
        # A result file's folder, or (the GPU check's parts) the JSON-lines file its report reads.
        assert help_text.exit_code == 0 and re.search(r"--(results|out)\b", help_text.output), name


def test_train_step_compares_dlm_and_the_baseline_per_round(tmp_path: Path) -> None:
    invoke(
        "train-step",
        "--rounds",
        "3",
        "--threads",
        "1",
        "--config",
        str(ROOT / "configs" / "tiny.toml"),
        "--results",
        str(tmp_path),
    )
    figures = result(tmp_path, "train-step")["figures"]["threads_1"]
    assert figures["baseline_gflops"] > 0 and figures["dlm_gflops"] > 0
    assert figures["ratio"]["min"] <= figures["ratio"]["median"] <= figures["ratio"]["max"]
    raw = result(tmp_path, "train-step")["rounds"]["threads_1"]
    assert len(raw["baseline_gflops"]) == len(raw["dlm_gflops"]) == 3


@pytest.mark.slow
def test_pack_times_both_processes_on_the_bundled_corpus(tmp_path: Path) -> None:
    invoke("pack", "--rounds", "1", "--vocab-size", "512", "--results", str(tmp_path))
    loaded = result(tmp_path, "pack")
    assert loaded["figures"]["corpus_bytes"] > 4_000_000  # the 42 works, decompressed
    walls = loaded["rounds"]["wall_s"]
    assert set(walls) == {"baseline", "dlm_pack"} and all(len(v) == 1 for v in walls.values())
    assert loaded["figures"]["ratio"]["median"] == pytest.approx(walls["baseline"][0] / walls["dlm_pack"][0])


def test_the_twin_is_the_cpu_recipe_with_one_token_blocks_and_causal_attention(tmp_path: Path) -> None:
    twin = load_config(demo_benchmark.twin_config(tmp_path))
    recipe = load_config(ROOT / "configs" / "cpu.toml")
    assert (twin.model.block_size, twin.model.attention) == (1, "causal")
    differing = {key for key, value in twin.model.model_dump().items() if value != getattr(recipe.model, key)}
    assert differing == {"block_size", "attention"}


def test_generation_scores_fewer_passes_against_one_per_token(tiny_data_dir: Path, tmp_path: Path) -> None:
    model = export_model(train_tiny_run(tiny_data_dir, tmp_path / "run"), tmp_path / "model", dtype="float32")
    invoke(
        "generation",
        "--model",
        str(model),
        "--judge",
        str(model),
        "--length",
        "16",
        "--num-samples",
        "2",
        "--repeats",
        "1",
        "--steps",
        "16,4",
        "--results",
        str(tmp_path),
    )
    figures = result(tmp_path, "generation")["figures"]
    default, fast = figures["by_passes"]["steps_16"], figures["by_passes"]["steps_4"]
    assert default["cpu_speedup"] == 1.0 and default["perplexity_change"] == 0.0
    assert fast["passes"] == 4 and fast["cpu_speedup"] > 0
    fastest = figures["fastest_within_bounds"]
    assert fastest["within_bounds"] and figures["tokens_per_pass_within_bounds"] == 16 / fastest["passes"]


def test_the_cpu_table_summary_reads_the_four_result_files(tmp_path: Path) -> None:
    from benchmarks.__main__ import cpu_table_summary

    figures = {
        "pack": {"ratio": {"median": 1.25}},
        "train-step": {"threads_1": {"ratio": {"median": 0.96}}, "threads_2": {"ratio": {"median": 0.99}}},
        "demo": {"diffusion": {"bits_per_byte": 2.1923, "steps": 900}, "autoregressive": {"bits_per_byte": 2.05}},
        "generation": {
            "ppl_bound": 0.1,
            "tokens_per_pass_within_bounds": 2.0,
            "fastest_within_bounds": {"cpu_speedup": 1.5},
        },
    }
    for name, values in figures.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"benchmark": name, "figures": values}), encoding="utf-8")
    assert cpu_table_summary(tmp_path) == [
        "dlm pack / raw tokenizer throughput: 1.25x",
        "training step, dlm / plain PyTorch, threads 1: 0.96x",
        "training step, dlm / plain PyTorch, threads 2: 0.99x",
        "demo: 2.192 bits/byte in 900 steps",
        "its autoregressive twin: 2.050 bits/byte",
        "generation: 2 tokens per pass within 10% of the default's judge perplexity, 1.50x its speed",
    ]


def test_a_checkout_of_another_commit_is_a_worktree_that_leaves_no_trace(tmp_path: Path) -> None:
    import subprocess

    from benchmarks.budget import checkout, dlm_source

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    with checkout("HEAD") as (tree, commit):
        assert commit == head.stdout.strip() and (tree / "dlm" / "__init__.py").is_file()
        # `python -m dlm` started there imports that checkout's dlm, not the installed one.
        _, cwd = dlm_source(tree)
        assert cwd == tree
    with pytest.raises(RuntimeError, match="not from"):
        dlm_source(tmp_path)  # no checkout there: dlm would come from elsewhere
    listed = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert str(tree) not in listed.stdout and not tree.exists()


@pytest.mark.slow
def test_budget_records_how_each_schedule_ended_on_a_machine_that_gets_busy(tmp_path: Path) -> None:
    invoke(
        "budget",
        "--minutes",
        "0.15",
        "--repeats",
        "1",
        "--busy-after",
        "0.5",
        "--config",  # the tiny recipe: its steps are cheap enough for this budget on a busy machine
        str(ROOT / "configs" / "tiny.toml"),
        "--output",
        str(tmp_path / "runs"),
        "--results",
        str(tmp_path),
    )
    loaded = result(tmp_path, "budget")
    (only,) = loaded["rounds"]["current"]
    assert only["outcome"] in ("complete", "paused") and only["steps"] <= only["max_steps"]
    assert 0 < only["bits_per_byte"] < 16 and 0 <= only["rate_left"] <= 1 and only["refits"] >= 1
    summary = loaded["figures"]["current"]
    assert summary["runs"] == 1 and summary["bits_per_byte"] == only["bits_per_byte"]
    assert not (tmp_path / "runs" / "current-0").exists()  # each run's checkpoints go once measured


def test_forward_share_splits_sampling_time_between_the_model_and_the_sampler(
    tiny_data_dir: Path, tmp_path: Path
) -> None:
    model = export_model(train_tiny_run(tiny_data_dir, tmp_path / "run"), tmp_path / "model", dtype="float32")
    invoke(
        "forward-share",
        str(model),
        "--length",
        "16",
        "--samples",
        "2",
        "--steps",
        "4",
        "--repeats",
        "2",
        "--results",
        str(tmp_path),
    )
    loaded = result(tmp_path, "forward-share")
    figures = loaded["figures"]
    assert figures["passes"] == 4 and 0 < figures["forward_share"] < 1
    forward, total = loaded["rounds"]["forward_cpu_s"], loaded["rounds"]["total_cpu_s"]
    assert len(forward) == 2 and all(0 < inside < whole for inside, whole in zip(forward, total, strict=True))
