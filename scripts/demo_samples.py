"""Score the demo's three samples from any model trained on the bundled Shakespeare.

usage: python scripts/demo_samples.py MODEL [--json]

MODEL is an export directory, a run directory or a checkpoint. The samples are the ones `dlm demo`
draws (an unconditional one, a prompt and an infill, seeds 0-2, one step a token, float32 on the
CPU), scored as the demo scores them (`dlm.evaluation.sample_quality`): words per generated token
(the held-out plays' own density beside it) and the share of the samples' words that occur in the
training plays. `dlm demo` reports the same figures for its own model; this gives them for a run
trained by hand, e.g. the recipe comparisons in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json

import torch

from dlm.artifacts.loading import load_model
from dlm.assets import shakespeare_files
from dlm.demo.run import SAMPLE_REQUESTS
from dlm.evaluation.sample_quality import corpus_words, pooled, sample_quality
from dlm.sampling.generation import generate
from dlm.sampling.prompting import template_fixed_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, device="cpu", dtype=torch.float32)
    length = min(64, model.config.max_seq_len * 3 // 4)  # as the demo: room for a prompt
    training = corpus_words(shakespeare_files("train"))
    held_out = corpus_words(shakespeare_files("val"), tokenizer)
    texts, qualities = [], []
    for seed, (_label, prompt, template) in enumerate(SAMPLE_REQUESTS):
        result = generate(model, tokenizer, prompt=prompt, text=template, length=length, steps=length, seed=seed)
        fixed = prompt if template is None else template_fixed_text(template)
        qualities.append(sample_quality(result.texts[0], fixed, result.lengths[0], training.vocabulary))
        texts.append(result.texts[0])
    figures = {**pooled(qualities).to_dict(), "held_out_words_per_token": round(held_out.words_per_token, 4)}
    if args.json:
        print(json.dumps({"samples": texts, "quality": figures}, ensure_ascii=False))
        return
    for text in texts:
        print(repr(text))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
