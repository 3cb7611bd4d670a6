"""Helpers shared by test modules (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

from pathlib import Path

import torch

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.events import Event, TrainEvent
from dlm.config.schema import ExperimentConfig, load_config
from dlm.data.chat_pack import pack_chat
from dlm.data.tokenizer import MIN_VOCAB_SIZE, train_tokenizer
from dlm.rl.run import rl_experiment
from dlm.rl.tasks import write_task
from dlm.train.loop import train

ROOT = Path(__file__).resolve().parents[1]


def tiny_settings(data_dir: Path, run_dir: Path, *overrides: str) -> list[str]:
    """`--set` values that point a config at a packed tiny data dir (the `tiny_data_dir` fixture) and a run dir."""

    return [
        f"training.tokenizer={data_dir / 'tokenizer.json'}",
        f"training.train_data={data_dir / 'train.bin'}",
        f"training.val_data={data_dir / 'val.bin'}",
        f"training.output_dir={run_dir}",
        *overrides,
    ]


def tiny_experiment(data_dir: Path, run_dir: Path, *overrides: str) -> ExperimentConfig:
    """configs/tiny.toml pointed at a packed tiny data dir (the `tiny_data_dir` fixture) and a run dir."""

    return load_config(ROOT / "configs" / "tiny.toml", tiny_settings(data_dir, run_dir, *overrides))


def train_tiny_run(data_dir: Path, run_dir: Path, *extra: str) -> Path:
    """A finished 4-step tiny run (validated and saved at step 4) to evaluate or export."""

    overrides = (
        "training.max_steps=4",
        "training.warmup_steps=1",
        "training.eval_interval=4",
        "training.save_interval=4",
    )
    train(tiny_experiment(data_dir, run_dir, *overrides, *extra))
    return run_dir


def train_losses(events: list[Event]) -> list[float | None]:
    """The loss of every train event, in order."""

    return [event.loss for event in events if isinstance(event, TrainEvent)]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def assert_same_weights(left: Path, right: Path) -> None:
    """The model weights of two checkpoints are bit-identical."""

    a, b = weights(left), weights(right)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def check_resume_is_exact(
    data_dir: Path, tmp_path: Path, settings: tuple[str, ...], pause_at: int
) -> list[float | None]:
    """Train `settings` straight through, and again paused at `pause_at` then resumed: the final
    weights must be bit-identical and the logged losses equal. Returns the straight run's losses."""

    straight_events: list[Event] = []
    straight = train(tiny_experiment(data_dir, tmp_path / "straight", *settings), sink=straight_events.append)
    split = tiny_experiment(data_dir, tmp_path / "split", *settings)
    first: list[Event] = []
    paused = train(split, max_run_steps=pause_at, sink=first.append)
    assert paused.status == "paused" and paused.step == pause_at
    second: list[Event] = []
    resumed = train(split, resume=paused.checkpoint, sink=second.append)
    assert resumed.status == "complete" and resumed.step == straight.step
    assert_same_weights(straight.checkpoint, resumed.checkpoint)
    losses = train_losses(straight_events)
    assert train_losses(first) + train_losses(second) == losses
    return losses


SFT_SETTINGS = (
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "training.max_steps=12",
    "training.warmup_steps=2",
    "training.batch_size=16",
    "training.log_interval=4",
    "training.eval_interval=12",
    "training.save_interval=12",
)


def build_addition_task(root: Path) -> Path:
    """A tiny addition task, its tokenizer and packed SFT data, and a 12-step SFT run at `root/sft`."""

    write_task("addition", root / "task", sft=400, prompts=40, heldout=12, digits=2)
    train_tokenizer(
        [root / "task" / "sft.jsonl"], MIN_VOCAB_SIZE, root / "task" / "tokenizer.json", text_field="prompt"
    )
    pack_chat([root / "task" / "sft.jsonl"], root / "task" / "tokenizer.json", 16, root / "packed", val_fraction=0.1)
    train_addition_sft(root, root / "sft")
    return root


def train_addition_sft(root: Path, output: Path, *extra: str) -> Path:
    """The 12-step SFT run of `build_addition_task` at `output`, with `extra` settings (another model)."""

    settings = [
        f"training.tokenizer={root / 'packed' / 'tokenizer.json'}",
        f"training.train_data={root / 'packed' / 'train.bin'}",
        f"training.val_data={root / 'packed' / 'val.bin'}",
        f"training.output_dir={output}",
        *SFT_SETTINGS,
        *extra,
    ]
    train(load_config(ROOT / "configs" / "addition-sft.toml", settings))
    return output


def rl_config(root: Path, run: str, *extra: str) -> ExperimentConfig:
    """configs/addition-rl.toml on `build_addition_task`'s files: 2 prompts x 4 rollouts, 4 steps."""

    settings = [
        f"training.init_from={root / 'sft'}",
        f"training.output_dir={root / run}",
        f"rl.prompts={root / 'task' / 'prompts.jsonl'}",
        f"rl.heldout={root / 'task' / 'heldout.jsonl'}",
        "rl.heldout_prompts=6",
        "rl.group_size=4",
        "rl.prompts_per_step=2",
        "rl.sampling_steps=4",
        "training.batch_size=4",
        "training.max_steps=4",
        "training.log_interval=2",
        "training.eval_interval=2",
        "training.save_interval=2",
        "training.learning_rate=1e-3",
        "training.warmup_steps=1",
        *extra,
    ]
    return rl_experiment(load_config(ROOT / "configs" / "addition-rl.toml", settings))
