"""`python -m benchmarks NAME ...`: every dlm benchmark behind one entry point (`--help` lists them)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks import harness

app = typer.Typer(
    help="dlm's benchmarks: each writes benchmarks/results/NAME.json; render-docs writes docs/benchmarks.md.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# The registry: subcommand name -> "module:function" of this package, imported when the app starts.
BENCHMARKS = {
    "pack": "pack:pack",
    "train-step": "train_step:train_step",
    "demo": "demo:demo",
    "budget": "budget:budget",
    "generation": "generation:generation",
    "serve": "serve:serve",
    "serve-pass-cost": "serve:serve_pass_cost",
    "serve-load": "serve_load:serve_load",
    "checkpoint": "checkpoint:checkpoint",
    "token-draw": "sampling_cost:token_draw",
    "threshold-cost": "sampling_cost:threshold_cost",
    "forward-share": "sampling_cost:forward_share",
    "cpu-precision": "cpu_precision:cpu_precision",
    "cpu-inference": "cpu_inference:cpu_inference",
    "elbo-variance": "elbo_variance:elbo_variance",
    "rl-estimators": "rl:rl_estimators",
    "rl-learning": "rl:rl_learning",
    "distill": "distill:distill",
    "lora": "lora:lora",
    "load-memory": "load_memory:load_memory",
    "gpu-throughput": "gpu.throughput:gpu_throughput",
    "gpu-quality": "gpu.quality:gpu_quality",
    "gpu-generate": "gpu.quality:gpu_generate",
    "gpu-report": "gpu.report:gpu_report",
}


def register(names: list[str]) -> None:
    """Add these benchmarks' commands to the app, importing only their modules."""

    for name in names:
        module, function = BENCHMARKS[name].split(":")
        app.command(name)(getattr(importlib.import_module(f"benchmarks.{module}"), function))


@app.command("render-docs")
def render_docs() -> None:
    """Write docs/benchmarks.md from benchmarks/template.md and the result files."""

    try:
        path = harness.render_document()
    except KeyError as missing:
        typer.echo(f"error: {missing.args[0]}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path}")


@app.command("cpu-table")
def cpu_table(
    minutes: Annotated[float, typer.Option(help="Training budget of the demo and of its twin.")] = 10.0,
) -> None:
    """The CPU figures of the docs in one go: pack, training step, the demo and its twin, the generation frontier.

    About 2 x --minutes + 4 minutes on 2 cores; each part writes its own result file, then the docs
    are rendered.
    """

    parts = [["pack"], ["train-step"], ["demo", "--minutes", str(minutes)], ["generation"]]
    started = time.monotonic()
    for index, part in enumerate(parts, 1):
        typer.echo(f"[{index}/{len(parts)}, {time.monotonic() - started:.0f} s] python -m benchmarks {' '.join(part)}")
        completed = subprocess.run([sys.executable, "-m", "benchmarks", *part], cwd=harness.ROOT)
        if completed.returncode != 0:
            typer.echo(f"error: `python -m benchmarks {' '.join(part)}` failed (exit {completed.returncode})", err=True)
            raise typer.Exit(completed.returncode)
    for line in cpu_table_summary():
        typer.echo(line)
    render_docs()
    typer.echo(f"done in {time.monotonic() - started:.0f} s")


def cpu_table_summary(results: Path = harness.RESULTS) -> list[str]:
    """The CPU table's ratios and figures, as measured by the run that just wrote them."""

    pack, step = harness.load("pack", results)["figures"], harness.load("train-step", results)["figures"]
    demo, generation = harness.load("demo", results)["figures"], harness.load("generation", results)["figures"]
    lines = [f"dlm pack / raw tokenizer throughput: {pack['ratio']['median']:.2f}x"]
    for key, figures in sorted(step.items()):
        lines.append(f"training step, dlm / plain PyTorch, {key.replace('_', ' ')}: {figures['ratio']['median']:.2f}x")
    lines.append(f"demo: {demo['diffusion']['bits_per_byte']:.3f} bits/byte in {demo['diffusion']['steps']} steps")
    if "autoregressive" in demo:
        lines.append(f"its autoregressive twin: {demo['autoregressive']['bits_per_byte']:.3f} bits/byte")
    fastest = generation["fastest_within_bounds"]
    if fastest is not None:
        lines.append(
            f"generation: {generation['tokens_per_pass_within_bounds']:.0f} tokens per pass within "
            f"{generation['ppl_bound']:.0%} of the default's judge perplexity, {fastest['cpu_speedup']:.2f}x its speed"
        )
    return lines


if __name__ == "__main__":
    # One benchmark's run imports only its own module (a GPU machine's image may lack what another
    # needs); --help and the other commands see them all.
    chosen = sys.argv[1] if len(sys.argv) > 1 else ""
    register([chosen] if chosen in BENCHMARKS else list(BENCHMARKS))
    app()
else:
    register(list(BENCHMARKS))
