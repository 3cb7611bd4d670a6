"""A time budget's schedule on a machine that gets busy: `dlm demo --minutes M`, run after run.

The budget plans the learning-rate schedule from the pace it measures (`dlm.train.budget`). What
matters is how it ends: complete, its learning rate on the floor, with as many steps as the minutes
allowed, and the bits per byte that buys. `--busy-after F` starts a process that keeps one core
busy once F of each run's budget has gone by (the pace then drops), the case a plan made early
gets wrong.

`--against REF` runs the same demo, interleaved run by run, with dlm as it was at another commit
(started in a detached `git worktree` of it, which `python -m dlm` then imports), so a schedule
change is measured against what it replaces on the same machine at the same time. The first run's
tokenizer and packed data are copied into every later run, which then only trains, evaluates and
exports.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks import harness
from dlm.bench.measure import timed_process

DEFAULT_OUTPUT = harness.ROOT / "runs" / "bench-budget"
BURNER = "while True:\n    pass\n"  # one core kept busy


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[tuple[Path, str]]:
    """A detached worktree of this repository at `ref` (removed afterwards), and the commit it names."""

    verify = ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"]
    commit = subprocess.run(verify, cwd=harness.ROOT, check=True, capture_output=True, text=True).stdout.strip()
    directory = Path(tempfile.mkdtemp(prefix="dlm-against-"))
    try:
        add = ["git", "worktree", "add", "--detach", str(directory / "tree"), commit]
        subprocess.run(add, cwd=harness.ROOT, check=True, capture_output=True)
        yield directory / "tree", commit
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(directory / "tree")], cwd=harness.ROOT, check=False)
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def busy_after(seconds: float | None) -> Iterator[None]:
    """A process that keeps one core busy from `seconds` on, until the block ends (None: never)."""

    if seconds is None:
        yield
        return
    done = threading.Event()
    burner: list[subprocess.Popen[bytes]] = []

    def start() -> None:
        if not done.wait(seconds):
            burner.append(subprocess.Popen([sys.executable, "-c", BURNER]))

    timer = threading.Thread(target=start, daemon=True)
    timer.start()
    try:
        yield
    finally:
        done.set()
        timer.join()
        for process in burner:
            process.kill()
            process.wait()


def dlm_source(source: Path) -> tuple[dict[str, str], Path]:
    """The environment and working directory in which `python -m dlm` imports dlm from `source` (a
    checkout): `-m` puts the working directory first on the path, ahead of PYTHONPATH and of the
    installed package. Checked, as a measurement of the wrong code would look like any other."""

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(source), os.environ.get("PYTHONPATH")]))}
    imported = subprocess.run(
        [sys.executable, "-c", "import dlm; print(dlm.__file__)"], env=env, cwd=source, capture_output=True, text=True
    )
    found = imported.stdout.strip()
    if imported.returncode != 0 or not Path(found).resolve().is_relative_to(source.resolve()):
        raise RuntimeError(f"dlm imports from {found or imported.stderr.strip()!r}, not from {source}")
    return env, source


def demo_run(
    output: Path, minutes: float, source: Path, busy: float | None, config: Path | None = None
) -> dict[str, Any]:
    """One `dlm demo` with dlm from `source` (a checkout), of `config` if given, and how its schedule ended."""

    env, cwd = dlm_source(source)
    command = [sys.executable, "-m", "dlm", "demo", "--output", str(output), "--minutes", str(minutes), "--json"]
    if config is not None:
        command += ["--config", str(config)]
    with busy_after(None if busy is None else busy * minutes * 60):
        timing, stdout = timed_process(command, env=env, cwd=cwd)
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    trained = [e for e in events if e.get("event") == "demo_stage" and e.get("stage") == "train"][-1]
    report = json.loads((output / "run" / "eval.json").read_text(encoding="utf-8"))
    return {
        "bits_per_byte": report["bits_per_byte"],
        "steps": trained["step"],
        "max_steps": trained["max_steps"],
        "outcome": trained["outcome"],
        "rate_left": _rate_left(trained, events),
        "refits": sum(e.get("event") == "demo_replan" for e in events),
        "wall_s": timing.wall_s,
    }


def _rate_left(trained: dict[str, Any], events: list[dict[str, Any]]) -> float:
    """How far above its floor the learning rate ended, as a share of the peak-to-floor range (0 for
    a constant rate)."""

    rates = [e["learning_rate"] for e in events if e.get("event") == "train"]  # the highest is the peak's
    peak, floor = max(rates, default=0.0), trained["min_learning_rate"]
    return 0.0 if peak <= floor else (trained["learning_rate"] - floor) / (peak - floor)


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    bits = [run["bits_per_byte"] for run in runs]
    stderr = statistics.stdev(bits) / math.sqrt(len(bits)) if len(bits) > 1 else None
    return {
        "bits_per_byte": statistics.fmean(bits),
        "bits_per_byte_stderr": stderr,
        "steps": statistics.fmean(run["steps"] for run in runs),
        "complete": sum(run["outcome"] == "complete" for run in runs),
        "runs": len(runs),
        "rate_left_max": max(run["rate_left"] for run in runs),
        "refits": statistics.fmean(run["refits"] for run in runs),
    }


def budget(
    minutes: Annotated[float, typer.Option(help="Each demo's budget.")] = 3.0,
    repeats: Annotated[int, typer.Option(help="Runs per arm.")] = 3,
    busy: Annotated[
        float | None, typer.Option("--busy-after", help="Share of each budget after which one core is kept busy.")
    ] = None,
    against: Annotated[
        str | None, typer.Option(help="Also run dlm as of this commit (or any git ref), interleaved.")
    ] = None,
    output: Annotated[Path, typer.Option(help="Where the runs go (replaced).")] = DEFAULT_OUTPUT,
    config: Annotated[
        Path | None, typer.Option(help="Train this config in every demo (default: the demo's own recipe).")
    ] = None,
    name: Annotated[str, typer.Option(help="Name of the result file.")] = "budget",
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """How a --minutes schedule ends, run after run, on a machine that may get busy midway."""

    run = harness.start(
        name,
        minutes=minutes,
        repeats=repeats,
        busy_after=busy,
        against=against,
        config=None if config is None else str(config),
    )
    output = output.resolve()  # the runs start in each checkout's directory
    config = None if config is None else config.resolve()
    shutil.rmtree(output, ignore_errors=True)
    output.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        arms: dict[str, Path] = {"current": harness.ROOT}
        commit = None
        if against is not None:
            source, commit = stack.enter_context(checkout(against))
            arms["against"] = source
        runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
        data = output / "data"  # the tokenizer and packed data of the first run, which every later run reuses
        for index in range(repeats):
            order = list(arms) if index % 2 == 0 else list(reversed(arms))  # neither always goes first
            for arm in order:
                directory = output / f"{arm}-{index}"
                if data.exists():
                    shutil.copytree(data, directory / "data")
                harness.progress(f"budget: {arm} run {index + 1} of {repeats}")
                runs[arm].append(demo_run(directory, minutes, arms[arm], busy, config))
                if not data.exists():
                    shutil.copytree(directory / "data", data)
                shutil.rmtree(directory, ignore_errors=True)  # checkpoints and export: the figures are taken
    figures: dict[str, Any] = {arm: _summary(items) for arm, items in runs.items()}
    if commit is not None:
        figures["against"]["commit"] = commit[:12]
    for arm, summary in figures.items():
        typer.echo(
            f"{arm}: {summary['bits_per_byte']:.3f} bits/byte, {summary['complete']}/{summary['runs']} complete, "
            f"{summary['steps']:.0f} steps"
        )
    typer.echo(f"wrote {run.save(figures, rounds=runs, results=results)}")
