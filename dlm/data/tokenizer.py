"""Byte-level BPE tokenizers: training on a streamed corpus, loading, and the special tokens.

Byte-level BPE maps every UTF-8 string to tokens and back exactly, with no unknown token. The three
special tokens come first, so their ids are fixed (0, 1, 2) whatever the corpus; the requested
vocabulary size counts them, and training refuses to return a tokenizer of any other size.

Before the usual byte-level split, the pre-tokenizer cuts the text after every newline. That makes
tokens never cross a line break, so a document encoded piece by piece (as `dlm pack` does, in
parallel) gets exactly the tokens of `tokenizer.encode(document)` at sampling time.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dlm.data.chat import TOKENIZER_CONFIG_NAME, read_config, special_tokens_of
from dlm.data.corpus import CorpusReader, check_output_file, discover_inputs
from dlm.data.sizing import VocabularyFit, corpus_vocabulary_warning, vocabulary_fit
from dlm.errors import UserError, reported_os_errors
from dlm.fileio import atomic_write_text

# The one source of truth for the special tokens; their order fixes their ids (0, 1, 2).
SPECIAL_TOKENS: dict[str, str] = {
    "eos": "<|endoftext|>",  # end of document: separates packed documents
    "mask": "<|mask|>",  # the absorbing state of masked diffusion
    "pad": "<|pad|>",
}
BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)

# `dlm tokenizer train` counts the tokens of a corpus up to this size (it keeps the text it read and
# encodes it once more, about a second per MB): above it, about 5M tokens, even a 32768-token
# vocabulary averages over 100 occurrences a token. `dlm validate` counts train.bin at any size
# up to its own, larger limit.
COUNTED_BYTES_LIMIT = 16 * 10**6

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

ProgressCallback = Callable[[int, int], None]  # (bytes read, total bytes)


@dataclass(frozen=True)
class TokenizerSummary:
    """What `train_tokenizer` wrote, with the config lines that match it."""

    path: Path
    vocab_size: int
    special_token_ids: dict[str, int]
    sha256: str
    files: int
    documents: int
    input_bytes: int
    replaced_characters: int
    seconds: float
    config_lines: list[str] = field(default_factory=list)
    # How often the learned tokens occur in the corpus (`VocabularyFit.to_dict`), None above
    # COUNTED_BYTES_LIMIT; `warning` says when the vocabulary is too large for the corpus.
    vocab_fit: dict[str, Any] | None = None
    warning: str | None = None


def _corpus_fit(tokenizer: Tokenizer, pieces: list[str], vocab_size: int) -> VocabularyFit:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for encoding in tokenizer.encode_batch(pieces, add_special_tokens=False):
        counts += np.bincount(np.asarray(encoding.ids, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    return vocabulary_fit(counts, vocab_size, MIN_VOCAB_SIZE)


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer with dlm's pre-tokenizer and decoder."""

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split("\n", behavior="merged_with_previous"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(
    inputs: Sequence[str | Path],
    vocab_size: int,
    output: str | Path,
    text_field: str = "text",
    errors: str = "strict",
    progress: ProgressCallback | None = None,
    overwrite: bool = False,
) -> TokenizerSummary:
    """Train a byte-level BPE of exactly `vocab_size` tokens (specials included) on `inputs`."""

    started = time.perf_counter()
    output = Path(output)
    if vocab_size < MIN_VOCAB_SIZE:
        raise UserError(
            f"vocab size {vocab_size} is too small: the {BYTE_ALPHABET_SIZE} byte tokens and "
            f"{len(SPECIAL_TOKENS)} special tokens need {MIN_VOCAB_SIZE}",
            fix=f"pass --vocab-size {MIN_VOCAB_SIZE} or more",
        )
    check_output_file(output, overwrite)
    reader = CorpusReader(discover_inputs(inputs), text_field=text_field, errors=errors)
    # The text, kept while it is small enough to count its tokens after training (no second read).
    kept: list[str] | None = []
    kept_bytes = 0

    def texts() -> Iterator[str]:
        nonlocal kept, kept_bytes
        for piece in reader.pieces():
            if kept is not None:
                kept_bytes += len(piece.text.encode("utf-8"))
                kept.append(piece.text)
                if kept_bytes > COUNTED_BYTES_LIMIT:
                    kept = None
            yield piece.text
            if progress is not None:
                progress(reader.bytes_read, reader.total_bytes)

    tokenizer = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer)
    if reader.documents == 0:
        raise UserError("the corpus is empty: no text in any input file", path=reader.paths[0])
    learned = tokenizer.get_vocab_size(with_added_tokens=True)
    if learned != vocab_size:
        raise UserError(
            f"the corpus supports only {learned} tokens, fewer than the requested {vocab_size}",
            fix=f"pass --vocab-size {learned} or less, or train on more text",
        )
    if not has_dlm_special_tokens(tokenizer):  # the trainer puts them first: a broken invariant, not user data
        raise AssertionError("the trained tokenizer lacks dlm's special tokens at their fixed ids")
    fit = None if kept is None else _corpus_fit(tokenizer, kept, learned)
    _save(tokenizer, output)
    ids = {name: special_token_id(tokenizer, name) for name in SPECIAL_TOKENS}
    return TokenizerSummary(
        path=output,
        vocab_size=learned,
        special_token_ids=ids,
        sha256=tokenizer_sha256(output),
        files=len(reader.paths),
        documents=reader.documents,
        input_bytes=reader.total_bytes,
        replaced_characters=reader.replaced_characters,
        seconds=time.perf_counter() - started,
        config_lines=[f"vocab_size = {learned}", f"mask_token_id = {ids['mask']}"],
        vocab_fit=None if fit is None else fit.to_dict(),
        warning=None if fit is None else corpus_vocabulary_warning(fit, kept_bytes),
    )


