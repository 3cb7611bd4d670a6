"""`dlm pack --chat`: instruction data in, one block per example plus a per-token loss mask out.

Each example (`dlm.data.chat`) becomes exactly one block of `seq_len` tokens: prompt, reply, then
end-of-document tokens up to the block's end. Beside `NAME.bin` goes `NAME.mask.bin` (uint8, one
byte per token): 1 where the token is learned (the reply, its end-of-document token and the
padding), 0 on the prompt, which training never masks and never scores. Padding counts in the loss
because that is how the model learns to stop, and it is masked like the reply so that the model
never sees where a reply ends (it does not when sampling). Examples longer than a block are
truncated or dropped (`long`), and examples whose reply is empty or blank are skipped: all counted.
Inputs are named as for `dlm pack` (files, directories, globs) in any format of `dlm.data.readers` that
holds records (JSONL, Parquet, saved datasets). Examples are read one line or row batch at a time
and each block goes to disk as soon as it is made, so memory stays flat in the size of the data.
Files are written under temporary names and renamed at the end, metadata last, as `dlm pack` does:
a failed pack (a bad record, an empty split, a full disk) leaves nothing that loads, and a split
this pack does not write loses its old files. Temporaries that a killed pack left behind are
removed by the next.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dlm import __version__
from dlm.data.chat import FIELDS, ChatTemplate, encode_example, parse_example
from dlm.data.corpus import discover_corpus
from dlm.data.mixture import check_disjoint
from dlm.data.pack import (
    MASK_FILES,
    OUTPUT_FILES,
    PACKED_FORMAT,
    SPLITS,
    _check_output_dir,
    _remove_empty,
    check_pack_arguments,
    copy_tokenizer,
    mask_path,
    token_dtype,
)
from dlm.data.readers import ReadContext, Record, Utf8Decoder, format_of, record_inputs
from dlm.data.tokenizer import load_tokenizer, special_token_id, tokenizer_sha256
from dlm.errors import UserError, reported_os_errors
from dlm.fileio import remove_stale_temporaries, temporary_path

LongPolicy = Literal["truncate", "drop"]
INPUT_FIX = "name the files of prompt/response or messages examples, e.g. 'data/*.jsonl'"


class _ChatWriter:
    """Streams one split's blocks and masks to temporary files as they come, and counts them."""

    def __init__(self, name: str, output: Path, dtype: np.dtype):
        self.name, self.dtype = name, dtype
        self.bin_path = output / f"{name}.bin"
        self.temporaries = [temporary_path(self.bin_path), temporary_path(mask_path(self.bin_path))]
        self.tokens_handle = open(self.temporaries[0], "wb")  # noqa: SIM115 - closed by close()
        self.mask_handle = open(self.temporaries[1], "wb")  # noqa: SIM115 - closed by close()
        self.examples = self.truncated = self.dropped = self.empty = self.loss_tokens = 0

    def add(self, ids: list[int], prompt_length: int, options: dict[str, Any]) -> None:
        seq_len = options["seq_len"]
        if len(ids) > seq_len:
            if options["long"] == "drop" or prompt_length >= seq_len:  # nothing of the reply would be left
                self.dropped += 1
                return
            self.truncated += 1
        tokens, mask = _block(ids, prompt_length, seq_len, options["eos"])
        # File writes, not ndarray.tofile: a full disk then raises OSError with its errno.
        self.tokens_handle.write(tokens.astype(self.dtype).tobytes())
        self.mask_handle.write(mask.tobytes())
        self.examples += 1
        self.loss_tokens += int(mask.sum())

    def counts(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in ("examples", "truncated", "dropped", "empty", "loss_tokens")}

    def close(self) -> None:
        self.tokens_handle.close()
        self.mask_handle.close()


