"""Validation bits/byte against block size (and clipped noise range) at one model size and budget.

usage: python scripts/block_size_ablation.py [--steps N] [--variants 1,4,64,16,4@0.3-0.8] [--seed S] [--jobs 2]
       [--out DIR] [--d-model D] [--n-layers N] [--mc-samples K] [--paired] [--json]

Every variant trains the same small model on the bundled Shakespeare split packed at 64 tokens with
the 8192-token tokenizer (the same batches and noise seed), then `dlm eval` scores the first 512
held-out sequences with K Monte Carlo samples. A variant is a block size B (64, the whole sequence,
is plain masked diffusion; 1 is autoregressive), optionally with a clipped training noise range
`B@low-high` (`training.clip_mask_min/max`). Each process runs on one thread, at most --jobs at a
time, niced, so the comparison is fair on a shared machine; only the bits/byte are compared, never
the wall times. Finished variants (an eval JSON in their folder) are not rerun. The output is a
markdown table of the validation figures and one of the training loss every tenth of the run (the
exact NLL for B = 1, the one-sample ELBO estimate otherwise), which shows how the gaps move with
the budget. With --paired every pair of variants is also compared on the same sequences: each
model's per-sequence ELBO (K samples, in this process, one thread) and the mean of the differences
with its standard error, far smaller than the unpaired errors of the first table because the
sequences' own difficulty cancels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 64


@dataclass(frozen=True)
class Variant:
    block_size: int
    clip: tuple[float, float] = (0.0, 1.0)
    seed: int | None = None  # None: the config's training seed

    @property
    def name(self) -> str:
        low, high = self.clip
        name = f"B{self.block_size}" + ("" if self.clip == (0.0, 1.0) else f"-clip{low:g}-{high:g}")
        return name if self.seed is None else f"{name}-seed{self.seed}"


def parse_variant(text: str, seed: int | None = None) -> Variant:
    block, _, clip = text.partition("@")
    if not clip:
        return Variant(int(block), seed=seed)
    low, high = clip.split("-")
    return Variant(int(block), (float(low), float(high)), seed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--variants", default="1,4,64,16,4@0.3-0.8", help="B or B@low-high, comma-separated")
    parser.add_argument("--seed", type=int, default=None, help="training seed (data order and noise) of every variant")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "block-size-ablation")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--mc-samples", type=int, default=8)
    parser.add_argument("--paired", action="store_true", help="also compare every pair on the same sequences")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON, not a markdown table")
    return parser.parse_args(argv)


def prepare_data(out: Path) -> Path:
    """The bundled corpus and an 8192-token tokenizer trained on it, packed at SEQ_LEN tokens (once)."""

    from dlm.assets import shakespeare_files

    data = out / "data"
    tokenizer = data / "tokenizer.json"
    if not tokenizer.exists():  # the demo's tokenizer: byte-level BPE of 8192 tokens on the training works
        from dlm.data.tokenizer import train_tokenizer

        train_tokenizer(shakespeare_files("train"), 8192, tokenizer)
    if not (data / "val.bin").exists():
        from dlm.data.pack import pack_corpus

        pack_corpus(shakespeare_files("train"), tokenizer, SEQ_LEN, data, val_inputs=shakespeare_files("val"))
    return data


def train_command(args: argparse.Namespace, variant: Variant, data: Path, run: Path) -> list[str]:
    low, high = variant.clip
    overrides = {
        "model.d_model": args.d_model,
        "model.n_layers": args.n_layers,
        "model.n_heads": 4,
        "model.max_seq_len": SEQ_LEN,
        "model.block_size": variant.block_size,
        "training.batch_size": args.batch_size,
        "training.learning_rate": args.learning_rate,
        "training.warmup_steps": max(1, args.steps // 20),
        "training.max_steps": args.steps,
        "training.eval_interval": args.steps,
        "training.save_interval": args.steps,
        "training.eval_batches": 2,
        "training.log_interval": max(1, args.steps // 10),
        "training.clip_mask_min": low,
        "training.clip_mask_max": high,
        **({} if variant.seed is None else {"training.seed": variant.seed}),
        "training.device": "cpu",
        "training.precision": "float32",
        "training.tokenizer": data / "tokenizer.json",
        "training.train_data": data / "train.bin",
        "training.val_data": data / "val.bin",
        "training.output_dir": run,
    }
    command = [sys.executable, "-m", "dlm", "train", "--config", str(ROOT / "configs" / "shakespeare.toml"), "--json"]
    for key, value in overrides.items():
        command += ["--set", f"{key}={value}"]
    for setting in getattr(args, "extra", []):  # more `key=value` settings (scripts/document_attention.py)
        command += ["--set", setting]
    return command


def run_variant(args: argparse.Namespace, variant: Variant, data: Path) -> dict[str, Any]:
    run = args.out / variant.name
    result = run / "eval.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread each: --jobs processes share the cores
    if not result.exists():
        run.mkdir(parents=True, exist_ok=True)
        with open(run / "train.log", "w") as log:
            subprocess.run(
                ["nice", "-n", "10", *train_command(args, variant, data, run), "--overwrite"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                check=True,
                cwd=ROOT,
            )
        evaluate = [
            "nice",
            "-n",
            "10",
            sys.executable,
            "-m",
            "dlm",
            "eval",
            str(run),
            "--data",
            str(data),
            "--batches",
            "8",
            "--batch-size",
            "64",
            "--mc-samples",
            str(args.mc_samples),
            "--device",
            "cpu",
            "--json",
            "-o",
            str(result),
        ]
        with open(run / "eval.log", "w") as log:
            subprocess.run(evaluate, stdout=log, stderr=subprocess.STDOUT, env=env, check=True, cwd=ROOT)
    report = json.loads(result.read_text())
    return {
        "block_size": variant.block_size,
        "clip": list(variant.clip),
        "bits_per_byte": report["bits_per_byte"],
        "bits_per_byte_stderr": report["bits_per_byte_stderr"],
        "nll": report["nll"],
        "nll_mc_stderr": report["nll_mc_stderr"],
        "unigram_bits_per_byte": report.get("unigram_bits_per_byte"),  # the same sequences' unigram level
        "train_losses": train_losses(run / "train.log"),
    }


def train_losses(log: Path) -> list[tuple[int, float]]:
    """(step, training loss) of each logged window of the run."""

    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [(event["step"], event["loss"]) for event in events if event.get("event") == "train"]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| block size | clip | bits/byte | ± s.e. | NLL bound (nats/token) | Monte Carlo s.e. |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        low, high = row["clip"]
        lines.append(
            f"| {row['block_size']} | [{low:g}, {high:g}] | {row['bits_per_byte']:.3f} | "
            f"{row['bits_per_byte_stderr']:.3f} | {row['nll']:.3f} | {row['nll_mc_stderr']:.3f} |"
        )
    unigram = rows[0].get("unigram_bits_per_byte")
    if unigram is not None:
        lines += ["", f"Unigram level of the same sequences: {unigram:.3f} bits/byte."]
    steps = [step for step, _ in rows[0]["train_losses"]]
    lines += [
        "",
        "| block size | clip | " + " | ".join(f"step {step}" for step in steps) + " |",
        "|---|---|" + "---|" * len(steps),
    ]
    for row in rows:
        low, high = row["clip"]
        losses = " | ".join(f"{loss:.3f}" for _, loss in row["train_losses"])
        lines.append(f"| {row['block_size']} | [{low:g}, {high:g}] | {losses} |")
    return "\n".join(lines)


def sequence_nlls(run: Path, data: Path, mc_samples: int) -> list[float]:
    """Per-sequence ELBO (nats/token) of the 512 sequences `dlm eval` scores, cached in the run."""

    cached = run / "sequence_nll.json"
    if cached.exists():
        return list(json.loads(cached.read_text()))
    import torch

    import dlm
    from dlm.data.dataset import load_packed_dataset
    from dlm.diffusion.objective import elbo_nll
    from dlm.diffusion.schedules import DEFAULT_MASK_EPS
    from dlm.model.denoiser import block_size, masked_logits

    torch.set_num_threads(1)
    model, _ = dlm.load(run)
    config = model.config
    blocks = block_size(config)
    dataset = load_packed_dataset(data, SEQ_LEN, split="val")
    values: list[float] = []
    with torch.no_grad():
        for start in range(0, 512, 64):
            clean = torch.stack([torch.as_tensor(dataset[i]) for i in range(start, start + 64)])

            def logits(noisy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                return masked_logits(model, noisy, mask, clean)  # noqa: B023 - used within the iteration

            generator = torch.Generator().manual_seed(start)
            nll, _ = elbo_nll(
                logits, clean, config.mask_token_id, mc_samples, DEFAULT_MASK_EPS, generator, block_size=blocks
            )
            values += nll.double().tolist()
    cached.write_text(json.dumps(values))
    return values


def paired_table(args: argparse.Namespace, variants: list[Variant], data: Path) -> str:
    """Mean difference of bits/byte (row minus column variant) on the same sequences, ± its standard error."""

    import math
    import statistics

    report = json.loads((args.out / variants[0].name / "eval.json").read_text())
    to_bits = report["tokens"] / report["bytes"] / math.log(2)  # nats/token -> bits/byte, equal-length sequences
    nlls = {variant.name: sequence_nlls(args.out / variant.name, data, args.mc_samples) for variant in variants}
    lines = ["| variant | minus | difference (bits/byte) | ± paired s.e. |", "|---|---|---|---|"]
    for i, first in enumerate(variants):
        for second in variants[i + 1 :]:
            differences = [(a - b) * to_bits for a, b in zip(nlls[first.name], nlls[second.name], strict=True)]
            error = statistics.stdev(differences) / math.sqrt(len(differences))
            lines.append(f"| {first.name} | {second.name} | {statistics.fmean(differences):+.3f} | {error:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out = args.out.resolve()
    variants = [parse_variant(text, args.seed) for text in args.variants.split(",")]
    data = prepare_data(args.out)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(lambda variant: run_variant(args, variant, data), variants))
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    if args.paired:
        os.nice(10)  # the per-sequence passes run here, behind other work
        print("\n" + paired_table(args, variants, data))


if __name__ == "__main__":
    main()
