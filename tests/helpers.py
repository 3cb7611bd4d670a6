"""Helpers shared by test modules (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

from pathlib import Path

from dlm.config import ExperimentConfig, load_config
from dlm.train import train

ROOT = Path(__file__).resolve().parents[1]


def tiny_experiment(data_dir: Path, run_dir: Path, *overrides: str) -> ExperimentConfig:
    """configs/tiny.toml pointed at a packed tiny data dir (the `tiny_data_dir` fixture) and a run dir."""

    return load_config(
        ROOT / "configs" / "tiny.toml",
        [
            f"training.tokenizer={data_dir / 'tokenizer.json'}",
            f"training.train_data={data_dir / 'train.bin'}",
            f"training.val_data={data_dir / 'val.bin'}",
            f"training.output_dir={run_dir}",
            *overrides,
        ],
    )


def train_tiny_run(data_dir: Path, run_dir: Path, *extra: str) -> Path:
    """A finished 4-step tiny run (validated and saved at step 4) to evaluate or export."""

    overrides = ("training.max_steps=4", "training.warmup_steps=1", "training.eval_interval=4",
                 "training.save_interval=4")
    train(tiny_experiment(data_dir, run_dir, *overrides, *extra))
    return run_dir
