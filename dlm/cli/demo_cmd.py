"""`dlm demo`: tokenizer, data, training, evaluation, export and samples in one command.

The stages run in `dlm.demo`; this module parses the options and picks the view (`demo_view` on a
terminal, JSON lines otherwise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from dlm.artifacts.events import JsonLinesSink
from dlm.cli.common import DemoDeviceOption, JsonOption, console
from dlm.cli.demo_view import DemoView, sample_quality_line

DemoOutputOption = Annotated[Path, typer.Option("--output", "-o", help="Directory for data, run, model and samples.")]
MinutesOption = Annotated[
    float, typer.Option("--minutes", "-m", help="Wall-clock budget of the training stage, calibration included.")
]
DemoConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="Train this config instead of the bundled shakespeare.toml.", show_default=False
    ),
]


def demo_command(
    output: DemoOutputOption = Path("runs/demo"),
    minutes: MinutesOption = 10.0,
    device: DemoDeviceOption = None,
    config: DemoConfigOption = None,
    distill_minutes: Annotated[
        float | None,
        typer.Option(
            "--distill-minutes",
            help="Then distil the model into a few-step student (dlm distill) within "
            "this budget, and show its sample beside the model's, with passes and time.",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Tokenizer, data, training, evaluation, export and samples in one command.

    Runs on the bundled Shakespeare corpus: trains the tokenizer, packs the data
    (Hamlet, Macbeth, Twelfth Night held out), validates, trains with the live
    dashboard for --minutes (its learning-rate schedule planned to end in time),
    reports bits per byte, exports DIR/model and prints three samples.

    A second run reuses every finished stage; a larger --minutes continues the
    training from its latest checkpoint. On the CPU a smaller model than
    shakespeare.toml's is trained (the output says so); a GPU trains it whole.
    """

    # lazy: wants_json looked up per call (a test replaces it); the demo imports torch
    from dlm.cli.common import err_console, wants_json
    from dlm.demo.run import run_demo

    json_mode = wants_json(as_json)
    view = None if json_mode else DemoView()
    try:
        result = run_demo(
            output, minutes, device, config, JsonLinesSink() if view is None else view, distill_minutes=distill_minutes
        )
    except KeyboardInterrupt:
        # Outside training (which saves and returns on Ctrl-C): finished stages are kept on disk.
        err_console.print("interrupted: run the same command again to continue", highlight=False)
        raise typer.Exit(130) from None
    finally:
        if view is not None:
            view.close()
    if result.status == "interrupted":
        err_console.print(f"interrupted at step {result.step}: run the same command again to continue", highlight=False)
        raise typer.Exit(result.exit_code or 130)
    if view is not None:
        bpb = f"{result.bits_per_byte:.3f} bits per byte" if result.bits_per_byte is not None else "done"
        # soft_wrap: the model path and the command are copied, so they never break at the terminal's width.
        console.print(
            f"[bold]done[/] in {result.seconds / 60:.1f} minutes: {bpb} on the held-out plays; model in "
            f"{escape(str(result.model_dir))}",
            highlight=False,
            soft_wrap=True,
        )
        if result.verdict is not None:
            console.print(f"[bold yellow]warning:[/] {escape(result.verdict)}", highlight=False)
        if result.sample_quality:
            console.print(sample_quality_line(result.sample_quality), highlight=False)
        console.print(
            f'try: dlm sample {escape(str(result.model_dir))} --prompt "ROMEO:" --length {result.sample_length}',
            highlight=False,
            soft_wrap=True,
        )


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