def _save(tokenizer: Tokenizer, output: Path) -> None:
    """Write under a temporary name, then rename: a reader never sees a half-written file.

    Python writes the bytes (exactly those of `Tokenizer.save`), so a full disk is an OSError with
    its errno, which `reported_os_errors` turns into one `error:` line; the Rust writer raises a
    bare Exception instead."""

    with reported_os_errors("the tokenizer", output):
        output.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output, tokenizer.to_str(pretty=True))


# The tokenizer_config.json fields (Hugging Face's) that name an imported tokenizer's special tokens.
ROLE_FIELDS = {"eos": "eos_token", "mask": "mask_token", "pad": "pad_token"}
_ROLES_ATTRIBUTE = "dlm_special_tokens"


def has_dlm_special_tokens(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer is one of dlm's: its special tokens at their fixed ids (else an imported one)."""

    special = {token.content: index for index, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    return all(special.get(token) == index for index, token in enumerate(SPECIAL_TOKENS.values()))


def _declared_roles(tokenizer: Tokenizer, path: Path) -> dict[str, str] | None:
    """The special tokens a tokenizer_config.json beside `path` names (an imported model's), or None
    when it names no end-of-document token that the tokenizer holds."""

    config = path.parent / TOKENIZER_CONFIG_NAME
    if not config.is_file():
        return None
    named = special_tokens_of(read_config(config))
    roles = {role: named[field] for role, field in ROLE_FIELDS.items() if field in named}
    roles = {role: token for role, token in roles.items() if tokenizer.token_to_id(token) is not None}
    return roles if "eos" in roles else None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer.json: dlm's own, with its special tokens at their fixed ids, or an imported
    one whose tokenizer_config.json names its end-of-document (and mask, pad) tokens."""

    path = Path(path)
    if not path.is_file():
        raise UserError("tokenizer file not found", path=path, fix="train one with `dlm tokenizer train`")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise UserError(f"not a tokenizer.json: {exc}", path=path) from None
    if has_dlm_special_tokens(tokenizer):
        return tokenizer
    roles = _declared_roles(tokenizer, path)
    if roles is None:
        listed = ", ".join(f"{token} = {index}" for index, token in enumerate(SPECIAL_TOKENS.values()))
        raise UserError(
            f"tokenizer lacks dlm's special tokens ({listed}) and no tokenizer_config.json beside it names "
            "its eos_token",
            path=path,
            fix="train it with `dlm tokenizer train`, or use the tokenizer of a model made by `dlm import`",
        )
    setattr(tokenizer, _ROLES_ATTRIBUTE, roles)
    return tokenizer


def special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """The text of each special token the tokenizer has, by role ("eos", "mask", "pad"): dlm's
    own, or those an imported tokenizer's tokenizer_config.json names (`load_tokenizer`)."""

    return dict(getattr(tokenizer, _ROLES_ATTRIBUTE, SPECIAL_TOKENS))


def optional_token_id(tokenizer: Tokenizer, name: str) -> int | None:
    """The id of special token `name`, or None when the tokenizer has none (an imported one without pad)."""

    if name not in SPECIAL_TOKENS:
        raise ValueError(f"unknown special token {name!r}; expected one of {list(SPECIAL_TOKENS)}")
    token = special_tokens(tokenizer).get(name)
    return None if token is None else tokenizer.token_to_id(token)


def never_sampled_ids(tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Ids a model of `vocab_size` rows must never generate: the padding token, and the rows past an
    imported tokenizer's vocabulary (a checkpoint's padded embedding), which decode to nothing."""

    pad = optional_token_id(tokenizer, "pad")
    unused = (
        [] if has_dlm_special_tokens(tokenizer) else range(tokenizer.get_vocab_size(with_added_tokens=True), vocab_size)
    )
    return ([pad] if pad is not None and pad < vocab_size else []) + list(unused)


def special_token_id(tokenizer: Tokenizer, name: str) -> int:
    """The id of special token `name` ("eos", "mask" or "pad")."""

    token_id = optional_token_id(tokenizer, name)
    if token_id is None:
        token = special_tokens(tokenizer).get(name, SPECIAL_TOKENS[name])
        raise UserError(f"tokenizer has no {token} token", fix="train it with `dlm tokenizer train`")
    return token_id


def tokenizer_sha256(path: str | Path) -> str:
    """Hex sha256 of the tokenizer file's bytes: packed data and checkpoints record it."""

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE token stands for (GPT-2's mapping): printable
    Latin-1 characters stand for their own code, the other 68 bytes for characters from U+0100 on."""

    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)}
    alphabet, shifted = {}, 0
    for byte in range(BYTE_ALPHABET_SIZE):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(BYTE_ALPHABET_SIZE + shifted)] = byte
            shifted += 1
    return alphabet


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """The UTF-8 bytes each token id decodes to, as an int64 table indexed by id.

    Byte-level BPE makes this exact: the bytes of any id sequence sum to the UTF-8 size of its text,
    so bits per byte can count the bytes of exactly the tokens scored. Special tokens stand for no
    text and count 0. As the ByteLevel decoder does, a token with any character outside the byte
    alphabet (an added token such as "日本") decodes to its own UTF-8 bytes.
    """

    alphabet = byte_level_alphabet()
    vocabulary = tokenizer.get_vocab(with_added_tokens=True)
    special = {index for index, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    lengths = np.zeros(max(vocabulary.values()) + 1, dtype=np.int64)
    byte_level = type(tokenizer.decoder).__name__ == "ByteLevel" or tokenizer.decoder is None
    for token, index in vocabulary.items():
        if index in special:
            continue
        if byte_level:
            lengths[index] = len(token) if all(char in alphabet for char in token) else len(token.encode("utf-8"))
        else:  # SentencePiece-style (Mistral, Llama 2): byte fallback <0xNN> and "\u2581" for a space
            lengths[index] = 1 if _BYTE_PIECE.fullmatch(token) else len(token.replace("\u2581", " ").encode("utf-8"))
    return lengths
