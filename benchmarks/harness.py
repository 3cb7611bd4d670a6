"""Results as data: one JSON file per benchmark under benchmarks/results/, and docs/benchmarks.md rendered from them.

A result file holds what was run (the command line and its parameters), where and when (the machine
stamp of `dlm.bench.measure`), the figures a document may quote, and the raw rounds behind them. A
new run of a benchmark replaces its file; git keeps the history.

docs/benchmarks.md is rendered from `benchmarks/template.md`: a figure there is a placeholder
`{{NAME.KEY.PATH:FORMAT}}` naming a result file and a key of its figures (`{{pack.ratio.median:.2f}}`);
`{{NAME@}}` is that file's machine stamp and command, `{{NAME@PARAMETER}}` a parameter it ran with. A
placeholder without a result behind it is an error, so a documented figure cannot outlive its
measurement.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlm.bench.measure import MachineStamp, machine_stamp
from dlm.fileio import atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TEMPLATE = ROOT / "benchmarks" / "template.md"
DOCUMENT = ROOT / "docs" / "benchmarks.md"
BASELINES = ROOT / "benchmarks" / "baselines"

_PLACEHOLDER = re.compile(r"\{\{([a-z0-9_-]+)(@([a-z0-9_]*)|\.([A-Za-z0-9_.-]+)(?::([^}]*))?)\}\}")


@dataclass
class Run:
    """One benchmark run in progress: its name, its command and parameters, and the machine at its start."""

    name: str
    parameters: dict[str, Any]
    stamp: MachineStamp

    def save(self, figures: dict[str, Any], rounds: dict[str, Any] | None = None, results: Path = RESULTS) -> Path:
        """Write the result file (atomically) and return its path."""

        results.mkdir(parents=True, exist_ok=True)
        # The threads as the measurement ran them: a benchmark may set its own after the stamp.
        stamp = dataclasses.replace(self.stamp, threads=torch.get_num_threads())
        payload = {
            "benchmark": self.name,
            "command": command_line(),
            "parameters": portable(self.parameters),
            "machine": stamp.to_dict(),
            "figures": portable(figures),
            "rounds": portable(rounds or {}),
        }
        return atomic_write_json(results / f"{self.name}.json", payload)


def progress(line: str) -> None:
    """A benchmark's progress line, on stderr beside its result on stdout."""

    print(line, file=sys.stderr, flush=True)


def portable(value: Any) -> Any:
    """`value` with paths inside the repository made relative to it: a result file names no machine's folders."""

    if isinstance(value, dict):
        return {key: portable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [portable(item) for item in value]
    if isinstance(value, str) and value.startswith(f"{ROOT}/"):
        return value[len(str(ROOT)) + 1 :]
    return value


def start(name: str, **parameters: Any) -> Run:
    """Stamp the machine now, before the measurement disturbs its load average."""

    return Run(name=name, parameters=parameters, stamp=machine_stamp(ROOT))


# The environment that changes what a benchmark measures: the thread count, and the caps that run another
# CPU's kernels (docs/reproducibility.md). Set, they lead the recorded command, as a person would type them.
SETTINGS = (
    "OMP_NUM_THREADS",
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
)


def command_line() -> str:
    """The command that reproduces this run, as a person would type it from the repository root."""

    arguments = sys.argv[1:] if Path(sys.argv[0]).name in ("__main__.py", "-m") else sys.argv
    settings = [f"{name}={os.environ[name]}" for name in SETTINGS if os.environ.get(name)]
    return " ".join([*map(shlex.quote, settings), shlex.join(["python", "-m", "benchmarks", *portable(arguments)])])


def load(name: str, results: Path = RESULTS) -> dict[str, Any]:
    path = results / f"{name}.json"
    try:
        loaded: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise KeyError(f"no result file {path.name}: run `python -m benchmarks {name}` to measure it") from None
    return loaded


def lookup(result: dict[str, Any], key: str) -> Any:
    """The figure at a dotted path of a result's figures (list items by index)."""

    value: Any = result["figures"]
    for part in key.split("."):
        if isinstance(value, list) and part.isdigit():
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise KeyError(f"{result['benchmark']}.json has no figure {key!r}")
    return value


def provenance(result: dict[str, Any]) -> str:
    """What a document says under a figure: the command and the machine stamp."""

    stamp = MachineStamp(**result["machine"])
    return f"`{result['command']}` — {stamp.summary()}"


def render(template: str, results: Path = RESULTS) -> str:
    """The template with every placeholder filled from the result files (KeyError names a missing one)."""

    cache: dict[str, dict[str, Any]] = {}

    def fill(match: re.Match[str]) -> str:
        name, marker, parameter, key, spec = match.groups()
        if name not in cache:
            cache[name] = load(name, results)
        if marker.startswith("@"):
            if not parameter:
                return provenance(cache[name])
            if parameter not in cache[name]["parameters"]:
                raise KeyError(f"{name}.json has no parameter {parameter!r}")
            return str(cache[name]["parameters"][parameter])
        value = lookup(cache[name], key)
        return format(value, spec or "")

    return _PLACEHOLDER.sub(fill, template)


def render_document(results: Path = RESULTS, template: Path = TEMPLATE, document: Path = DOCUMENT) -> Path:
    """Write docs/benchmarks.md from the template and the result files."""

    header = "<!-- Rendered by `python -m benchmarks render-docs` from benchmarks/template.md: edit that. -->\n"
    return atomic_write_text(document, header + render(template.read_text(encoding="utf-8"), results))
