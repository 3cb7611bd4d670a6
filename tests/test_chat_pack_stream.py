"""`dlm pack --chat` streams: the same bytes as the in-memory packer it replaced, memory flat in corpus size."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import pytest

from dlm.chat_pack import pack_chat

SEQ_LEN = 64
EXPECTATION = Path(__file__).parent / "data" / "chat_pack_expectation.json"
# Packs whose outputs were recorded by the in-memory packer, before it streamed.
CASES: dict[str, dict[str, Any]] = {
    "val_fraction": {"val_fraction": 0.25, "seed": 3},
    "truncate_mask_padding_val_input": {"long": "truncate", "mask_padding": True, "val_input": True},
}
WORDS = ("to", "be", "or", "not", "that", "is", "the", "question", "whether", "nobler", "mind", "éte", "<|endoftext|>")


def chat_records(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Varied examples: prompt/response pairs, conversations with a system turn, some longer than a block."""

    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    for index in range(count):
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 40 if index % 7 == 0 else 8)))
        response = " ".join(rng.choices(WORDS, k=rng.randint(0, 50 if index % 5 == 0 else 6)))
        if index % 3 == 0:
            records.append({"messages": [{"role": "system", "content": "brief"}, {"role": "user", "content": prompt},
                                         {"role": "assistant", "content": response}]})  # fmt: skip
        else:
            records.append({"prompt": prompt, "response": response})
    return records


def write_chat(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" + ("\n" if i % 11 == 0 else "") for i, r in enumerate(records)),
                    encoding="utf-8")  # fmt: skip
    return path


def pack_digests(tokenizer: Path, directory: Path, case: dict[str, Any]) -> dict[str, Any]:
    """sha256 of each block and mask file a pack wrote, its metadata (input paths relative, without the
    version) and its counts."""

    options = dict(case)
    val_inputs = [write_chat(directory / "val.jsonl", chat_records(12, seed=2))] if options.pop("val_input", 0) else []
    inputs = [write_chat(directory / "a.jsonl", chat_records(60, seed=0)),
              write_chat(directory / "b.jsonl", chat_records(25, seed=1))]  # fmt: skip
    counts = pack_chat(inputs, tokenizer, SEQ_LEN, directory / "out", val_inputs=val_inputs, **options)
    digests: dict[str, Any] = {"counts": counts}
    for path in sorted((directory / "out").iterdir()):
        if path.name == "tokenizer.json":
            continue
        if path.suffix == ".json":
            text = path.read_text(encoding="utf-8")
            metadata = json.loads(text)
            assert text == json.dumps(metadata, indent=2) + "\n"
            metadata.pop("dlm_version")
            metadata["sources"] = [Path(source).relative_to(directory).as_posix() for source in metadata["sources"]]
            digests[path.name] = metadata
        else:
            digests[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_chat_pack_is_byte_identical_to_the_in_memory_one(
    name: str, tiny_tokenizer_path: Path, tmp_path: Path
) -> None:
    expected = json.loads(EXPECTATION.read_text())[name]
    actual = pack_digests(tiny_tokenizer_path, tmp_path, CASES[name])
    assert json.dumps(actual) == json.dumps(expected)  # the metadata's key order too
