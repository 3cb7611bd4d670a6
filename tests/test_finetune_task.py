"""Fine-tuning works: a small model learns a synthetic instruction task on the CPU and answers prompts it
never saw.

The task: the reply repeats the prompt's words, drawn from eight colours. Everything goes through
dlm's public paths: train a tokenizer, pack plain text and pre-train briefly, pack the instruction
data with `pack_chat`, fine-tune with `training.init_from`, then sample held-out prompts in the
chat template (greedy, confidence remasking, stopping at the end of the reply, as `dlm sample
--chat` does) and count exact replies. A LoRA fine-tune of the same base, training under 5% of the
parameters, must clear the same bar.

Every phrase starts with a space, so each word is the same token wherever it stands (" red", never
"red" at the start of a line): with the byte-level tokenizer a line's first word is a token of its
own, and this tiny model copies words 2 to 4 within 200 steps but leaves that first one at chance
(1 in 8), which caps exact match near 12%.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import CliResult
from helpers import ROOT

from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.loading import load_model_with_info
from dlm.config.schema import load_config
from dlm.data.chat import chat_prompt, reply
from dlm.data.chat_pack import pack_chat
from dlm.data.pack import pack_corpus
from dlm.data.tokenizer import load_tokenizer, train_tokenizer
from dlm.sampling.generation import generate
from dlm.train.loop import train

WORDS = ("red", "blue", "green", "black", "white", "gold", "pink", "grey")
PHRASE_WORDS = 4  # 8**4 = 4096 phrases: 1200 to learn from, 30 held out
SEQ_LEN = 32  # the 18-token templated prompt, 4 words and the end-of-document token, then padding
VOCAB_SIZE = 300  # the byte alphabet, the special tokens and the merges these words support
# The copy is learned in a sudden transition whose step varies with the seed: with this seed the
# fine-tuning run's masked accuracy passes 0.97 by step 150 of its 300 (1.0 by 200); of 5 seeds tried
# with 400 steps, 4 reached 1.0 by step 250 and one stayed at chance.
SEED = 4
EXACT_AFTER = 27  # of the 30 held-out prompts, after fine-tuning
# LoRA: rank 8 on the attention's qkv and out of both blocks, 6144 adapter parameters (4.8% of the
# model's 127296). It needs more steps than training every weight: with alpha 32 and the same learning
# rate, masked accuracy reached 1.0 by step 450 of 600 with this seed, which then replied 30 of 30 exactly
# (18 of 30 after 450 steps); seed 5 replied 6 of 30 after 600 steps and 30 of 30 after 800, as this seed
# did. Rank 2 on every Linear layer, or rank 4 on qkv and out, stayed near chance within 600 steps.
LORA = ("training.lora.rank=8", "training.lora.alpha=32", "training.lora.target_modules=qkv,out")
LORA_STEPS = 800


def phrases(count: int, rng: random.Random) -> list[str]:
    chosen: dict[str, None] = {}
    while len(chosen) < count:
        chosen[" " + " ".join(rng.choices(WORDS, k=PHRASE_WORDS))] = None
    return list(chosen)


def write_task(directory: Path) -> tuple[list[str], list[str]]:
    """Pre-training text, instruction data and a tokenizer corpus; returns (training, held-out) prompts."""

    rng = random.Random(0)
    everything = phrases(1230, rng)
    held_out, training = everything[:30], everything[30:]
    documents = [" ".join(rng.choices(WORDS, k=12)) for _ in range(3000)]
    (directory / "plain.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    (directory / "chat.jsonl").write_text("".join(json.dumps({"prompt": p, "response": p}) + "\n" for p in training))
    (directory / "tokenizer.txt").write_text("\n".join(documents) + "<|user|>\n<|assistant|>\n" * 50)
    return training, held_out


def run(directory: Path, name: str, train_bin: Path, val_bin: Path, steps: int, *extra: str) -> Path:
    overrides = [
        f"model.vocab_size={VOCAB_SIZE}",
        f"model.max_seq_len={SEQ_LEN}",
        f"training.tokenizer={directory / 'tokenizer.json'}",
        f"training.train_data={train_bin}",
        f"training.val_data={val_bin}",
        f"training.output_dir={directory / name}",
        f"training.max_steps={steps}",
        "training.warmup_steps=10",
        "training.batch_size=64",
        "training.log_interval=50",
        f"training.eval_interval={steps}",
        "training.eval_batches=1",
        f"training.save_interval={steps}",
        f"training.seed={SEED}",
        *extra,
    ]
    result = train(load_config(ROOT / "configs" / "tiny.toml", overrides))
    assert result.status == "complete"
    return result.checkpoint


def reply_length(tokenizer: Any, tokenizer_path: Path, prompt: str) -> tuple[str, list[int], int]:
    """The templated prompt, its ids and the tokens left for the reply in a block the model was tuned on."""

    templated = chat_prompt(tokenizer_path, prompt)
    prompt_ids = tokenizer.encode(templated, add_special_tokens=False).ids
    return templated, prompt_ids, SEQ_LEN - len(prompt_ids)


def exact_replies(checkpoint: Path, prompts: list[str]) -> int:
    """Replies equal to their prompt, sampled greedily after the templated prompt, which must stay as it was."""

    loaded = load_model_with_info(checkpoint, device="cpu")
    hits = 0
    for prompt in prompts:
        templated, prompt_ids, length = reply_length(loaded.tokenizer, loaded.info.tokenizer_path, prompt)
        result = generate(
            loaded.model,
            loaded.tokenizer,
            prompt=templated,
            length=length,
            steps=length,
            temperature=0,
            remasking="confidence",
            stop_at_end=True,
        )
        ids = result.token_ids[0]
        assert ids[: len(prompt_ids)] == prompt_ids  # sampling fills the reply only
        hits += reply(loaded.tokenizer, ids, len(prompt_ids), eos=0) == prompt
    return hits


@dataclass
class Task:
    directory: Path
    held_out: list[str]
    base: Path  # the checkpoint pre-trained on plain text


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    """The task's data packed, and a model pre-trained briefly on its plain text (about 5 s)."""

    tmp_path = tmp_path_factory.mktemp("task")
    training, held_out = write_task(tmp_path)
    assert not set(held_out) & set(training)
    train_tokenizer([tmp_path / "tokenizer.txt"], VOCAB_SIZE, tmp_path / "tokenizer.json")
    pack_corpus([tmp_path / "plain.jsonl"], tmp_path / "tokenizer.json", SEQ_LEN, tmp_path / "plain", val_fraction=0.05)
    counts = pack_chat([tmp_path / "chat.jsonl"], tmp_path / "tokenizer.json", SEQ_LEN, tmp_path / "sft")
    assert counts["train"]["examples"] == len(training) and counts["train"]["dropped"] == 0
    plain = tmp_path / "plain"
    return Task(tmp_path, held_out, run(tmp_path, "base", plain / "train.bin", plain / "val.bin", 100))


