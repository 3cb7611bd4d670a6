"""Which sampler settings turn a weakly trained model into text rather than blank lines.

usage: python scripts/sampler_defaults.py [--steps N] [--samples N] [--length N] [--output DIR]

Trains configs/tiny.toml's model (a 512-token tokenizer on four bundled works, 64-token blocks) for
--steps optimizer steps on the CPU, then draws --samples unconditional samples of --length tokens
(seeds 0 .. samples-1) with each candidate setting and prints a markdown table: words per generated
token, the share of generated tokens that are (or contain) a newline, and the share of generated
words that occur in the training text. Greedy confidence remasking on a weak model commits the
most frequent token, a newline, nearly everywhere; the table is how the defaults were chosen.
"""

from __future__ import annotations

import argparse
import gzip
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORD = re.compile(r"[A-Za-z']+")


@dataclass(frozen=True)
class Candidate:
    label: str
    settings: dict[str, Any]


CANDIDATES = (
    Candidate("confidence, temperature 0 (greedy)", {"remasking": "confidence", "temperature": 0.0}),
    Candidate("confidence, temperature 1", {"remasking": "confidence", "temperature": 1.0}),
    Candidate("confidence, temperature 1, top-p 0.9", {"remasking": "confidence", "temperature": 1.0, "top_p": 0.9}),
    Candidate("random, temperature 1", {"remasking": "random", "temperature": 1.0}),
    Candidate("random, temperature 1, top-p 0.9", {"remasking": "random", "temperature": 1.0, "top_p": 0.9}),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of the tiny model")
    parser.add_argument("--samples", type=int, default=8, help="seeded samples per setting")
    parser.add_argument("--length", type=int, default=48, help="tokens generated per sample")
    parser.add_argument("--output", type=Path, default=None, help="keep the data and run here (default: temporary)")
    parser.add_argument("--reuse", action="store_true", help="sample from the run already in --output")
    return parser.parse_args(argv)


def train_model(work: Path, steps: int) -> Path:
    """Tokenizer, packed data and a run of `steps` steps in `work`; returns the run directory."""

    from dlm.assets import shakespeare_files
    from dlm.config.schema import load_config
    from dlm.data.pack import pack_corpus
    from dlm.data.tokenizer import train_tokenizer
    from dlm.train.loop import train

    files = shakespeare_files("train")[:4]
    data = work / "data"
    train_tokenizer(files, 512, data / "tokenizer.json", overwrite=True)
    pack_corpus(files, data / "tokenizer.json", 64, data, val_inputs=shakespeare_files("val")[:1], overwrite=True)
    overrides = [
        f"training.tokenizer={data / 'tokenizer.json'}",
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}",
        f"training.output_dir={work / 'run'}",
        f"training.max_steps={steps}",
        f"training.eval_interval={steps}",
        f"training.save_interval={steps}",
        f"training.log_interval={max(1, steps // 10)}",
    ]
    train(load_config(ROOT / "configs" / "tiny.toml", overrides), overwrite=True)
    return work / "run"


def text_figures(texts: list[str], tokens: list[list[int]], tokenizer: Any, vocabulary: set[str]) -> dict[str, float]:
    """Words per generated token, newline share of the tokens, share of words known from training."""

    words = [word.lower() for text in texts for word in WORD.findall(text)]
    generated = [token for row in tokens for token in row]
    newlines = sum("\n" in tokenizer.decode([token], skip_special_tokens=False) for token in generated)
    known = sum(word in vocabulary for word in words)
    return {
        "words_per_token": len(words) / max(1, len(generated)),
        "newline_share": newlines / max(1, len(generated)),
        "known_words": known / len(words) if words else 0.0,
    }


def measure(run_dir: Path, vocabulary: set[str], samples: int, length: int) -> list[tuple[Candidate, dict[str, float]]]:
    from dlm.artifacts.loading import load_model
    from dlm.sampling.generation import generate

    model, tokenizer = load_model(run_dir, device="cpu")
    rows = []
    for candidate in CANDIDATES:
        per_seed = []
        for seed in range(samples):
            result = generate(model, tokenizer, length=length, steps=length, seed=seed, **candidate.settings)
            per_seed.append(text_figures(result.texts, result.token_ids, tokenizer, vocabulary))
        rows.append((candidate, {key: statistics.fmean(row[key] for row in per_seed) for key in per_seed[0]}))
    return rows


def main(argv: list[str] | None = None) -> int:
    from dlm.assets import shakespeare_files

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as temporary:
        work = args.output or Path(temporary)
        run_dir = work / "run" if args.reuse else train_model(work, args.steps)
        text = " ".join(gzip.decompress(path.read_bytes()).decode("utf-8") for path in shakespeare_files("train")[:4])
        vocabulary = {word.lower() for word in WORD.findall(text)}
        rows = measure(run_dir, vocabulary, args.samples, args.length)
    print(f"tiny model, {args.steps} steps; {args.samples} unconditional samples of {args.length} tokens per setting")
    print("| setting | words per token | newline tokens | words seen in training |")
    print("|---|---:|---:|---:|")
    for candidate, figures in rows:
        print(
            f"| {candidate.label} | {figures['words_per_token']:.2f} | {figures['newline_share']:.0%} "
            f"| {figures['known_words']:.0%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
