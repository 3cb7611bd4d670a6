"""`dlm pack --chat`: instruction data in, one block per example plus a per-token loss mask out.

Each example (`dlm.chat`) becomes exactly one block of `seq_len` tokens: prompt, reply, then
end-of-document tokens up to the block's end. Beside `NAME.bin` goes `NAME.mask.bin` (uint8, one
byte per token): 1 where the token is learned (the reply, its end-of-document token and, unless
`mask_padding`, the padding), 0 on the prompt, which training never masks and never scores.
Padding counts in the loss by default because that is how the model learns to stop; LLaDA's
authors observed that many end-of-document tokens make the model answer too briefly, which is what
`mask_padding` is for. Examples longer than a block are truncated or dropped (`long`), and counted.
Files are written under temporary names and renamed at the end, metadata last, as `dlm pack` does.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dlm import __version__
from dlm.chat import ChatTemplate, encode_example, parse_example
from dlm.errors import UserError
from dlm.fileio import atomic_path
from dlm.pack import PACKED_FORMAT, _check_output_dir, token_dtype
from dlm.tokenizer import load_tokenizer, special_token_id, tokenizer_sha256

LongPolicy = Literal["truncate", "drop"]
MASK_SUFFIX = ".mask.bin"


def mask_path(bin_path: Path) -> Path:
    """`train.bin` -> `train.mask.bin`."""

    return bin_path.with_name(bin_path.stem + MASK_SUFFIX)


@dataclass
class ChatSplit:
    """What one split received."""

    name: str
    tokens: list[np.ndarray] = field(default_factory=list)
    masks: list[np.ndarray] = field(default_factory=list)
    examples: int = 0
    truncated: int = 0
    dropped: int = 0
    loss_tokens: int = 0


def _records(path: Path) -> Any:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    yield json.loads(line), f"{path}:{number}"
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{number}: not valid JSON ({exc.msg})") from None


def _block(ids: list[int], prompt_length: int, seq_len: int, eos: int, mask_padding: bool) -> tuple[Any, Any]:
    tokens = np.full(seq_len, eos, dtype=np.int64)
    tokens[: len(ids)] = ids[:seq_len]
    mask = np.zeros(seq_len, dtype=np.uint8)
    mask[prompt_length : min(len(ids), seq_len) if mask_padding else seq_len] = 1
    return tokens, mask


def _is_val(line: Any, seed: int, fraction: float) -> bool:
    """A held-out draw that depends on the example and the seed only, not on its position."""

    digest = hashlib.blake2b(f"{seed}:{json.dumps(line, sort_keys=True)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def _add(split: ChatSplit, ids: list[int], prompt_length: int, options: dict[str, Any]) -> None:
    seq_len = options["seq_len"]
    if len(ids) > seq_len:
        if options["long"] == "drop" or prompt_length >= seq_len:  # nothing of the reply would be left
            split.dropped += 1
            return
        split.truncated += 1
    tokens, mask = _block(ids, prompt_length, seq_len, options["eos"], options["mask_padding"])
    split.tokens.append(tokens)
    split.masks.append(mask)
    split.examples += 1
    split.loss_tokens += int(mask.sum())


def _write(split: ChatSplit, output: Path, metadata: dict[str, Any], dtype: np.dtype) -> None:
    if not split.tokens:
        raise UserError(f"the {split.name} split holds no example that fits a block", path=output,
                        fix="raise --seq-len or pass --long truncate")  # fmt: skip
    bin_path = output / f"{split.name}.bin"
    with atomic_path(bin_path) as temporary:
        np.stack(split.tokens).astype(dtype).tofile(temporary)
    with atomic_path(mask_path(bin_path)) as temporary:
        np.stack(split.masks).tofile(temporary)
    chat = {key: getattr(split, key) for key in ("examples", "truncated", "dropped", "loss_tokens")}
    blocks = len(split.tokens)
    meta = {**metadata, "split": split.name, "num_blocks": blocks, "num_tokens": blocks * metadata["seq_len"],
            "loss_mask": mask_path(bin_path).name, "chat": {**metadata["chat"], **chat}}  # fmt: skip
    with atomic_path(bin_path.with_suffix(".json")) as temporary:
        temporary.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def pack_chat(
    inputs: list[Path],
    tokenizer_path: Path,
    seq_len: int,
    output: Path,
    *,
    val_inputs: list[Path] | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    long: LongPolicy = "drop",
    mask_padding: bool = False,
    overwrite: bool = False,
) -> dict[str, dict[str, int]]:
    """Pack JSONL instruction data into `output`; returns each split's counts."""

    if long not in ("truncate", "drop"):
        raise UserError(f"--long must be truncate or drop, got {long!r}")
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.encode_special_tokens = True  # text that spells "<|endoftext|>" is data, not the token
    template = ChatTemplate.for_tokenizer(tokenizer_path)
    _check_output_dir(output, tokenizer_path, overwrite)
    eos = special_token_id(tokenizer, "eos")
    options = {"seq_len": seq_len, "long": long, "eos": eos, "mask_padding": mask_padding}
    splits = {"train": ChatSplit("train"), "val": ChatSplit("val")}
    for path, held_out in [*((Path(p), False) for p in inputs), *((Path(p), True) for p in val_inputs or [])]:
        for record, where in _records(path):
            ids, prompt_length = encode_example(tokenizer, template, parse_example(record, where), eos)
            val = held_out or (val_fraction > 0 and _is_val(record, seed, val_fraction))
            _add(splits["val" if val else "train"], ids, prompt_length, options)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    metadata = {"format": PACKED_FORMAT, "vocab_size": vocab_size, "seq_len": seq_len, "eos_token_id": eos,
                "tokenizer_sha256": tokenizer_sha256(tokenizer_path), "dtype": token_dtype(vocab_size).name,
                "dlm_version": __version__,
                "chat": {"template": template.name, "long": long, "mask_padding": mask_padding},
                "sources": [str(p) for p in [*inputs, *(val_inputs or [])]]}  # fmt: skip
    output.mkdir(parents=True, exist_ok=True)
    wanted = [s for s in splits.values() if s.name == "train" or s.tokens or val_inputs or val_fraction > 0]
    for split in wanted:
        _write(split, output, metadata, token_dtype(vocab_size))
    tokenizer_copy = output / "tokenizer.json"
    if not (tokenizer_copy.exists() and tokenizer_copy.samefile(tokenizer_path)):
        shutil.copyfile(tokenizer_path, tokenizer_copy)
    return {s.name: {k: getattr(s, k) for k in ("examples", "truncated", "dropped", "loss_tokens")} for s in wanted}
