"""The streaming packer behind `dlm pack`: text files in, fixed-length blocks of token ids out.

`pack_corpus` tokenizes documents, ends each with the end-of-document token, concatenates them and
cuts the stream into blocks of exactly `seq_len` tokens, streaming straight to disk (memory grows
only by a hash per document, never with the text). Byte-identical documents are kept once and the
validation fraction is a share of the text bytes (`dlm.data.pack_plan`). A split is `NAME.bin` (raw
little-endian uint16, or uint32 when the vocabulary does not fit) plus `NAME.json` (metadata).
Beside them go copies of the tokenizer and of the tokenizer_config.json beside it (`copy_tokenizer`).
Everything is written under temporary names and renamed at the end, metadata last, so an interrupted
or failed pack (a full disk included) leaves nothing that loads; the next pack removes the
temporaries a killed one left behind. `dlm.data` reads what this writes.

torch is never imported here: `dlm pack` starts in a fraction of the seconds a torch import costs.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlm import __version__
from dlm.data.chat import TOKENIZER_CONFIG_NAME
from dlm.data.corpus import CorpusReader, Piece
from dlm.data.mixture import (
    MixtureInputs,
    WeightedSource,
    apply_weights,
    discover_sources,
    mixture_metadata,
    read_order,
)
from dlm.data.pack_plan import PackPlan, plan_pack
from dlm.data.tokenizer import load_tokenizer, special_token_id, tokenizer_sha256
from dlm.errors import UserError, reported_os_errors
from dlm.fileio import atomic_path, check_writable_directory, remove_stale_temporaries, temporary_path

PACKED_FORMAT = "dlm-packed-v1"
SPLITS = ("train", "val")
# The tokenizer's files that a pack copies: tokenizer_config.json (when one is beside the tokenizer) holds
# its chat template and special tokens, so whatever loads the tokenizer from the pack renders as the pack did.
TOKENIZER_FILES = ("tokenizer.json", TOKENIZER_CONFIG_NAME)
OUTPUT_FILES = (*TOKENIZER_FILES, *(f"{s}.{ext}" for s in SPLITS for ext in ("bin", "json")))
# Written by `dlm pack --chat` only (`dlm.data.chat_pack`): a loss mask beside a split's tokens. A plain pack
# removes them, since a mask that another pack's tokens left behind describes nothing.
MASK_SUFFIX = ".mask.bin"
MASK_FILES = tuple(f"{s}{MASK_SUFFIX}" for s in SPLITS)
# Encode about this much text per `encode_batch_fast` call: enough pieces for every core, little RAM.
BATCH_TEXT_BYTES = 1 << 20
PackProgress = Callable[[int, int, int], None]  # (bytes read, total bytes, tokens written)
SKIPPED_EXAMPLES = 5  # unreadable files named in the metadata and output; the rest are counted
WHOLE_PACK_KEYS = ("val_share", "duplicates_dropped", "skipped_files", "mixture")  # the same in every split


def mask_path(bin_path: Path) -> Path:
    """`train.bin` -> `train.mask.bin`: the loss mask a chat pack writes beside a split's tokens."""

    return bin_path.with_name(bin_path.stem + MASK_SUFFIX)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits in it, else uint32; always little-endian on disk."""

    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


@dataclass
class SplitSummary:
    """One packed split as written."""

    path: Path
    num_blocks: int
    num_tokens: int
    dropped_tokens: int
    documents: int
    text_bytes: int


@dataclass
class PackSummary:
    """What `pack_corpus` wrote."""

    output: Path
    vocab_size: int
    dtype: str
    seq_len: int
    input_bytes: int
    replaced_characters: int
    seconds: float
    splits: dict[str, SplitSummary] = field(default_factory=dict)
    val_share: dict[str, float] | None = None  # realised share of validation: text_bytes and tokens
    duplicates_dropped: dict[str, int] = field(default_factory=dict)  # documents and text_bytes
    skipped_files: dict[str, Any] = field(default_factory=dict)  # count and a few examples
    mixture: list[dict[str, Any]] | None = None  # each --source: weight, documents and tokens taken
    removed_temporaries: list[str] = field(default_factory=list)  # left by killed packs


@dataclass
class _Job:
    """What one pack writes, and with which settings."""

    output: Path
    tokenizer_path: Path
    tokenizer: Any
    seq_len: int
    seed: int
    val_fraction: float
    inputs: MixtureInputs

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


class _SplitWriter:
    """Streams one split's tokens to a temporary file and counts what went in."""

    def __init__(self, name: str, final: Path, dtype: np.dtype, eos: int):
        self.name, self.final = name, final
        self.temporary = temporary_path(final)
        self.handle = open(self.temporary, "wb")  # noqa: SIM115 - closed by close()
        self.eos = np.array([eos], dtype=dtype)
        self.pending: list[np.ndarray] = []
        self.tokens = self.documents = self.text_bytes = 0
        self.sources: set[int] = set()
        # By input file: what each weighted source put into the split (`dlm.data.mixture`).
        self.file_tokens: Counter[int] = Counter()
        self.file_documents: Counter[int] = Counter()

    def add(self, ids: np.ndarray, piece: Piece) -> None:
        self.pending.append(ids)
        self.text_bytes += piece.text_bytes
        self.sources.add(piece.source)
        self.file_tokens[piece.source] += ids.size + piece.last
        if piece.last:
            self.pending.append(self.eos)
            self.documents += 1
            self.file_documents[piece.source] += 1

    def flush(self) -> None:
        if self.pending:
            tokens = np.concatenate(self.pending)
            # A file write, not ndarray.tofile: a full disk then raises OSError with its errno.
            self.handle.write(tokens.data)
            self.tokens += tokens.size
            self.pending.clear()

    def close(self) -> None:
        self.handle.close()


