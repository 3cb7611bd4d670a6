"""Weighted sources for `dlm pack`: blend corpora by repeating or sampling each one's documents.

`--source PATH:WEIGHT` names a file, directory or glob and a weight 0 < w <= 1000. Every training
document of the source is packed floor(w) times, and round(frac(w) x n) of its n training documents (halves
rounded up), drawn with the pack seed, once more: 2 packs each document twice, 0.5 a seeded half of
them, 1.5 every document once and a seeded half a second time. The same seed draws the same ones.

Repeats are whole passes over the source (all of it, then all of it again), so two copies of a
document are a whole source apart, never side by side in a block. Weights shape training only:
deduplication and the validation split come first, over the documents as read, and a validation
document is packed once. A document whose text another source already holds is a duplicate, dropped
from the later source. Positional inputs are sources of weight 1.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlm.data.corpus import discover_corpus
from dlm.data.pack_plan import TRAIN, PackPlan
from dlm.errors import UserError

SOURCE_FIX = "write --source PATH:WEIGHT, for example --source web/:2 or --source books.parquet:0.5"
# Each unit of weight is one more whole pass over the source (`read_order` lists them, and a document's
# copies are a uint32), so a huge weight would read for ever or overflow. Weights are relative: a
# larger ratio than this is a smaller weight for the other sources.
MAX_WEIGHT = 1000


@dataclass(frozen=True)
class WeightedSource:
    """A training input as given (file, directory or glob) and its weight."""

    input: str
    weight: float = 1.0


def parse_source(text: str) -> WeightedSource:
    """`PATH:WEIGHT` (the last colon splits, so a path may hold colons)."""

    path, colon, weight = text.rpartition(":")
    if not colon or not path:
        raise UserError(f"--source {text!r} has no weight", fix=SOURCE_FIX)
    try:
        value = float(weight)
    except ValueError:
        raise UserError(f"--source {text!r}: the weight {weight!r} is not a number", fix=SOURCE_FIX) from None
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"--source {text!r}: the weight must be a positive number", fix=SOURCE_FIX)
    if value > MAX_WEIGHT:
        raise UserError(
            f"--source {text!r}: the weight is over {MAX_WEIGHT:,} (each unit is one more pass over the source)",
            fix="weights are relative: give the other sources smaller ones",
        )
    return WeightedSource(path, value)


@dataclass
class MixtureInputs:
    """The files of a pack: validation inputs first, then each training source's files in turn."""

    paths: list[Path]
    val_files: int
    skipped: list[Path]
    sources: list[WeightedSource]
    file_source: list[int]  # the source of each training file (`paths[val_files + k]`)
    weighted: bool  # a --source was given: the mixture is recorded in the metadata
    source_documents: list[int] = field(default_factory=list)  # distinct training documents, by source

    def source_files(self, source: int) -> list[int]:
        return [self.val_files + k for k, owner in enumerate(self.file_source) if owner == source]


def discover_sources(
    inputs: Sequence[str | Path], sources: Sequence[WeightedSource], val_inputs: Sequence[str | Path]
) -> MixtureInputs:
    """Find every source's files; a file two sources name belongs to the first, if the weights agree."""

    training = [WeightedSource(str(item)) for item in inputs] + list(sources)
    if not training:
        raise UserError("no inputs given", fix="pass text files, directories or globs, or --source PATH:WEIGHT")
    val = discover_corpus(val_inputs) if val_inputs else None
    owner: dict[Path, int] = {}
    skipped: dict[Path, None] = {}
    for index, source in enumerate(training):
        found = discover_corpus([source.input])
        skipped.update(dict.fromkeys(found.skipped))
        for path in found.paths:
            first = training[owner.setdefault(path, index)]
            if first.weight != source.weight:
                raise UserError(
                    f"is in two sources with different weights ({first.input}:{first.weight:g} and "
                    f"{source.input}:{source.weight:g})",
                    path=path,
                    fix="name each file in one source only",
                )
    val_paths = val.paths if val else []
    check_disjoint(list(owner), val_paths)
    skipped.update(dict.fromkeys(val.skipped if val else []))
    return MixtureInputs(
        val_paths + list(owner), len(val_paths), list(skipped), training, list(owner.values()), bool(sources)
    )


def check_disjoint(train_paths: Sequence[Path], val_paths: Sequence[Path]) -> None:
    """Refuse a file that is both a training and a validation input (paths as `discover_corpus` finds them,
    resolved): its text would be scored on what the model trained on."""

    if shared := set(train_paths) & set(val_paths):
        raise UserError("file is both a training and a validation input", path=sorted(shared)[0])


def read_order(inputs: MixtureInputs) -> list[tuple[int, int]]:
    """(file, copy) readings for the packing pass: validation once, then each source in whole passes."""

    order = [(index, 0) for index in range(inputs.val_files)]
    for index, source in enumerate(inputs.sources):
        files = inputs.source_files(index)
        for copy in range(math.ceil(source.weight)):
            order.extend((file, copy) for file in files)
    return order


def apply_weights(plan: PackPlan, inputs: MixtureInputs, seed: int) -> None:
    """Set `plan.copies`, each training document's number of copies, and count each source's documents."""

    fates = np.frombuffer(bytes(plan.fates), dtype=np.uint8)
    files = np.asarray(plan.files, dtype=np.int64)
    # Source of each document; validation files map to -1 (their documents are never weighted).
    owners = np.concatenate([np.full(inputs.val_files, -1), np.asarray(inputs.file_source, dtype=np.int64)])
    document_source = owners[files] if files.size else files
    copies = np.zeros(len(fates), dtype=np.uint32)
    inputs.source_documents = []
    for index, source in enumerate(inputs.sources):
        documents = np.flatnonzero((fates == TRAIN) & (document_source == index))
        whole = math.floor(source.weight)
        extra = math.floor((source.weight - whole) * documents.size + 0.5)
        copies[documents] = whole
        # Its own stream per source: adding a source never changes which documents another one draws.
        chosen = np.random.default_rng([seed, index]).permutation(documents)[:extra]
        copies[chosen] += 1
        inputs.source_documents.append(int(documents.size))
    plan.copies = copies


def mixture_metadata(
    inputs: MixtureInputs, documents: Counter[int], tokens: Counter[int]
) -> list[dict[str, Any]] | None:
    """Each source with its weight, files, distinct training documents, and the documents and tokens
    (end-of-document tokens included, before the cut to whole blocks) it put into training."""

    if not inputs.weighted:
        return None
    entries = []
    for index, source in enumerate(inputs.sources):
        files = inputs.source_files(index)
        entries.append(
            {
                "input": source.input,
                "weight": source.weight,
                "files": len(files),
                "documents": inputs.source_documents[index],
                "documents_taken": sum(documents[file] for file in files),
                "tokens": sum(tokens[file] for file in files),
            }
        )
    return entries
