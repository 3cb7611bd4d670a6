"""RL runs: the experiment a config and a trained model make, and the run itself.

An RL run is a training run (`dlm.train.loop.train`) whose step is `dlm.rl.step.RLStep`: its run
directory, checkpoints, exact resume, dashboards, DDP and stop signals are training's. The policy
starts from `training.init_from`; a config without `[model]` (and `[diffusion]`, and a tokenizer)
takes that model's, so a config need only say where the model and the prompts are.
"""

from __future__ import annotations

from typing import Any

from dlm.artifacts.loading import read_model_source
from dlm.config.schema import ExperimentConfig
from dlm.errors import UserError
from dlm.rl.step import RLStep
from dlm.train.loop import TrainResult, train


def rl_experiment(experiment: ExperimentConfig) -> ExperimentConfig:
    """`experiment` with the starting model's `[model]`, `[diffusion]` and tokenizer where it names none."""

    if experiment.rl is None:
        raise UserError("this config has no [rl] section", fix="add [rl] with prompts = 'FILE.jsonl' (docs/rl.md)")
    source = experiment.training.init_from
    if source is None:
        raise UserError("an [rl] run needs training.init_from", fix="pass --init-from MODEL or set it in [training]")
    info, _ = read_model_source(source, use_ema=True)
    updates: dict[str, Any] = {}
    if "model" not in experiment.model_fields_set:
        updates["model"] = info.model
        updates["diffusion"] = info.diffusion
    if "tokenizer" not in experiment.training.model_fields_set:
        updates["training"] = experiment.training.model_copy(update={"tokenizer": info.tokenizer_path})
    if not updates:
        return experiment
    return ExperimentConfig.model_validate({**experiment.to_dict(), **{k: v.model_dump() for k, v in updates.items()}})


def rl(experiment: ExperimentConfig, **options: Any) -> TrainResult:
    """Run (or, with `resume=`, continue) the RL run `experiment` describes; `options` are those of
    `dlm.train.loop.train`. Returns how the run ended."""

    if experiment.rl is None:
        raise UserError("this config has no [rl] section", fix="train it with dlm train, or add [rl]")
    return train(experiment, step_type=RLStep, **options)
