"""Which documents `dlm pack` keeps, and in which split: exact deduplication and a byte-sized split.

A first, cheap pass over the corpus (reading, decompressing and hashing the bundled gzipped plays
runs at about 40 MB/s on one core; tokenizing them at 1 to 3 MB/s) records each document's sha256
and UTF-8 size, so both decisions are made before any token is written:

- **Deduplication.** A document whose text is byte-identical to an earlier one is dropped. Validation
  inputs are read first, so a training document identical to a validation one is the one dropped:
  no training text ever leaks into validation. Memory grows by about 100 bytes per document (the
  set of hashes); the text itself is never held.
- **The validation fraction** is a share of the text's UTF-8 bytes, not of the documents: one long
  file among many short ones must not put half the tokens into validation. Whole documents, taken in
  a seeded random order, fill validation up to `fraction x total bytes` without passing it; then the
  smallest document left is added if that brings the share closer to the target. Bytes are known
  before tokenizing, and tokens follow them closely; the realised shares of both are reported.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dlm.data.corpus import CorpusReader

TRAIN, VAL, DUPLICATE = 0, 1, 2
_SPLIT_NAMES = {TRAIN: "train", VAL: "val"}


@dataclass
class PackPlan:
    """The fate of every document, by its index in the reading order."""

    fates: bytearray = field(default_factory=bytearray)  # TRAIN, VAL or DUPLICATE
    sizes: array = field(default_factory=lambda: array("q"))  # UTF-8 bytes of each document
    files: array = field(default_factory=lambda: array("I"))  # the input each document comes from
    duplicates: int = 0
    duplicate_bytes: int = 0
    copies: np.ndarray | None = None  # training copies of each document (`dlm.data.mixture`); None: one each

    def split_of(self, document: int, copy: int = 0) -> str | None:
        """ "train" or "val" for reading `copy` of a document; None for a duplicate or a copy not taken."""

        fate = self.fates[document]
        if fate == TRAIN and self.copies is not None:
            return "train" if copy < self.copies[document] else None
        return _SPLIT_NAMES.get(fate) if copy == 0 else None


def plan_pack(
    paths: Sequence[Path],
    val_files: int,
    val_fraction: float,
    seed: int,
    text_field: str = "text",
    errors: str = "strict",
) -> PackPlan:
    """Plan the documents of `paths`, whose first `val_files` are validation inputs."""

    plan = _hash_documents(paths, val_files, text_field, errors)
    if val_fraction > 0:
        candidates = np.flatnonzero(np.frombuffer(bytes(plan.fates), dtype=np.uint8) == TRAIN)
        for document in choose_by_bytes(np.asarray(plan.sizes, dtype=np.int64), candidates, val_fraction, seed):
            plan.fates[document] = VAL
    return plan


def _hash_documents(paths: Sequence[Path], val_files: int, text_field: str, errors: str) -> PackPlan:
    """Read every document once: its size, and whether an earlier one had the same text."""

    plan = PackPlan()
    seen: set[bytes] = set()
    digest, size = hashlib.sha256(), 0
    for piece in CorpusReader(paths, text_field=text_field, errors=errors).pieces():
        digest.update(piece.text.encode("utf-8"))
        size += piece.text_bytes
        if not piece.last:
            continue
        key = digest.digest()
        if key in seen:
            fate = DUPLICATE
            plan.duplicates += 1
            plan.duplicate_bytes += size
        else:
            seen.add(key)
            fate = VAL if piece.source < val_files else TRAIN
        plan.fates.append(fate)
        plan.sizes.append(size)
        plan.files.append(piece.source)
        digest, size = hashlib.sha256(), 0
    return plan


def choose_by_bytes(sizes: np.ndarray, candidates: np.ndarray, fraction: float, seed: int) -> list[int]:
    """Candidates (document indices) whose sizes add up closest to `fraction` of all candidates'
    bytes: a seeded greedy fill that never passes the target, then the one smallest step over it
    when that lands closer. Deterministic in `seed`."""

    target = fraction * float(sizes[candidates].sum())
    chosen: list[int] = []
    held, smallest = 0, None
    for document in np.random.default_rng(seed).permutation(candidates).tolist():
        size = int(sizes[document])
        if held + size <= target:
            chosen.append(document)
            held += size
        elif smallest is None or size < sizes[smallest]:
            smallest = document
    # Every document passed over is larger than what is missing now: the smallest overshoots least.
    if smallest is not None and sizes[smallest] - (target - held) < target - held:
        chosen.append(smallest)
    return sorted(chosen)
