"""`dlm pack --chat` streams: the same bytes as the in-memory packer it replaced, memory flat in corpus size."""

from __future__ import annotations

import hashlib
import json
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from dlm.data.chat_pack import pack_chat
from dlm.errors import UserError

SEQ_LEN = 64
EXPECTATION = Path(__file__).parent / "data" / "chat_pack_expectation.json"
# Packs whose outputs were recorded by the in-memory packer, before it streamed; recorded again when
# examples with an empty reply began to be skipped (their blocks and masks are byte for byte what the
# previous packer wrote for the same data without those examples) and --mask-padding was removed.
CASES: dict[str, dict[str, Any]] = {
    "val_fraction": {"val_fraction": 0.25, "seed": 3},
    "truncate_val_input": {"long": "truncate", "val_input": True},
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
            records.append(
                {
                    "messages": [
                        {"role": "system", "content": "brief"},
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": response},
                    ]
                }
            )
        else:
            records.append({"prompt": prompt, "response": response})
    return records


def write_chat(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text(
        "".join(json.dumps(r) + "\n" + ("\n" if i % 11 == 0 else "") for i, r in enumerate(records)), encoding="utf-8"
    )
    return path


def pack_digests(tokenizer: Path, directory: Path, case: dict[str, Any]) -> dict[str, Any]:
    """sha256 of each block and mask file a pack wrote, its metadata (input paths relative, without the
    version) and its counts."""

    options = dict(case)
    val_inputs = [write_chat(directory / "val.jsonl", chat_records(12, seed=2))] if options.pop("val_input", 0) else []
    inputs = [
        write_chat(directory / "a.jsonl", chat_records(60, seed=0)),
        write_chat(directory / "b.jsonl", chat_records(25, seed=1)),
    ]
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


def packing_peak_bytes(tokenizer: Path, chat: Path, output: Path) -> int:
    """Peak of Python and numpy allocations while packing `chat` (tracemalloc sees both)."""

    tracemalloc.start()
    try:
        pack_chat([chat], tokenizer, SEQ_LEN, output, val_fraction=0.1)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_chat_packing_memory_is_flat_in_the_size_of_the_data(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    records = chat_records(1500)
    peaks = []
    for scale in (1, 4):
        chat = write_chat(tmp_path / f"x{scale}.jsonl", records * scale)
        peaks.append(packing_peak_bytes(tiny_tokenizer_path, chat, tmp_path / f"out{scale}"))
        blocks = json.loads((tmp_path / f"out{scale}" / "train.json").read_text())["num_blocks"]
        assert blocks > 500 * scale  # the larger pack did write four times the blocks
    # Holding the blocks until the end (8 bytes a token and 1 a mask byte, ~0.6 MB per 1000 blocks)
    # would add over 1 MB to the larger pack's peak.
    assert peaks[1] <= peaks[0] + 256 * 1024, peaks


def test_a_failed_pack_leaves_the_previous_one_whole(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    good = write_chat(tmp_path / "good.jsonl", chat_records(30))
    pack_chat([good], tiny_tokenizer_path, SEQ_LEN, tmp_path / "out", val_fraction=0.25)
    before = {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()}
    bad = write_chat(tmp_path / "bad.jsonl", chat_records(40))
    with bad.open("a", encoding="utf-8") as handle:
        handle.write('{"prompt": "no response"}\n')
    lines = len(bad.read_text(encoding="utf-8").splitlines())
    with pytest.raises(UserError, match=rf"bad\.jsonl:{lines}: expected an object with prompt and response"):
        pack_chat([good, bad], tiny_tokenizer_path, SEQ_LEN, tmp_path / "out", overwrite=True)
    assert {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()} == before  # no temporaries


def test_a_repack_without_validation_removes_the_old_split(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    chat = write_chat(tmp_path / "c.jsonl", chat_records(30))
    pack_chat([chat], tiny_tokenizer_path, SEQ_LEN, tmp_path / "out", val_fraction=0.25)
    counts = pack_chat([chat], tiny_tokenizer_path, SEQ_LEN, tmp_path / "out", overwrite=True)
    assert list(counts) == ["train"]
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [
        "tokenizer.json",
        "train.bin",
        "train.json",
        "train.mask.bin",
    ]


def test_a_killed_packs_temporaries_are_removed(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    dead = tmp_path / "out" / ".train.mask.bin.tmp-999999999"  # no such process
    dead.write_bytes(b"partial")
    pack_chat([write_chat(tmp_path / "c.jsonl", chat_records(10))], tiny_tokenizer_path, SEQ_LEN, tmp_path / "out")
    assert not dead.exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"val_fraction": 0.25, "val_inputs": "self"}, "either a validation fraction or validation inputs"),
        ({"val_fraction": 1.5}, r"val_fraction must be in \[0, 1\)"),
        ({"seq_len": 1}, "seq_len must be at least 2"),
    ],
)
def test_chat_packing_takes_the_plain_packs_option_checks(
    tiny_tokenizer_path: Path, tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    chat = write_chat(tmp_path / "c.jsonl", chat_records(10))
    settings: dict[str, Any] = {"seq_len": SEQ_LEN, **options}
    if settings.get("val_inputs") == "self":
        settings["val_inputs"] = [chat]
    seq_len = settings.pop("seq_len")
    with pytest.raises(UserError, match=message):
        pack_chat([chat], tiny_tokenizer_path, seq_len, tmp_path / "out", **settings)
    assert not (tmp_path / "out").exists()  # refused before anything is written