def chat_inputs(inputs: list[Path], option: str) -> list[Path]:
    """The inputs that `inputs` name, found as `dlm pack` finds them (files, directories searched
    recursively, globs), each in a format that holds records; any other file is refused by name."""

    if not inputs:
        raise UserError(f"no {option} given", fix=INPUT_FIX)
    for item in inputs:  # an explicit file dlm cannot read at all is refused in the words of --chat
        if item.is_file() and format_of(item) is None:
            raise UserError(f"dlm pack --chat reads {record_inputs()}, not this file", path=item, fix=INPUT_FIX)
    found = discover_corpus(inputs)
    for path in [*found.paths, *found.skipped]:
        readable = format_of(path)
        if readable is None or readable.records is None:
            raise UserError(f"dlm pack --chat reads {record_inputs()}, not this file", path=path, fix=INPUT_FIX)
    return found.paths


def _records(path: Path, decoder: Utf8Decoder) -> Iterator[Record]:
    """Each example of `path` as read, the chat fields of its line or row, and where it is."""

    readable = format_of(path)
    assert readable is not None and readable.records is not None, "chat_inputs admits only such inputs"
    return readable.records(ReadContext(path, "", 1 << 16, decoder), FIELDS)


def _block(ids: list[int], prompt_length: int, seq_len: int, eos: int) -> tuple[Any, Any]:
    tokens = np.full(seq_len, eos, dtype=np.int64)
    tokens[: len(ids)] = ids[:seq_len]
    mask = np.zeros(seq_len, dtype=np.uint8)
    mask[prompt_length:] = 1
    return tokens, mask


def _is_val(line: Any, seed: int, fraction: float) -> bool:
    """A held-out draw that depends on the example and the seed only, not on its position."""

    # repr for a value JSON has no form for (bytes nested in a Parquet column): the draw still depends on it.
    text = json.dumps(line, sort_keys=True, default=repr)
    digest = hashlib.blake2b(f"{seed}:{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def _stream(
    sources: list[tuple[Path, bool]],
    tokenizer: Any,
    template: ChatTemplate,
    writers: dict[str, _ChatWriter],
    options: dict[str, Any],
) -> None:
    """Encode each example of each (path, is a validation input) and write it to its split at once."""

    fraction = options["val_fraction"]
    # --errors does not apply to --chat: the fix for a bad byte is the file's encoding.
    decoder = Utf8Decoder("strict", fix="convert the file to UTF-8")
    for path, held_out in sources:
        for record, where in _records(path, decoder):
            turns = parse_example(record, where)
            val = held_out or (fraction > 0 and _is_val(record, options["seed"], fraction))
            writer = writers["val" if val else "train"]
            if not turns[-1].content.strip():  # nothing to learn but an immediate end: a data mistake
                writer.empty += 1
                continue
            writer.add(*encode_example(tokenizer, template, turns, options["eos"]), options)


def _empty_split_error(writer: _ChatWriter, long: LongPolicy) -> UserError:
    """Why a split holds no example, and the fix for that reason."""

    reasons = [f"{writer.dropped:,} longer than a block"] if writer.dropped else []
    reasons += [f"{writer.empty:,} with an empty reply"] if writer.empty else []
    if writer.dropped:  # with --long truncate, only examples whose prompt alone fills a block are dropped
        fix = "raise --seq-len" + (" or pass --long truncate" if long == "drop" else ": their prompts fill a block")
    elif writer.empty:
        fix = "give each example a non-empty reply"
    else:
        fix = "pass more examples" + (" or a larger --val-fraction" if writer.name == "val" else "")
    found = f" ({', '.join(reasons)})" if reasons else ""
    return UserError(f"the {writer.name} split holds no example to pack{found}", path=writer.bin_path.parent, fix=fix)


def _split_metadata(writer: _ChatWriter, metadata: dict[str, Any]) -> dict[str, Any]:
    if writer.examples == 0:
        raise _empty_split_error(writer, metadata["chat"]["long"])
    blocks = writer.examples
    return {
        **metadata,
        "split": writer.name,
        "num_blocks": blocks,
        "num_tokens": blocks * metadata["seq_len"],
        "loss_mask": mask_path(writer.bin_path).name,
        "chat": {**metadata["chat"], **writer.counts()},
    }