def fine_tune(task: Task, name: str, steps: int, *extra: str) -> Path:
    sft = task.directory / "sft"
    return run(
        task.directory, name, sft / "train.bin", sft / "train.bin", steps, f"training.init_from={task.base}", *extra
    )


@pytest.mark.slow  # about 25 s on one core; CI runs it
def test_a_fine_tuned_model_repeats_held_out_prompts(task: Task, run_cli: Callable[..., CliResult]) -> None:
    tmp_path, held_out = task.directory, task.held_out
    tuned = fine_tune(task, "sft-run", 300)

    before, after = exact_replies(task.base, held_out), exact_replies(tuned, held_out)
    assert before <= 3, before  # the pre-trained model does not know the task
    assert after >= EXACT_AFTER, after  # >= 90% exact on prompts it never saw

    tokenizer = tmp_path / "tokenizer.json"
    length = str(reply_length(load_tokenizer(tokenizer), tokenizer, held_out[0])[2])
    answer = run_cli(
        "sample",
        tuned,
        "--chat",
        held_out[0],
        "--length",
        length,
        "--steps",
        length,
        "--temperature",
        "0",
        "--remasking",
        "confidence",
        "--json",
    )
    assert answer.exit_code == 0, answer.stderr
    assert json.loads(answer.stdout)["replies"] == [held_out[0]]


@pytest.mark.slow  # about 30 s on one core; CI runs it
@pytest.mark.lora
def test_a_lora_fine_tune_repeats_held_out_prompts_as_well(task: Task) -> None:
    pytest.importorskip("peft")
    tuned = fine_tune(task, "lora-run", LORA_STEPS, *LORA)
    adapters = load_checkpoint(tuned)["model"]  # a LoRA checkpoint holds the trained parameters alone
    base = load_checkpoint(task.base)["model"]
    assert sum(t.numel() for t in adapters.values()) < 0.05 * sum(t.numel() for t in base.values())
    assert exact_replies(tuned, task.held_out) >= EXACT_AFTER  # the full fine-tune's bar
