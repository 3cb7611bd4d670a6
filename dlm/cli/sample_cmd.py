"""`dlm sample`: generate text with a trained model and watch it denoise.

On a terminal a rich Live view shows every sample while its masked positions (a dim block
character each) are revealed step by step; otherwise the final texts, or JSON with `--json`.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from dlm.cli.common import JsonOption, console, print_json

if TYPE_CHECKING:
    import torch
    from rich.console import RenderableType

    from dlm.sampling import SampleResult

MASK_GLYPH = "░"


class RemaskingChoice(str, Enum):
    random = "random"
    confidence = "confidence"
    margin = "margin"


def render_samples(tokenizer: Any, tokens: torch.Tensor, mask_token_id: int, step: int, steps: int) -> RenderableType:
    """One panel per sample: known text as is, each masked token as a dim block character."""

    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    from dlm.sampling import split_masked

    panels = []
    rows = tokens.tolist()
    for index, row in enumerate(rows):
        body = Text()
        for part in split_masked(tokenizer, row, mask_token_id):
            if isinstance(part, int):
                body.append(MASK_GLYPH * part, style="dim")
            else:
                body.append(part)
        title = f"sample {index + 1}/{len(rows)}" if len(rows) > 1 else "sample"
        panels.append(Panel(body, title=title, title_align="left", subtitle=f"step {step}/{steps}"))
    return Group(*panels)


def _print_result(result: SampleResult, live_view: bool) -> None:
    if not live_view:
        for index, text in enumerate(result.texts):
            if len(result.texts) > 1:
                typer.echo(f"=== sample {index + 1}/{len(result.texts)} ===")
            typer.echo(text)
        return
    from rich.panel import Panel
    from rich.text import Text

    for index, text in enumerate(result.texts):
        title = f"sample {index + 1}/{len(result.texts)}" if len(result.texts) > 1 else "sample"
        console.print(Panel(Text(text), title=title, title_align="left"))
    console.print(f"[dim]{result.steps} steps, {result.forward_passes} forward passes, {result.seconds:.2f} s[/]")


ModelArgument = Annotated[
    Path, typer.Argument(metavar="MODEL", help="Exported model directory (or a training checkpoint).")
]
PromptOption = Annotated[str, typer.Option("--prompt", "-p", help="Text to continue; empty generates unconditionally.")]
TextOption = Annotated[
    str | None,
    typer.Option(
        "--text",
        "-t",
        help="Infilling template instead of a prompt: [MASK] is one token to generate, [MASK*N] is N "
        "tokens, the rest stays fixed token for token, e.g. 'ROMEO: [MASK*20] fair Verona'.",
        show_default=False,
    ),
]
LengthOption = Annotated[int, typer.Option("--length", "-n", help="Tokens to generate after the prompt.")]
StepsOption = Annotated[int, typer.Option("--steps", help="Denoising steps (time from 1 to 0).")]
SamplesOption = Annotated[int, typer.Option("--num-samples", help="Samples, generated as one batch.")]
SeedOption = Annotated[int, typer.Option("--seed", help="Seed; the same seed on the same device repeats a sample.")]
TemperatureOption = Annotated[
    float, typer.Option("--temperature", help="Softmax temperature; 0 picks the most likely token.")
]
TopKOption = Annotated[
    int | None, typer.Option("--top-k", help="Sample only among the K most likely tokens.", show_default=False)
]
TopPOption = Annotated[
    float | None,
    typer.Option(
        "--top-p", help="Sample only from the smallest set of tokens with probability >= P.", show_default=False
    ),
]
RemaskingOption = Annotated[
    RemaskingChoice,
    typer.Option(
        "--remasking",
        help="Which predictions each step keeps: random (ancestral), confidence (most probable first, "
        "LLaDA) or margin (largest top-1 minus top-2 probability first).",
    ),
]
BlockOption = Annotated[
    int | None,
    typer.Option(
        "--block-length",
        help="Semi-autoregressive: generate blocks of B tokens left to right, the steps split between them.",
        show_default=False,
    ),
]
DeviceOption = Annotated[str, typer.Option("--device", help="auto, cpu, mps, cuda or cuda:N.")]


def _generate_live(model: Any, tokenizer: Any, options: dict[str, Any]) -> SampleResult:
    """Generate while a transient Live view redraws the samples after every step."""

    from rich.live import Live

    from dlm.sampling import generate

    mask_id = model.config.mask_token_id
    with Live(console=console, refresh_per_second=15, transient=True) as live:

        def show(step: int, tokens: torch.Tensor) -> None:
            live.update(render_samples(tokenizer, tokens, mask_id, step, options["steps"]))

        return generate(model, tokenizer, on_step=show, **options)


def sample(
    model_path: ModelArgument,
    prompt: PromptOption = "",
    text: TextOption = None,
    length: LengthOption = 64,
    steps: StepsOption = 64,
    num_samples: SamplesOption = 1,
    seed: SeedOption = 0,
    temperature: TemperatureOption = 1.0,
    top_k: TopKOption = None,
    top_p: TopPOption = None,
    remasking: RemaskingOption = RemaskingChoice.confidence,
    block_length: BlockOption = None,
    device: DeviceOption = "auto",
    as_json: JsonOption = False,
) -> None:
    """Generate text by reversing the masking process; a terminal shows it denoise live.

    Masked positions are drawn as dim blocks while they wait to be revealed. Without a terminal
    the final texts are printed, or with --json the texts, steps, forward passes and seconds.
    """

    from dlm.sampling import SamplingOptions, check_request, generate

    # Check every option before the (slow) model load.
    SamplingOptions(steps, temperature, top_k, top_p, remasking.value, block_length)
    check_request(prompt=prompt, text=text, length=length, num_samples=num_samples, seed=seed)
    from dlm.export import load_model
    from dlm.runtime import resolve_device

    resolved = str(resolve_device(device, "--device"))

    model, tokenizer = load_model(model_path, device=resolved)
    options: dict[str, Any] = dict(
        prompt=prompt, text=text, length=length, steps=steps, num_samples=num_samples, seed=seed,
        temperature=temperature, top_k=top_k, top_p=top_p, remasking=remasking.value,
        block_length=block_length, device=resolved,
    )  # fmt: skip
    live_view = not as_json and console.is_terminal
    result = _generate_live(model, tokenizer, options) if live_view else generate(model, tokenizer, **options)
    if as_json:
        print_json(result.to_dict())
    else:
        _print_result(result, live_view)


def _stage_summary(event: dict[str, Any]) -> str:
    """One line of figures for a finished (or reused) demo stage."""

    stage = event["stage"]
    if stage == "tokenizer":
        return f"vocabulary {event['vocab_size']}"
    if stage == "data":
        return f"{event['train_num_blocks']:,} training / {event['val_num_blocks']:,} validation blocks"
    if stage == "validate":
        return f"{event['checks']} checks passed"
    if stage == "calibrate":
        return (
            f"{event['seconds_per_step']:.2f} s per step: {event['max_steps']} steps, warmup {event['warmup_steps']}, "
            "cosine to the floor within the budget"
        )
    if stage == "train":
        text = f"step {event['step']} of {event['max_steps']}"
        if event.get("outcome") == "paused":
            text += " (the budget ran out first)"
        if event.get("learning_rate") is not None:
            text += f", final learning rate {event['learning_rate']:.2e} (floor {event['min_learning_rate']:.2e})"
        return text
    if stage == "evaluate":
        bpb, unigram = event.get("bits_per_byte"), event.get("unigram_bits_per_byte")
        text = f"{bpb:.3f} bits per byte" if bpb is not None else "no bits per byte"
        return text + (f" (unigram baseline {unigram:.3f})" if unigram is not None else "")
    return str(event.get("path", ""))


class DemoView:
    """Renders `dlm demo` events on a terminal: a spinner or bar while a stage runs, a line when it
    ends, the training dashboard while the model trains, and a panel per sample."""

    def __init__(self) -> None:
        self.progress: Any = None  # rich Progress of the running stage
        self.task: Any = None
        self.dashboard: Any = None  # TrainingDashboard while the train stage runs

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.dashboard is not None:
            self.dashboard.__exit__(None, None, None)
        self.progress = self.task = self.dashboard = None

    def __call__(self, event: dict[str, Any]) -> None:
        from rich.panel import Panel
        from rich.text import Text

        kind = event.get("event")
        if kind == "demo_stage":
            self._stage(event)
        elif kind == "demo_progress" and self.progress is not None:
            self.progress.update(self.task, completed=event["done"], total=event["total"])
        elif kind == "demo_start":
            console.print(f"[bold]dlm demo[/] in {escape(event['output'])} on {event['device']}, "
                          f"{event['minutes']:g} minutes of training", highlight=False, soft_wrap=True)  # fmt: skip
        elif kind == "demo_note":
            console.print(f"[yellow]note:[/] {escape(event['message'])}", highlight=False)
        elif kind == "demo_replan":
            console.print(f"[dim]step {event['step']}: {event['seconds_per_step']:.2f} s per step, the schedule "
                          f"now ends at step {event['max_steps']}[/]", highlight=False)  # fmt: skip
        elif kind == "demo_sample":
            title = f"{event['label']}: {event['template'] or event['prompt'] or 'no prompt'}"
            console.print(Panel(Text(event["text"]), title=escape(title), title_align="left"))
        elif self.dashboard is not None:
            self.dashboard(event)  # the training loop's own events

    def _stage(self, event: dict[str, Any]) -> None:
        from rich.markup import escape
        from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

        from dlm.dashboard import TrainingDashboard

        stage, status = event["stage"], event["status"]
        self.close()
        if status == "running" and stage == "train":
            self.dashboard = TrainingDashboard(console).__enter__()
        elif status == "running":
            self.progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                                     TaskProgressColumn(), TimeElapsedColumn(), console=console)  # fmt: skip
            self.progress.start()
            self.task = self.progress.add_task(f"{stage}: {escape(event.get('detail', ''))}", total=None)
        else:
            mark, how = ("[cyan]↺[/]", "reused") if status == "reused" else ("[green]✓[/]", f"{event['seconds']:.1f} s")
            console.print(f"{mark} {stage:<9} {how:>8}  {escape(_stage_summary(event))}", highlight=False)


DemoOutputOption = Annotated[Path, typer.Option("--output", "-o", help="Directory for data, run, model and samples.")]
MinutesOption = Annotated[
    float, typer.Option("--minutes", "-m", help="Wall-clock budget of the training stage, calibration included.")
]
DemoDeviceOption = Annotated[
    str | None, typer.Option("--device", help="auto, cpu, mps, cuda or cuda:N (default: the config's).")
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

    from dlm.cli.common import err_console, wants_json
    from dlm.dashboard import JsonLinesSink
    from dlm.demo import run_demo

    json_mode = wants_json(as_json)
    view = None if json_mode else DemoView()
    try:
        result = run_demo(output, minutes, device, config, JsonLinesSink() if view is None else view)
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
        console.print(f"[bold]done[/] in {result.seconds / 60:.1f} minutes: {bpb} on the held-out plays; model in "
                      f"{escape(str(result.model_dir))}", highlight=False, soft_wrap=True)  # fmt: skip
        console.print(f'try: dlm sample {escape(str(result.model_dir))} --prompt "ROMEO:" --length '
                      f"{result.sample_length}", highlight=False, soft_wrap=True)  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("sample")(sample)
    app.command("demo")(demo_command)
