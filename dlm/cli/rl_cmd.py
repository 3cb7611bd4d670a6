"""`dlm rl`: reinforcement learning with verifiable rewards, with `dlm train`'s dashboard and exit codes;
`dlm task`: write a bundled verifiable task to learn it on."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dlm.cli.common import ConfigOption, JsonOption, SetOption, TrainingDeviceOption, console, print_json, wants_json
from dlm.cli.train_cmd import AllowDataChangeOption, MaxRunSteps, PrecisionOption, _overrides, _run
from dlm.config.schema import load_config


def rl_command(
    config: ConfigOption,
    overrides: SetOption = None,
    init_from: Annotated[
        Path | None,
        typer.Option(
            "--init-from",
            metavar="MODEL",
            help="The model to improve: an export directory, a checkpoint or a run directory "
            "(sets training.init_from).",
        ),
    ] = None,
    minutes: Annotated[
        float | None,
        typer.Option(
            "--minutes", min=0.05, help="Stop after this many minutes with a checkpoint (paused; dlm resume goes on)."
        ),
    ] = None,
    max_run_steps: MaxRunSteps = None,
    device: TrainingDeviceOption = None,
    precision: PrecisionOption = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Delete the run already in training.output_dir and start over.")
    ] = False,
    allow_data_change: AllowDataChangeOption = False,
    as_json: JsonOption = False,
) -> None:
    """Improve a trained model with GRPO on verifiable rewards (\\[rl] in the config; docs/rl.md).

    Each step samples rl.group_size completions of rl.prompts_per_step prompts with dlm's sampler, scores
    them with the rewards, and updates the model on the group-normalised advantages. Ctrl-C saves a
    checkpoint; dlm resume continues exactly.
    """

    # lazy: keeps torch out of `dlm --help` and of every other command's start
    from dlm.rl.run import rl_experiment

    extra = _overrides(overrides, device, precision)
    if init_from is not None:
        extra.append(f"training.init_from={init_from}")
    experiment = rl_experiment(load_config(config, extra))
    _run(
        experiment,
        as_json,
        max_run_steps=max_run_steps,
        max_run_minutes=minutes,
        overwrite=overwrite,
        allow_data_change=allow_data_change,
    )


def task_command(
    name: Annotated[str, typer.Argument(help="The task: addition (a+b with operands of up to --digits digits).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for the task's files.")],
    digits: Annotated[int, typer.Option("--digits", min=1, max=6, help="Most digits of an operand.")] = 2,
    sft: Annotated[int, typer.Option("--sft", min=1, help="Supervised examples (sft.jsonl).")] = 3_000,
    prompts: Annotated[int, typer.Option("--prompts", min=1, help="RL prompts (prompts.jsonl).")] = 5_500,
    heldout: Annotated[int, typer.Option("--heldout", min=1, help="Evaluation prompts (heldout.jsonl).")] = 500,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the problems drawn.")] = 0,
    noise: Annotated[
        float, typer.Option("--noise", help="Share of the supervised responses made wrong (one digit off).")
    ] = 0.0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the task's files in --output.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Write a bundled verifiable task: supervised examples, RL prompts, held-out prompts and a compact chat
    template, each problem in one split only. docs/rl.md walks from here to a model improved by dlm rl."""

    from dlm.data.tokenizer import MIN_VOCAB_SIZE
    from dlm.rl.tasks import write_task

    summary = write_task(
        name,
        output,
        sft=sft,
        prompts=prompts,
        heldout=heldout,
        digits=digits,
        seed=seed,
        noise=noise,
        overwrite=overwrite,
    )
    if wants_json(as_json):
        print_json(
            {"output": str(summary.output), "counts": summary.counts, "wrong_responses": summary.wrong_responses}
        )
        return
    for file, count in summary.counts.items():
        console.print(f"{count:>8,} problems  {summary.output / file}", highlight=False, soft_wrap=True)
    if summary.wrong_responses:
        console.print(f"{summary.wrong_responses:>8,} of the supervised responses are wrong (--noise)", highlight=False)
    console.print(
        f"next: dlm tokenizer train {summary.output}/sft.jsonl --text-field prompt -n {MIN_VOCAB_SIZE} -o "
        f"{summary.output}/tokenizer.json",
        highlight=False,
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    app.command("rl")(rl_command)
    app.command("task")(task_command)
