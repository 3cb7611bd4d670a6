"""Validation bits/byte with and without document-aware attention, on long and on short documents.

usage: python scripts/document_attention.py [--steps N] [--jobs 2] [--out DIR] [--d-model D] [--n-layers N]
       [--mc-samples K] [--set key=value ...]
       python scripts/document_attention.py --pace [--rounds N]

Two corpora from the bundled Shakespeare, each packed at 64 tokens with its own 8192-token tokenizer:
- `plays`: the demo's data, one document per play (a packed row rarely crosses a document's end);
- `speeches`: every speech of the same plays as a document of its own (about 60 tokens on average),
  shuffled with a fixed seed so that the documents sharing a packed row are unrelated, as in a
  corpus of short texts (the validation plays' speeches are held out).

On each corpus the same model trains twice with the same batches and noise, with attention over
the whole packed row and with `model.document_separator_id` (each position sees its own document
only), and `dlm eval` scores the held-out sequences the way each was trained. The paired column
compares the two on the same sequences (per-sequence ELBO, K samples). One thread per process, at
most --jobs at a time, niced: only bits/byte are compared, never times. `--pace` instead times a
training step (forward and backward, configs/cpu.toml's model and batch, float32) with and without the
document mask, interleaved in this process, and prints the ratio.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from block_size_ablation import SEQ_LEN, Variant, prepare_data, run_variant, sequence_nlls

ROOT = Path(__file__).resolve().parents[1]
SEPARATOR = 0  # <|endoftext|> in dlm's tokenizers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "document-attention")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--mc-samples", type=int, default=8)
    parser.add_argument("--pace", action="store_true", help="time a training step with and without the mask")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--set", dest="settings", action="append", default=[], help="a config setting of both")
    args = parser.parse_args(argv)
    args.seed, args.paired, args.json = None, True, False  # what block_size_ablation's helpers read
    return args


def speeches(path: Path) -> list[str]:
    """The speeches of one play: paragraphs (blank-line separated) that open with a speaker's name."""

    text = gzip.decompress(path.read_bytes()).decode("utf-8")
    found = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.strip().splitlines()
        if len(lines) >= 2 and lines[0].isupper() and lines[0].endswith("."):
            found.append("\n".join(lines))
    return found


def prepare_speeches(out: Path) -> Path:
    """Every speech a JSONL record, shuffled, training plays apart from validation plays; packed once."""

    from dlm.assets import shakespeare_files
    from dlm.data.pack import pack_corpus
    from dlm.data.tokenizer import train_tokenizer

    data = out / "speeches-data"
    if (data / "val.bin").exists():
        return data
    data.mkdir(parents=True, exist_ok=True)
    files = {}
    for split in ("train", "val"):
        records = [speech for path in shakespeare_files(split) for speech in speeches(Path(path))]
        random.Random(0).shuffle(records)
        files[split] = data / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps({"text": text}) + "\n" for text in records), encoding="utf-8")
    train_tokenizer([files["train"]], 8192, data / "tokenizer.json")
    pack_corpus([files["train"]], data / "tokenizer.json", SEQ_LEN, data, val_inputs=[files["val"]])
    return data


def pace_ratio(rounds: int) -> float:
    """Median time of a training step with the document mask over one without, interleaved."""

    import time

    import torch

    from dlm.config.schema import load_config
    from dlm.model.attention import document_ids
    from dlm.model.transformer import DiffusionTransformer

    torch.manual_seed(0)
    experiment = load_config(ROOT / "configs" / "cpu.toml", ["training.precision=float32"])
    model = DiffusionTransformer(experiment.model)
    tokens = torch.randint(3, experiment.model.vocab_size, (experiment.training.batch_size, SEQ_LEN))
    tokens[:, ::40] = SEPARATOR  # documents of 40 tokens, about the speeches' length
    noisy = torch.where(torch.rand(tokens.shape) < 0.5, torch.ones_like(tokens), tokens)
    documents = document_ids(tokens, SEPARATOR)
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(rounds + 2):  # the first two rounds warm up
        for aware in (False, True) if round_ % 2 else (True, False):
            start = time.perf_counter()
            logits = model(noisy, noisy == 1, documents=documents if aware else None)
            logits.logsumexp(-1).mean().backward()
            if round_ >= 2:
                times[aware].append(time.perf_counter() - start)
    return statistics.median(times[True]) / statistics.median(times[False])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.pace:
        print(f"a training step with the document mask takes {pace_ratio(args.rounds):.3f}x the time of one without")
        return
    args.out = args.out.resolve()
    corpora = {"plays": prepare_data(args.out / "plays"), "speeches": prepare_speeches(args.out)}
    whole_row = Variant(SEQ_LEN)

    def run(corpus: str, documents: bool) -> dict[str, Any]:
        setting = argparse.Namespace(**vars(args))
        setting.out = args.out / corpus / ("documents" if documents else "whole-row")
        setting.extra = [*args.settings, *([f"model.document_separator_id={SEPARATOR}"] if documents else [])]
        return run_variant(setting, whole_row, corpora[corpus])

    jobs = [(corpus, documents) for corpus in corpora for documents in (False, True)]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = dict(zip(jobs, pool.map(lambda job: run(*job), jobs), strict=True))
    lines = [
        "| corpus | attention | bits/byte | ± s.e. | unigram | documents minus whole row (paired) |",
        "|---|---|---|---|---|---|",
    ]
    for corpus, data in corpora.items():
        whole, aware = rows[corpus, False], rows[corpus, True]
        report = json.loads((args.out / corpus / "whole-row" / whole_row.name / "eval.json").read_text())
        to_bits = report["tokens"] / report["bytes"] / math.log(2)
        nlls = [
            sequence_nlls(args.out / corpus / kind / whole_row.name, data, args.mc_samples)
            for kind in ("documents", "whole-row")
        ]
        differences = [(a - b) * to_bits for a, b in zip(*nlls, strict=True)]
        error = statistics.stdev(differences) / math.sqrt(len(differences))
        paired = f"{statistics.fmean(differences):+.3f} ± {error:.3f}"
        for name, row, note in (("whole row", whole, ""), ("documents", aware, paired)):
            lines.append(
                f"| {corpus} | {name} | {row['bits_per_byte']:.3f} | {row['bits_per_byte_stderr']:.3f} | "
                f"{row['unigram_bits_per_byte']:.3f} | {note} |"
            )
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
