"""The terminal view of `dlm demo`: a spinner or bar while a stage runs, a line of figures when it
ends, the training dashboard while the model trains, and the samples side by side."""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from dlm.artifacts.events import StreamEvent
from dlm.cli.common import console


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


def samples_renderable(samples: list[dict[str, Any]], terminal: bool) -> RenderableType:
    """The unconditional, prompted and infilled samples side by side: a table of one column each
    on a terminal, plain lines (label, then text) anywhere else."""

    titles = [f"{sample['label']}: {sample['template'] or sample['prompt'] or 'no prompt'}" for sample in samples]
    if not terminal:
        return Text("\n".join(f"{title}\n{sample['text']}" for title, sample in zip(titles, samples, strict=True)))
    table = Table(show_lines=False, expand=True, title="samples", title_justify="left")
    for title in titles:
        table.add_column(escape(title), ratio=1, overflow="fold")
    table.add_row(*(Text(sample["text"]) for sample in samples))
    return table


def comparison_renderable(event: dict[str, Any]) -> RenderableType:
    """The teacher's and the student's sample of one prompt side by side, with their passes and time."""

    table = Table(title=f"{escape(event['prompt'])} (the same seed)", expand=True)
    for name in ("teacher", "student"):
        side = event[name]
        table.add_column(
            f"{name}: {side['steps']} steps, {side['forward_passes']} passes, {side['seconds']:.2f} s", ratio=1
        )
    table.add_row(escape(event["teacher"]["text"]), escape(event["student"]["text"]))
    return table


def sample_quality_line(quality: dict[str, Any]) -> str:
    """The samples' words in one line: how dense (beside real held-out text) and how real."""

    return (
        f"samples: {quality['words_per_token']:.2f} words per generated token (the held-out plays: "
        f"{quality['held_out_words_per_token']:.2f}); {quality['known_word_share']:.0%} of their "
        f"{quality['words']} words occur in the training plays"
    )


class DemoView:
    """Renders `dlm demo` events on a terminal: a spinner or bar while a stage runs, a line when it
    ends, the training dashboard while the model trains, and the samples side by side."""

    def __init__(self) -> None:
        self.progress: Any = None  # rich Progress of the running stage
        self.task: Any = None
        self.dashboard: Any = None  # TrainingDashboard while the train stage runs
        self.samples: list[dict[str, Any]] = []

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.dashboard is not None:
            self.dashboard.__exit__(None, None, None)
        self.progress = self.task = self.dashboard = None

    def __call__(self, event: StreamEvent) -> None:
        if not isinstance(event, dict):  # the training loop's own events
            if self.dashboard is not None:
                self.dashboard(event)
            return
        kind = event.get("event")
        if kind == "demo_stage":
            self._stage(event)
        elif kind == "demo_progress" and self.progress is not None:
            self.progress.update(self.task, completed=event["done"], total=event["total"])
        elif kind == "demo_start":
            console.print(
                f"[bold]dlm demo[/] in {escape(event['output'])} on {event['device']}, "
                f"{event['minutes']:g} minutes of training",
                highlight=False,
                soft_wrap=True,
            )
        elif kind == "demo_note":
            console.print(f"[yellow]note:[/] {escape(event['message'])}", highlight=False)
        elif kind == "demo_replan":
            if self.dashboard is None or self.dashboard.replan(event["seconds_per_step"], event["max_steps"]):
                console.print(
                    f"[dim]step {event['step']}: {event['seconds_per_step']:.2f} s per step, the schedule "
                    f"now ends at step {event['max_steps']}[/]",
                    highlight=False,
                )
        elif kind == "demo_sample":
            self.samples.append(event)
        elif kind == "demo_compare":
            console.print(comparison_renderable(event))

    def _stage(self, event: dict[str, Any]) -> None:
        # lazy: only the demo's stages need these; `dlm --help` does without
        from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

        from dlm.cli.dashboard import Budget, TrainingDashboard

        stage, status = event["stage"], event["status"]
        if stage == "train" and status == "done" and self.dashboard is not None:
            self.dashboard.finish(event.get("outcome", "complete"))
        self.close()
        if status == "running" and stage == "train":
            budget = Budget(event["budget_seconds"], event["trained_seconds"], event["seconds_per_step"])
            self.dashboard = TrainingDashboard(console, budget=budget).__enter__()
        elif status == "running" and stage == "distill":  # `--distill-minutes`: its own training run
            self.dashboard = TrainingDashboard(console, title="dlm distill", accuracy="agreement").__enter__()
        elif status == "running":
            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=console,
            )
            self.progress.start()
            self.task = self.progress.add_task(f"{stage}: {escape(event.get('detail', ''))}", total=None)
        else:
            mark, how = ("[cyan]↺[/]", "reused") if status == "reused" else ("[green]✓[/]", f"{event['seconds']:.1f} s")
            console.print(f"{mark} {stage:<9} {how:>8}  {escape(_stage_summary(event))}", highlight=False)
        if stage == "samples" and status == "done":
            console.print(samples_renderable(self.samples, console.is_terminal))
