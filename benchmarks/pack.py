"""`dlm pack` against the raw-tokenizer baseline (benchmarks/baselines/tokenize_lines.py), process by process.

Both read the bundled corpus decompressed to plain files and tokenize it with the same tokenizer;
`dlm pack` also writes train.bin and its metadata, and its figure includes the CLI's start. Each round
runs the two whole processes one after the other (the order alternating), and the ratio is the
baseline's process wall time over dlm's in the same round: throughput of `dlm pack` as a share of
the baseline's.
"""

from __future__ import annotations

import gzip
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks import harness
from dlm.assets import shakespeare_files
from dlm.bench.measure import (
    Timing,
    interleaved,
    round_ratios,
    self_timed,
    spread,
    timed_process,
)


def _corpus(directory: Path) -> tuple[list[Path], int]:
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for source in shakespeare_files("all"):
        target = directory / source.name.removesuffix(".gz")
        target.write_bytes(gzip.decompress(source.read_bytes()))
        files.append(target)
    return files, sum(path.stat().st_size for path in files)


def pack(
    rounds: Annotated[int, typer.Option(help="Interleaved process pairs.")] = 5,
    seq_len: Annotated[int, typer.Option(help="dlm pack --seq-len.")] = 256,
    vocab_size: Annotated[int, typer.Option(help="The tokenizer both use.")] = 8192,
    results: Annotated[Path, typer.Option(help="Directory of the result file.")] = harness.RESULTS,
) -> None:
    """dlm pack's throughput as a share of the raw tokenizer's, whole processes, interleaved."""

    run = harness.start("pack", rounds=rounds, seq_len=seq_len, vocab_size=vocab_size)
    with tempfile.TemporaryDirectory(prefix="dlm-bench-pack-") as scratch:
        work = Path(scratch)
        files, corpus_bytes = _corpus(work / "plays")
        tokenizer = work / "tokenizer.json"
        dlm = [sys.executable, "-m", "dlm"]
        timed_process([*dlm, "tokenizer", "train", *map(str, files), "-n", str(vocab_size), "-o", str(tokenizer)])
        output = work / "packed"
        commands = {
            "baseline": [
                sys.executable,
                str(harness.BASELINES / "tokenize_lines.py"),
                str(tokenizer),
                *map(str, files),
            ],
            "dlm_pack": [
                *dlm,
                "pack",
                *map(str, files),
                "-t",
                str(tokenizer),
                "-l",
                str(seq_len),
                "-o",
                str(output),
                "--json",
            ],
        }

        def runner(name: str) -> Callable[[], Timing]:
            def go() -> Timing:
                shutil.rmtree(output, ignore_errors=True)
                return timed_process(commands[name])[0]

            return go

        timings = interleaved(
            {name: runner(name) for name in commands}, rounds, timer=self_timed, progress=harness.progress
        )
    walls = {name: [t.wall_s for t in runs] for name, runs in timings.items()}
    cpus = {name: [t.cpu_s for t in runs] for name, runs in timings.items()}
    ratios = round_ratios(walls["baseline"], walls["dlm_pack"])
    figures: dict[str, Any] = {
        "corpus_bytes": corpus_bytes,
        "ratio": spread(ratios),
        "mb_per_s": {name: statistics.median(corpus_bytes / w / 1e6 for w in wall) for name, wall in walls.items()},
        "cpu_s": {name: statistics.median(cpu) for name, cpu in cpus.items()},
    }
    path = run.save(figures, {"wall_s": walls, "cpu_s": cpus}, results=results)
    typer.echo(
        f"dlm pack / baseline throughput: median {figures['ratio']['median']:.2f} over {rounds} rounds "
        f"({figures['ratio']['min']:.2f} to {figures['ratio']['max']:.2f}); wrote {path}"
    )
