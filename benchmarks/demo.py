"""The demo's quality on this machine's clock: `dlm demo` and its autoregressive twin, each alone.

`dlm demo --minutes M` trains the bundled corpus's CPU model and reports bits per byte on the held-out
plays. Its twin is the same config with `block_size = 1` and causal attention (a GPT-style model,
exact left-to-right likelihood), trained on the same data for the same minutes: the judge that
`python -m benchmarks generation` scores the demo model's samples with, and the autoregressive
reference of the demo's bits per byte. The two train one after the other, each with the machine to
itself (as far as other work allows).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks import harness
from dlm.bench.measure import timed_process

DEFAULT_OUTPUT = harness.ROOT / "runs" / "bench-demo"


def twin_config(directory: Path) -> Path:
    """configs/cpu.toml (the demo's CPU recipe) with block_size = 1 and causal attention."""

    text = (harness.ROOT / "configs" / "cpu.toml").read_text(encoding="utf-8")
    if "\n[model]\n" not in text:
        raise RuntimeError("configs/cpu.toml has no [model] table to make the twin from")
    text = text.replace("\n[model]\n", '\n[model]\nblock_size = 1\nattention = "causal"\n', 1)
    path = directory / "twin.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _train(output: Path, minutes: float, config: Path | None) -> dict[str, Any]:
    command = [sys.executable, "-m", "dlm", "demo", "--output", str(output), "--minutes", str(minutes), "--json"]
    if config is not None:
        command += ["--config", str(config)]
    timing, _ = timed_process(command)
    report = json.loads((output / "run" / "eval.json").read_text(encoding="utf-8"))
    context = report.get("context", {})
    return {
        "bits_per_byte": report["bits_per_byte"],
        "bits_per_byte_stderr": report.get("bits_per_byte_stderr"),
        "unigram_bits_per_byte": context.get("unigram_bits_per_byte"),
        "steps": context.get("step"),
        "wall_s": timing.wall_s,
        "cpu_s": timing.cpu_s,
        "model": str(output / "model"),
    }


def demo(
    minutes: Annotated[float, typer.Option(help="Training budget of each model.")] = 10.0,
    output: Annotated[Path, typer.Option(help="Where the two runs go (replaced).")] = DEFAULT_OUTPUT,
    twin: Annotated[bool, typer.Option(help="Also train the autoregressive twin.")] = True,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """dlm demo's bits per byte in --minutes, and its autoregressive twin's on the same clock."""

    run = harness.start("demo", minutes=minutes, twin=twin)
    shutil.rmtree(output, ignore_errors=True)
    output.mkdir(parents=True)
    figures = {"diffusion": _train(output / "demo", minutes, None)}
    typer.echo(f"demo: {figures['diffusion']['bits_per_byte']:.3f} bits/byte in {minutes} min")
    if twin:
        # The same tokenizer and packed data: the demo reuses finished stages it finds in place.
        shutil.copytree(output / "demo" / "data", output / "twin" / "data")
        figures["autoregressive"] = _train(output / "twin", minutes, twin_config(output))
        typer.echo(f"twin: {figures['autoregressive']['bits_per_byte']:.3f} bits/byte in {minutes} min")
    typer.echo(f"wrote {run.save(figures, results=results)}")
