"""scripts/block_size_ablation.py without training: its variants, its train commands and its tables."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

from dlm.config.schema import load_config

ROOT = Path(__file__).resolve().parents[1]


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("block_size_ablation", ROOT / "scripts" / "block_size_ablation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_variants_and_train_commands_are_valid_dlm_configs(tmp_path: Path) -> None:
    ablation = script()
    clipped = ablation.parse_variant("4@0.3-0.8")
    assert (clipped.block_size, clipped.clip, clipped.name) == (4, (0.3, 0.8), "B4-clip0.3-0.8")
    assert ablation.parse_variant("64").name == "B64"
    assert ablation.parse_variant("64", 7).name == "B64-seed7"
    seeded = ablation.train_command(ablation.parse_args([]), ablation.parse_variant("4", 7), tmp_path, tmp_path / "r")
    assert "training.seed=7" in seeded
    args = ablation.parse_args(["--steps", "200"])
    command = ablation.train_command(args, clipped, tmp_path / "data", tmp_path / "run")
    overrides = [command[i + 1] for i, part in enumerate(command) if part == "--set"]
    experiment = load_config(ROOT / "configs" / "shakespeare.toml", overrides)
    assert experiment.model.block_size == 4 and experiment.model.max_seq_len == 64
    assert (experiment.training.clip_mask_min, experiment.training.clip_mask_max) == (0.3, 0.8)
    assert experiment.training.max_steps == 200 and experiment.training.warmup_steps == 10


def test_tables_of_validation_and_training_loss() -> None:
    row = {
        "block_size": 4,
        "clip": [0.3, 0.8],
        "bits_per_byte": 2.5,
        "bits_per_byte_stderr": 0.02,
        "nll": 5.4,
        "nll_mc_stderr": 0.03,
        "unigram_bits_per_byte": 2.9,
        "train_losses": [(20, 7.0), (40, 6.25)],
    }
    lines = script().table([row]).splitlines()
    assert "| 4 | [0.3, 0.8] | 2.500 | 0.020 | 5.400 | 0.030 |" in lines
    assert "Unigram level of the same sequences: 2.900 bits/byte." in lines
    assert "| block size | clip | step 20 | step 40 |" in lines
    assert lines[-1] == "| 4 | [0.3, 0.8] | 7.000 | 6.250 |"


def test_paired_differences_use_the_same_sequences(tmp_path: Path) -> None:
    ablation = script()
    args = ablation.parse_args(["--out", str(tmp_path)])
    variants = [ablation.parse_variant("4"), ablation.parse_variant("64")]
    for variant, nlls in zip(variants, ([5.0, 6.0, 7.0, 8.0], [5.5, 6.5, 7.25, 8.75]), strict=True):
        run = tmp_path / variant.name
        run.mkdir()
        (run / "sequence_nll.json").write_text(json.dumps(nlls))  # as sequence_nlls caches them
    # ln 2 tokens per byte: nats per token are bits per byte.
    (tmp_path / "B4" / "eval.json").write_text(json.dumps({"tokens": math.log(2), "bytes": 1.0}))
    lines = ablation.paired_table(args, variants, tmp_path / "data").splitlines()
    # Differences -0.5, -0.5, -0.25, -0.75: mean -0.5, standard deviation sqrt(1/24), s.e. that / 2.
    assert lines[-1] == f"| B4 | B64 | -0.500 | {math.sqrt(1 / 24) / 2:.3f} |"