def _commit(output: Path, writers: list[_ChatWriter], metadata: dict[str, Any], tokenizer_path: Path) -> None:
    """Rename everything into place, the metadata that makes a split loadable last; a split this pack
    does not write loses its old files, so a stale one never loads beside the new."""

    staged = {
        w.bin_path.with_suffix(".json"): json.dumps(_split_metadata(w, metadata), indent=2) + "\n" for w in writers
    }
    for final, text in staged.items():
        temporary_path(final).write_text(text, encoding="utf-8")
    copy_tokenizer(tokenizer_path, output)  # with its config: the chat template travels with the pack
    written = {w.name for w in writers}
    for name in SPLITS:
        (output / f"{name}.json").unlink(missing_ok=True)
        if name not in written:
            (output / f"{name}.bin").unlink(missing_ok=True)
            mask_path(output / f"{name}.bin").unlink(missing_ok=True)
    for writer in writers:
        writer.temporaries[0].replace(writer.bin_path)
        writer.temporaries[1].replace(mask_path(writer.bin_path))
    for final in staged:
        temporary_path(final).replace(final)


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
    overwrite: bool = False,
) -> dict[str, dict[str, int]]:
    """Pack instruction data into `output`; returns each split's counts. Everything is checked (the
    options, the inputs, the tokenizer and its chat template, the output) before anything is written."""

    if long not in ("truncate", "drop"):
        raise UserError(f"--long must be truncate or drop, got {long!r}")
    check_pack_arguments(seq_len, val_fraction, val_inputs or [])
    train_paths = chat_inputs([Path(p) for p in inputs], "inputs")
    val_paths = chat_inputs([Path(p) for p in val_inputs], "--val-input") if val_inputs else []
    check_disjoint(train_paths, val_paths)
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer.encode_special_tokens = True  # text that spells "<|endoftext|>" is data, not the token
    template = ChatTemplate.for_tokenizer(tokenizer_path)
    template.check()
    _check_output_dir(output, tokenizer_path, overwrite)
    eos = special_token_id(tokenizer, "eos")
    options = {"seq_len": seq_len, "long": long, "eos": eos, "val_fraction": val_fraction, "seed": seed}
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    metadata = {
        "format": PACKED_FORMAT,
        "vocab_size": vocab_size,
        "seq_len": seq_len,
        "eos_token_id": eos,
        "tokenizer_sha256": tokenizer_sha256(tokenizer_path),
        "dtype": token_dtype(vocab_size).name,
        "dlm_version": __version__,
        "chat": {"template": template.name, "long": long},
        "sources": [str(p) for p in [*train_paths, *val_paths]],
    }
    names = ("train", "val") if val_paths or val_fraction > 0 else ("train",)
    sources = [*((p, False) for p in train_paths), *((p, True) for p in val_paths)]
    writers = _write(
        output,
        names,
        token_dtype(vocab_size),
        lambda writers: _stream(sources, tokenizer, template, writers, options),
        lambda writers: _commit(output, writers, metadata, tokenizer_path),
    )
    return {name: writer.counts() for name, writer in writers.items()}


def _write(
    output: Path,
    names: tuple[str, ...],
    dtype: np.dtype,
    stream: Callable[[dict[str, _ChatWriter]], None],
    commit: Callable[[list[_ChatWriter]], None],
) -> dict[str, _ChatWriter]:
    """Stream the splits to temporaries and commit them; on any failure remove every temporary and each
    directory this created. A failed write (a full disk) is a `UserError`."""

    created = [d for d in (output, *output.absolute().parents) if not d.exists()]
    remove_stale_temporaries(output, [*OUTPUT_FILES, *MASK_FILES])
    writers: dict[str, _ChatWriter] = {}
    committed = False
    with reported_os_errors("the packed data", output):
        try:
            output.mkdir(parents=True, exist_ok=True)
            writers.update({name: _ChatWriter(name, output, dtype) for name in names})
            stream(writers)
            for writer in writers.values():
                writer.close()
            commit(list(writers.values()))
            committed = True
        finally:
            for writer in writers.values():
                writer.close()
                for temporary in (*writer.temporaries, temporary_path(writer.bin_path.with_suffix(".json"))):
                    temporary.unlink(missing_ok=True)
            if not committed:
                _remove_empty(created)
    return writers
