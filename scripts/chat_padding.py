"""Should the padding after a chat reply be learned? Measured on the fine-tuning task of the tests.

`dlm pack --chat` pads each example's block with end-of-document tokens and learns them: they are
masked and scored like the reply. The removed option `--mask-padding` left them out of the loss, so
training never masked them: the model saw them clean, right after each reply. This script packs the
task of `tests/test_finetune_task.py` (repeat four colour words), emulates that option on a copy
(the loss mask zeroed after each reply's end-of-document token, exactly what it wrote), fine-tunes
the same pre-trained model on each, and counts exact replies to the 30 held-out prompts:

- `learned`: the padding learned (dlm's pack), sampled as `dlm sample --chat` does: greedy,
  confidence remasking, the rest of the block to fill, the reply ended at its first end-of-document;
- `unlearned`: the padding visible but unlearned, sampled the same way;
- `unlearned, told the length`: the same model with the padding given clean after a reply-sized
  gap, as in training; a sampler never knows the reply's length, so this is what the model relies on.

    python scripts/chat_padding.py --seeds 4 0 1 --steps 800

At 800 steps it took about 3 minutes a seed on one CPU core (beside other jobs).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from dlm.artifacts.loading import load_model_with_info
from dlm.data.chat import reply
from dlm.data.chat_pack import pack_chat
from dlm.data.pack import mask_path, pack_corpus
from dlm.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, special_token_id, train_tokenizer
from dlm.sampling.generation import generate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_finetune_task as task  # the task as the tests define it


def unlearn_padding(source: Path, target: Path) -> None:
    """A copy of a chat pack whose loss mask stops at each reply's end-of-document token."""

    shutil.copytree(source, target)
    eos = special_token_id(load_tokenizer(target / "tokenizer.json"), "eos")
    tokens = np.fromfile(target / "train.bin", dtype=np.uint16).reshape(-1, task.SEQ_LEN)
    masks = np.fromfile(mask_path(target / "train.bin"), dtype=np.uint8).reshape(-1, task.SEQ_LEN).copy()
    for block, mask in zip(tokens, masks, strict=True):
        start = int(np.flatnonzero(mask)[0])
        end = start + int(np.flatnonzero(block[start:] == eos)[0])  # the reply's own end-of-document token
        mask[end + 1 :] = 0
    masks.tofile(mask_path(target / "train.bin"))


def exact(checkpoint: Path, prompts: list[str], told_length: bool) -> int:
    loaded = load_model_with_info(checkpoint, device="cpu")
    eos, hits = special_token_id(loaded.tokenizer, "eos"), 0
    for prompt in prompts:
        templated, prompt_ids, length = task.reply_length(loaded.tokenizer, loaded.info.tokenizer_path, prompt)
        options: dict[str, Any] = {"temperature": 0, "remasking": "confidence"}
        if told_length:
            words = len(loaded.tokenizer.encode(prompt, add_special_tokens=False).ids)
            text = templated + f"[MASK*{words}]" + SPECIAL_TOKENS["eos"] * (length - words)
            ids = generate(loaded.model, loaded.tokenizer, text=text, steps=words, **options).token_ids[0]
        else:
            ids = generate(
                loaded.model,
                loaded.tokenizer,
                prompt=templated,
                length=length,
                steps=length,
                stop_at_end=True,
                **options,
            ).token_ids[0]
        hits += reply(loaded.tokenizer, ids, len(prompt_ids), eos=eos) == prompt
    return hits


def measure(seed: int, steps: int, directory: Path) -> dict[str, int]:
    task.SEED = seed
    _, held_out = task.write_task(directory)
    train_tokenizer([directory / "tokenizer.txt"], task.VOCAB_SIZE, directory / "tokenizer.json")
    plain, learned, unlearned = directory / "plain", directory / "learned", directory / "unlearned"
    pack_corpus([directory / "plain.jsonl"], directory / "tokenizer.json", task.SEQ_LEN, plain, val_fraction=0.05)
    pack_chat([directory / "chat.jsonl"], directory / "tokenizer.json", task.SEQ_LEN, learned)
    unlearn_padding(learned, unlearned)
    base = task.run(directory, "base", plain / "train.bin", plain / "val.bin", 100)
    runs = {
        name: task.run(
            directory, f"{name}-run", data / "train.bin", data / "train.bin", steps, f"training.init_from={base}"
        )
        for name, data in (("learned", learned), ("unlearned", unlearned))
    }
    return {
        "learned": exact(runs["learned"], held_out, told_length=False),
        "unlearned": exact(runs["unlearned"], held_out, told_length=False),
        "unlearned, told the length": exact(runs["unlearned"], held_out, told_length=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[task.SEED], help="training seeds, one run each")
    parser.add_argument("--steps", type=int, default=300, help="fine-tuning steps (the test's: 300)")
    args = parser.parse_args()
    print("| seed | learned | unlearned | unlearned, told the length |\n|---|---|---|---|", flush=True)
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as directory:
            counts = measure(seed, args.steps, Path(directory))
        print(f"| {seed} | " + " | ".join(f"{count}/30" for count in counts.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
