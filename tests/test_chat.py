"""Instruction data: `dlm pack --chat`, the loss mask in corruption and loss, and training on it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CliResult
from helpers import tiny_experiment

from dlm.data.chat import ChatTemplate, encode_example, parse_example
from dlm.data.chat_pack import mask_path, pack_chat
from dlm.data.dataset import load_packed_dataset
from dlm.data.tokenizer import load_tokenizer
from dlm.diffusion.objective import corrupt_tokens, diffusion_cross_entropy
from dlm.errors import UserError
from dlm.train.loop import train

SEQ_LEN = 64


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    records: list[dict[str, object]] = [{"prompt": f"say {w}", "response": f"{w} {w}"} for w in ("to", "be", "or")]
    records.append(
        {
            "messages": [
                {"role": "system", "content": "brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ]
        }
    )
    records.append({"prompt": "long " * 80, "response": "x"})
    return write_jsonl(tmp_path / "chat.jsonl", records)


def held_out(chat_file: Path) -> Path:
    """A copy of the examples as a validation input (a file cannot be both a training and a validation input)."""

    return Path(shutil.copyfile(chat_file, chat_file.with_name("val.jsonl")))


def test_pack_chat_masks_the_prompt_and_counts_the_padding(
    chat_file: Path, tiny_tokenizer_path: Path, tmp_path: Path
) -> None:
    counts = pack_chat([chat_file], tiny_tokenizer_path, SEQ_LEN, tmp_path / "out")
    assert {k: counts["train"][k] for k in ("examples", "truncated", "dropped")} == {
        "examples": 4,
        "truncated": 0,
        "dropped": 1,
    }
    dataset = load_packed_dataset(tmp_path / "out", SEQ_LEN)
    assert dataset.metadata["chat"]["dropped"] == 1 and dataset.metadata["loss_mask"] == "train.mask.bin"
    tokenizer = load_tokenizer(tiny_tokenizer_path)
    template = ChatTemplate()
    ids, prompt_length = encode_example(
        tokenizer, template, parse_example({"prompt": "say to", "response": "to to"}, "x"), eos=0
    )
    tokens, loss_mask = dataset[0]
    assert tokens[: len(ids)].tolist() == ids and (tokens[len(ids) :] == 0).all()  # padded with end-of-document
    assert not loss_mask[:prompt_length].any() and loss_mask[prompt_length:].all()
    assert tokenizer.decode(ids[:prompt_length]) == "<|user|>\nsay to\n<|assistant|>\n"


def test_truncation_and_the_learned_padding(chat_file: Path, tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    counts = pack_chat([chat_file], tiny_tokenizer_path, SEQ_LEN, tmp_path / "out", long="truncate")
    # The long example's prompt alone fills the block: nothing of its reply would be learned, so it is dropped.
    assert counts["train"]["truncated"] == 0 and counts["train"]["dropped"] == 1
    dataset = load_packed_dataset(tmp_path / "out", SEQ_LEN)
    for index in range(len(dataset)):  # every block's loss runs from the reply to the block's end: padding too
        tokens, loss_mask = dataset[index]
        start = int(loss_mask.nonzero().min())
        assert loss_mask[start:].all() and not loss_mask[:start].any() and tokens[-1] == 0
    masks = np.fromfile(mask_path(tmp_path / "out" / "train.bin"), dtype=np.uint8)
    assert masks.size == dataset.num_blocks * SEQ_LEN
    assert "mask_padding" not in dataset.metadata["chat"]


def test_truncation_keeps_a_long_reply(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "q", "response": "word " * 100}])
    assert pack_chat([path], tiny_tokenizer_path, SEQ_LEN, tmp_path / "a", long="truncate")["train"]["truncated"] == 1
    with pytest.raises(UserError, match=r"no example to pack \(1 longer than a block\).*--long truncate"):
        pack_chat([path], tiny_tokenizer_path, SEQ_LEN, tmp_path / "b", long="drop")


def test_examples_with_an_empty_reply_are_skipped_and_counted(
    tiny_tokenizer_path: Path,
    tmp_path: Path,
    run_cli: Callable[..., CliResult],
    monkeypatch: pytest.MonkeyPatch,
    narrow_console: int,
) -> None:
    good = [{"prompt": f"say {w}", "response": f"{w} {w}"} for w in ("to", "be", "or")]
    empty: list[dict[str, object]] = [
        {"prompt": "say nothing", "response": ""},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n"}]},
    ]
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [good[0], empty[0], good[1], empty[1], good[2]])
    counts = pack_chat([mixed], tiny_tokenizer_path, SEQ_LEN, tmp_path / "mixed")["train"]
    clean = pack_chat([write_jsonl(tmp_path / "clean.jsonl", good)], tiny_tokenizer_path, SEQ_LEN, tmp_path / "clean")
    assert counts == {**clean["train"], "empty": 2} and counts["examples"] == 3
    for name in ("train.bin", "train.mask.bin"):  # the same blocks as the data without them
        assert (tmp_path / "mixed" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes()
    assert load_packed_dataset(tmp_path / "mixed", SEQ_LEN).metadata["chat"]["empty"] == 2

    monkeypatch.setattr("dlm.cli.data_cmd.wants_json", lambda flag: False)
    args = ("-t", tiny_tokenizer_path, "-l", str(SEQ_LEN), "-o", tmp_path / "cli")
    result = run_cli("pack", "--chat", mixed, *args)
    assert result.exit_code == 0, result.stderr
    assert "train: skipped 2 examples with an empty reply" in result.stdout
    only_empty = write_jsonl(tmp_path / "empty.jsonl", empty)
    run_cli("pack", "--chat", only_empty, *args, "--overwrite").assert_refused(
        "the train split holds no example to pack (2 with an empty reply)", "give each example a non-empty reply"
    )


def test_an_empty_split_names_its_cause_and_a_fix_that_helps(
    tiny_tokenizer_path: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "long " * 80, "response": "x"}])
    args = ("pack", "--chat", path, "-t", tiny_tokenizer_path, "-l", str(SEQ_LEN), "-o", tmp_path / "out")
    cause = "no example to pack (1 longer than a block)"
    run_cli(*args).assert_refused(cause, "raise --seq-len or pass --long truncate")
    truncating = run_cli(*args, "--long", "truncate")  # the prompt alone fills the block: truncating cannot help
    truncating.assert_refused(cause, "raise --seq-len: their prompts fill a block")
    assert "--long truncate" not in truncating.stderr and not (tmp_path / "out").exists()


def test_a_bad_record_is_named_with_file_and_line(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "q", "response": "a"}, {"prompt": "q"}])
    with pytest.raises(UserError, match=r"c\.jsonl:2: expected an object"):
        pack_chat([path], tiny_tokenizer_path, SEQ_LEN, tmp_path / "out")


def test_the_loss_mask_keeps_the_prompt_clean_with_the_same_draws() -> None:
    clean = torch.randint(3, 50, (4, 32))
    loss_mask = torch.zeros(4, 32, dtype=torch.bool)
    loss_mask[:, 10:] = True
    times = torch.tensor([0.3, 0.6, 0.9, 1.0])
    plain = corrupt_tokens(clean, 1, times, 1e-3, torch.Generator().manual_seed(0))
    masked = corrupt_tokens(clean, 1, times, 1e-3, torch.Generator().manual_seed(0), loss_mask=loss_mask)
    assert not masked.mask[:, :10].any() and torch.equal(masked.noisy_tokens[:, :10], clean[:, :10])
    assert torch.equal(masked.mask[:, 10:], plain.mask[:, 10:])
    logits = torch.zeros(int(masked.mask.sum()), 64)  # uniform over 64 ids: CE = log 64 at each masked token
    output = diffusion_cross_entropy(logits, clean, masked)
    weights = masked.mask_rate / masked.mask_probability
    expected = (masked.mask.sum(dim=1) * weights * np.log(64) / 22).mean()  # per sequence over its 22 loss tokens
    assert torch.allclose(output.loss, expected.float())


def test_training_on_chat_data_runs(chat_file: Path, tiny_data_dir: Path, tmp_path: Path) -> None:
    tokenizer = tiny_data_dir / "tokenizer.json"
    pack_chat([chat_file], tokenizer, SEQ_LEN, tmp_path / "chat", val_inputs=[held_out(chat_file)])
    experiment = tiny_experiment(
        tiny_data_dir,
        tmp_path / "run",
        "training.max_steps=3",
        "training.warmup_steps=1",
        "training.batch_size=2",
        "training.eval_interval=3",
        "training.save_interval=3",
        f"training.train_data={tmp_path / 'chat' / 'train.bin'}",
        f"training.val_data={tmp_path / 'chat' / 'val.bin'}",
    )
    assert train(experiment).status == "complete"


def test_chat_sampling_keeps_the_prompt_and_returns_only_the_reply(
    chat_file: Path, tiny_data_dir: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    from dlm.artifacts.loading import load_model_with_info
    from dlm.data.chat import chat_prompt
    from dlm.sampling.generation import generate

    tokenizer = tiny_data_dir / "tokenizer.json"
    pack_chat([chat_file], tokenizer, SEQ_LEN, tmp_path / "chat", val_inputs=[held_out(chat_file)])
    experiment = tiny_experiment(
        tiny_data_dir,
        tmp_path / "run",
        "training.max_steps=2",
        "training.warmup_steps=1",
        "training.batch_size=2",
        "training.eval_interval=2",
        "training.save_interval=2",
        f"training.train_data={tmp_path / 'chat' / 'train.bin'}",
        f"training.val_data={tmp_path / 'chat' / 'val.bin'}",
    )
    checkpoint = train(experiment).checkpoint
    loaded = load_model_with_info(checkpoint, device="cpu")
    prompt = chat_prompt(loaded.info.tokenizer_path, "say be")
    prompt_ids = loaded.tokenizer.encode(prompt, add_special_tokens=False).ids
    for remasking in ("random", "confidence"):
        result = generate(
            loaded.model, loaded.tokenizer, prompt=prompt, length=16, num_samples=2, seed=3, remasking=remasking
        )
        for ids in result.token_ids:  # the templated prompt is never changed by sampling
            assert list(ids[: len(prompt_ids)]) == prompt_ids

    answer = run_cli("sample", checkpoint, "--chat", "say be", "--length", "16", "--num-samples", "2", "--json")
    assert answer.exit_code == 0, answer.stderr
    replies = json.loads(answer.stdout)["replies"]
    assert len(replies) == 2 and all(isinstance(reply, str) for reply in replies)
    assert not any("say be" in reply for reply in replies)  # the reply only, not the prompt
