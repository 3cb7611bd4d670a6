"""Two plain figures of whether samples are text: do their words exist, and are there enough of them.

A weak model with a greedy sampler writes blank lines and fragments such as "noweasant"; a good
one writes words of its training text at about the density of real text. `corpus_words` collects
the words of a corpus and its words per token under a tokenizer (the density to compare with),
and `sample_quality` scores the words a model wrote: the share found in the corpus, and words per
generated token. Words are runs of letters (an inner apostrophe kept: "o'er"), compared in lower case.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.data.corpus import CorpusReader

WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)*")


def words(text: str) -> list[str]:
    """The words of `text`, lower-cased."""

    return [word.lower() for word in WORD.findall(text)]


@dataclass(frozen=True)
class CorpusWords:
    """The distinct words of a corpus, and its words per token under the tokenizer it was read with."""

    vocabulary: frozenset[str]
    words: int
    tokens: int

    @property
    def words_per_token(self) -> float:
        return self.words / self.tokens if self.tokens else 0.0


def corpus_words(paths: Sequence[Path], tokenizer: Any | None = None) -> CorpusWords:
    """Read `paths` (any corpus format dlm packs) for their words; with a `tokenizer`, also count
    the tokens their text encodes to, for the words-per-token density of real text."""

    vocabulary: set[str] = set()
    total_words = total_tokens = 0
    for piece in CorpusReader(paths, errors="replace").pieces():
        found = words(piece.text)
        vocabulary.update(found)
        total_words += len(found)
        if tokenizer is not None:
            total_tokens += len(tokenizer.encode(piece.text, add_special_tokens=False).ids)
    return CorpusWords(frozenset(vocabulary), total_words, total_tokens)


@dataclass(frozen=True)
class SampleQuality:
    """The words a model wrote (a sample's words less those of its prompt or template)."""

    words: int
    known_words: int  # of them, those that occur in the reference corpus
    generated_tokens: int

    @property
    def known_share(self) -> float:
        return self.known_words / self.words if self.words else 0.0

    @property
    def words_per_token(self) -> float:
        return self.words / self.generated_tokens if self.generated_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "words": self.words,
            "known_words": self.known_words,
            "generated_tokens": self.generated_tokens,
            "known_word_share": round(self.known_share, 4),
            "words_per_token": round(self.words_per_token, 4),
        }


def sample_quality(text: str, fixed_text: str, generated_tokens: int, vocabulary: frozenset[str]) -> SampleQuality:
    """Score the words of `text` that its `fixed_text` (prompt, or template without its masks)
    does not account for, against `vocabulary`, over the `generated_tokens` the model wrote."""

    written = Counter(words(text)) - Counter(words(fixed_text))
    known = sum(count for word, count in written.items() if word in vocabulary)
    return SampleQuality(sum(written.values()), known, generated_tokens)


def pooled(qualities: Sequence[SampleQuality]) -> SampleQuality:
    """Several samples' figures as one: words and tokens summed."""

    return SampleQuality(
        sum(q.words for q in qualities),
        sum(q.known_words for q in qualities),
        sum(q.generated_tokens for q in qualities),
    )
