"""Reproduce docs/benchmarks.md's "Sizing to a small corpus": `configs/cpu.toml` against a vocabulary
and model sized to 1-3 MB of English, each in the float32 steps of ten minutes on an AVX2-only CPU.

usage: python scripts/small_corpus_sizing.py WORK_DIR [--only NAME ...] [--dry-run]

Needs Debian's `bible-kjv` and `dict-jargon` (see scripts/small_corpora.py, which this runs first).
Each row trains at one thread (`OMP_NUM_THREADS=1`, so two rows can share 2 cores) and is evaluated
on every held-out block (`dlm eval RUN --data DATA --all --json`); a finished row is not run again.
Its steps are the 420 float32 steps of the demo's earlier CPU model (`configs/cpu.toml` at d_model
256, batch 64; 1.31 s a step: ten minutes of the AVX2-only CPU) scaled by `scripts/step_budget.py`'s
interleaved step times (one thread, this machine), and its warmup is a tenth of them; it validates
8 times on the first 4 batches of the held-out split (its own random numbers: the training is the
same without it), for the curve of the validation loss. The table is printed as Markdown at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    name: str
    corpus: str  # a folder of scripts/small_corpora.py's output
    split: tuple[str, ...]  # `dlm pack`'s validation options
    vocab: int
    d_model: int
    steps: int
    role: str  # "tune" or "report"


TUNE = ("--val-input", "kjv-tune/val")
HELD_OUT = ("--val-fraction", "0.05")
ROWS = [
    Row("tune-8192-d256", "kjv-tune/train", TUNE, 8192, 256, 420, "tune"),
    Row("tune-2048-d128", "kjv-tune/train", TUNE, 2048, 128, 1657, "tune"),
    Row("tune-4096-d128", "kjv-tune/train", TUNE, 4096, 128, 1387, "tune"),
    Row("jargon-8192-d256", "jargon", HELD_OUT, 8192, 256, 420, "report"),
    Row("jargon-4096-d128", "jargon", HELD_OUT, 4096, 128, 1387, "report"),
]


def run(command: list[str], dry_run: bool, stdout: Path | None = None) -> None:
    print("+", " ".join(command), f"> {stdout}" if stdout else "", flush=True)
    if dry_run:
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if stdout is None:
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
        return
    with open(stdout, "w") as handle:
        subprocess.run(command, check=True, env=env, stdout=handle)


def data_dir(work: Path, row: Row, dry_run: bool) -> Path:
    """The row's tokenizer and packed data (shared by rows of one corpus and vocabulary)."""

    corpus, data = work / row.corpus, work / "data" / f"{row.corpus.replace('/', '-')}-{row.vocab}"
    dlm = [sys.executable, "-m", "dlm"]
    if not (data / "train.bin").is_file():
        run(
            [
                *dlm,
                "tokenizer",
                "train",
                str(corpus),
                "--vocab-size",
                str(row.vocab),
                "--output",
                str(data / "tokenizer.json"),
                "--overwrite",
            ],
            dry_run,
        )
        split = [row.split[0], str(work / row.split[1]) if row.split[0] == "--val-input" else row.split[1]]
        run(
            [
                *dlm,
                "pack",
                str(corpus),
                "--tokenizer",
                str(data / "tokenizer.json"),
                "--seq-len",
                "64",
                *split,
                "--output",
                str(data),
                "--overwrite",
            ],
            dry_run,
        )
    return data


def train_and_evaluate(work: Path, row: Row, dry_run: bool) -> Path:
    data, output = data_dir(work, row, dry_run), work / "runs" / row.name
    report = output.with_suffix(".eval.json")
    if report.is_file():
        return report
    dlm = [sys.executable, "-m", "dlm"]
    sets = [
        # a fixed step count at batch 64 and 4 heads, as measured (configs/cpu.toml now plans its own
        # steps of a smaller model at batch 32)
        "training.budget_minutes=0",
        "training.batch_size=64",
        "model.n_heads=4",
        "training.precision=float32",
        f"training.max_steps={row.steps}",
        f"training.warmup_steps={row.steps // 10}",
        f"training.eval_interval={row.steps // 8}",
        "training.save_interval=100000",
        f"model.vocab_size={row.vocab}",
        f"model.d_model={row.d_model}",
        f"training.tokenizer={data / 'tokenizer.json'}",
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}",
        f"training.output_dir={output}",
    ]
    run(
        [
            *dlm,
            "train",
            "--config",
            str(ROOT / "configs" / "cpu.toml"),
            *[a for s in sets for a in ("--set", s)],
            "--json",
            "--overwrite",
        ],
        dry_run,
    )
    run([*dlm, "eval", str(output), "--data", str(data), "--all", "--json"], dry_run, stdout=report)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--only", action="append", choices=[row.name for row in ROWS])
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args()
    if not (args.work / "jargon").is_dir():
        run([sys.executable, str(ROOT / "scripts" / "small_corpora.py"), str(args.work)], args.dry_run)
    rows = [row for row in ROWS if not args.only or row.name in args.only]
    reports = {row.name: train_and_evaluate(args.work, row, args.dry_run) for row in rows}
    if args.dry_run:
        return 0
    print("| run | corpus (role) | vocabulary | d_model | steps | bits/byte | unigram | below unigram |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        report = json.loads(reports[row.name].read_text().splitlines()[-1])
        bits, error, unigram = report["bits_per_byte"], report["bits_per_byte_stderr"], report["unigram_bits_per_byte"]
        print(
            f"| {row.name} | {row.corpus} ({row.role}) | {row.vocab} | {row.d_model} | {row.steps:,} | "
            f"{bits:.3f} \u00b1 {error:.3f} | {unigram:.3f} | {unigram - bits:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