def check_pack_arguments(seq_len: int, val_fraction: float, val_inputs: Sequence[Any]) -> None:
    """The block length and validation options that `dlm pack` (plain or --chat) accepts."""

    if seq_len < 2:
        raise UserError(f"seq_len must be at least 2, got {seq_len}", fix="pass --seq-len 2 or more")
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}", fix="for example --val-fraction 0.05")
    if val_fraction > 0 and val_inputs:
        raise UserError(
            "give either a validation fraction or validation inputs, not both",
            fix="drop --val-fraction or --val-input",
        )


def _check_output_dir(output: Path, tokenizer: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise UserError("output exists and is not a directory", path=output, fix="name a directory")
    existing = [name for name in (*OUTPUT_FILES, *MASK_FILES) if (output / name).exists()]
    for name in TOKENIZER_FILES:  # packing beside the tokenizer it was given is fine
        if name in existing and _same_file(output / name, tokenizer.parent / name):
            existing.remove(name)
    if existing and not overwrite:
        raise UserError(
            f"output already holds {', '.join(existing)}",
            path=output,
            fix="pass --overwrite to replace them, or choose another --output",
        )
    check_writable_directory(output)


def _same_file(path: Path, other: Path) -> bool:
    return path.exists() and other.exists() and path.samefile(other)


def copy_tokenizer(tokenizer: Path, output: Path) -> None:
    """Copy the tokenizer file and the tokenizer_config.json beside it into `output`; with no config
    beside the tokenizer, an old one in `output` is removed (its template belongs to another tokenizer)."""

    for name, source in zip(TOKENIZER_FILES, (tokenizer, tokenizer.parent / TOKENIZER_FILES[1]), strict=True):
        target = output / name
        if _same_file(target, source):
            continue
        if not source.exists():
            target.unlink(missing_ok=True)
            continue
        with atomic_path(target) as temporary:
            shutil.copyfile(source, temporary)


def _encode_stream(
    reader: CorpusReader, tokenizer: Any, dtype: np.dtype, plan: PackPlan
) -> Iterator[list[tuple[Piece, np.ndarray]]]:
    """Batches of (piece, token ids), each batch encoded in parallel by `encode_batch_fast`;
    duplicates are never encoded."""

    batch: list[Piece] = []
    size = 0
    for piece in reader.pieces():
        if plan.split_of(piece.document, piece.copy) is None:
            continue
        batch.append(piece)
        size += piece.text_bytes
        if size >= BATCH_TEXT_BYTES:
            yield _encode(batch, tokenizer, dtype)
            batch, size = [], 0
    if batch:
        yield _encode(batch, tokenizer, dtype)


def _encode(batch: list[Piece], tokenizer: Any, dtype: np.dtype) -> list[tuple[Piece, np.ndarray]]:
    encodings = tokenizer.encode_batch_fast([p.text for p in batch], add_special_tokens=False)
    return [(p, np.array(e.ids, dtype=dtype)) for p, e in zip(batch, encodings, strict=True)]


def pack_corpus(
    inputs: Sequence[str | Path],
    tokenizer: str | Path,
    seq_len: int,
    output: str | Path,
    val_fraction: float = 0.0,
    val_inputs: Sequence[str | Path] = (),
    seed: int = 0,
    text_field: str = "text",
    errors: str = "strict",
    overwrite: bool = False,
    progress: PackProgress | None = None,
    sources: Sequence[WeightedSource] = (),
) -> PackSummary:
    """Tokenize `inputs` (and weighted `sources`) into `output/{train,val}.{bin,json}` plus a copy
    of the tokenizer.

    Byte-identical documents are kept once, validation inputs' copies first; `val_fraction` is the
    share of the text's UTF-8 bytes held out, in whole documents drawn with `seed`; then each
    source's training documents are repeated or sampled by its weight (`dlm.data.mixture`), with `seed`.
    """

    started = time.perf_counter()
    output, tokenizer_path = Path(output), Path(tokenizer)
    check_pack_arguments(seq_len, val_fraction, val_inputs)
    loaded = load_tokenizer(tokenizer_path)
    # Text that spells a special token ("<|mask|>") is data: it must not become the real token.
    loaded.encode_special_tokens = True
    found = discover_sources(inputs, sources, val_inputs)
    _check_output_dir(output, tokenizer_path, overwrite)
    plan = plan_pack(found.paths, found.val_files, val_fraction, seed, text_field, errors)
    if not plan.fates:
        raise UserError("the corpus is empty: no text in any input file", path=found.paths[found.val_files])
    apply_weights(plan, found, seed)
    removed = remove_stale_temporaries(output, [*OUTPUT_FILES, *MASK_FILES])
    reader = CorpusReader(found.paths, text_field=text_field, errors=errors, order=read_order(found))
    job = _Job(output, tokenizer_path, loaded, seq_len, seed, val_fraction, found)
    wanted = ("train", "val") if val_fraction > 0 or found.val_files else ("train",)
    metadata = _write_output(job, reader, plan, wanted, progress)
    splits = {name: SplitSummary(output / f"{name}.bin", **_split_counts(meta)) for name, meta in metadata.items()}
    whole_pack = {key: metadata["train"][key] for key in WHOLE_PACK_KEYS}
    return PackSummary(
        output,
        job.vocab_size,
        token_dtype(job.vocab_size).name,
        seq_len,
        reader.input_bytes,
        reader.replaced_characters,
        time.perf_counter() - started,
        splits,
        **whole_pack,
        removed_temporaries=[str(path) for path in removed],
    )


def _write_output(
    job: _Job, reader: CorpusReader, plan: PackPlan, wanted: Sequence[str], progress: PackProgress | None
) -> dict[str, dict[str, Any]]:
    """Stream the planned documents into the splits and commit them; on any failure remove every
    temporary and each directory this created. A failed write (a full disk) is a `UserError`."""

    output, dtype, eos = job.output, token_dtype(job.vocab_size), special_token_id(job.tokenizer, "eos")
    created = [d for d in (output, *output.absolute().parents) if not d.exists()]
    writers: dict[str, _SplitWriter] = {}
    committed = False
    with reported_os_errors("the packed data", output):
        try:
            output.mkdir(parents=True, exist_ok=True)
            writers.update({name: _SplitWriter(name, output / f"{name}.bin", dtype, eos) for name in wanted})
            _stream(reader, job.tokenizer, dtype, writers, plan, progress)
            metadata = _finish_splits(job, writers, reader, plan)
            _commit(output, writers, metadata, job.tokenizer_path)
            committed = True
        finally:
            for writer in writers.values():
                writer.close()
                writer.temporary.unlink(missing_ok=True)
                temporary_path(output / f"{writer.name}.json").unlink(missing_ok=True)
            for name in TOKENIZER_FILES:
                temporary_path(output / name).unlink(missing_ok=True)
            if not committed:
                _remove_empty(created)
    return metadata


def _stream(
    reader: CorpusReader,
    tokenizer: Any,
    dtype: np.dtype,
    writers: dict[str, _SplitWriter],
    plan: PackPlan,
    progress: PackProgress | None,
) -> None:
    for batch in _encode_stream(reader, tokenizer, dtype, plan):
        for piece, ids in batch:
            split = plan.split_of(piece.document, piece.copy)
            assert split is not None, "_encode_stream yields only the pieces a split takes"
            writers[split].add(ids, piece)
        for writer in writers.values():
            writer.flush()
        if progress is not None:
            tokens = sum(writer.tokens for writer in writers.values())
            progress(reader.bytes_read, reader.total_bytes, tokens)


def _split_counts(meta: dict[str, Any]) -> dict[str, int]:
    fields = ("num_blocks", "num_tokens", "dropped_tokens", "documents", "text_bytes")
    return {key: meta[key] for key in fields}


def _pack_metadata(job: _Job, writers: dict[str, _SplitWriter], plan: PackPlan) -> dict[str, Any]:
    """What the whole pack did, recorded in each split's metadata: the realised validation share
    (of the text bytes, and of the tokens before the cut to whole blocks), the duplicates dropped,
    the files skipped and, with weighted sources, what each put into training."""

    val_share, skipped, train = None, job.inputs.skipped, writers["train"]
    if "val" in writers:
        text_bytes, tokens = (sum(getattr(w, key) for w in writers.values()) for key in ("text_bytes", "tokens"))
        val_share = {"text_bytes": writers["val"].text_bytes / text_bytes, "tokens": writers["val"].tokens / tokens}
    return {
        "val_share": val_share,
        "duplicates_dropped": {"documents": plan.duplicates, "text_bytes": plan.duplicate_bytes},
        "skipped_files": {"count": len(skipped), "examples": [str(p) for p in skipped[:SKIPPED_EXAMPLES]]},
        "mixture": mixture_metadata(job.inputs, train.file_documents, train.file_tokens),
    }


def _finish_splits(
    job: _Job, writers: dict[str, _SplitWriter], reader: CorpusReader, plan: PackPlan
) -> dict[str, dict[str, Any]]:
    """Cut each split to whole blocks and build its metadata; refuse a split under one block."""

    metadata = {}
    sha256 = tokenizer_sha256(job.tokenizer_path)
    seq_len, vocab_size = job.seq_len, job.vocab_size
    for writer in writers.values():
        writer.flush()
    whole_pack = _pack_metadata(job, writers, plan)
    for name, writer in writers.items():
        writer.flush()
        writer.close()
        blocks = writer.tokens // seq_len
        if blocks == 0:
            raise UserError(
                f"the {name} split has {writer.tokens} tokens, fewer than one block of {seq_len}",
                fix="use a smaller --seq-len or more text"
                + (" (a larger --val-fraction or more --val-input files)" if name == "val" else ""),
            )
        itemsize = token_dtype(vocab_size).itemsize
        with open(writer.temporary, "r+b") as handle:
            handle.truncate(blocks * seq_len * itemsize)  # drop the final partial block
        metadata[name] = {
            "format": PACKED_FORMAT,
            "split": name,
            "vocab_size": vocab_size,
            "tokenizer_sha256": sha256,
            "seq_len": seq_len,
            "dtype": token_dtype(vocab_size).name,
            "num_blocks": blocks,
            "num_tokens": blocks * seq_len,
            "dropped_tokens": writer.tokens - blocks * seq_len,
            "documents": writer.documents,
            "text_bytes": writer.text_bytes,  # every document of the split, dropped tail included
            "eos_token_id": int(writer.eos[0]),
            "seed": job.seed,
            "val_fraction": job.val_fraction,  # asked for: a share of the text bytes
            **whole_pack,
            "sources": [vars(reader.sources[i]) for i in sorted(writer.sources)],
            "dlm_version": __version__,
        }
    return metadata


def _commit(
    output: Path, writers: dict[str, _SplitWriter], metadata: dict[str, dict[str, Any]], tokenizer: Path
) -> None:
    """Rename everything into place; the metadata files, which make a split loadable, come last."""

    staged = {output / f"{name}.json": json.dumps(meta, indent=2) + "\n" for name, meta in metadata.items()}
    for final, text in staged.items():
        temporary_path(final).write_text(text, encoding="utf-8")
    copy_tokenizer(tokenizer, output)
    for name in SPLITS:  # stale metadata goes first: a half-replaced split must never load
        (output / f"{name}.json").unlink(missing_ok=True)
        mask_path(output / f"{name}.bin").unlink(missing_ok=True)  # a chat pack's (MASK_FILES)
        if name not in writers:
            (output / f"{name}.bin").unlink(missing_ok=True)
    for writer in writers.values():
        writer.temporary.replace(writer.final)
    for final in staged:
        temporary_path(final).replace(final)


def _remove_empty(directories: list[Path]) -> None:
    """Remove the directories a failed pack created (deepest first), leaving any that hold files."""

    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return
