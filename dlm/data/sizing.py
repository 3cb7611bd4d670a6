"""Sizing the vocabulary, the model and the step budget to the training text.

The one owner of the rules behind `dlm tokenizer train`'s warning and `dlm validate`'s sizing rows
(`train data vocabulary`, `model size for data`, `training budget`): what is too large for the data,
and what to pick instead. Each verdict is an `Advice` (a detail, and a fix when something is too
large); the callers only place it. Warnings never fail a command.

The thresholds come from ten-minute CPU runs on 1.3 MB of the King James Bible (docs/benchmarks.md,
"Sizing to a small corpus"), where `configs/cpu.toml` ended at its unigram level:

- a learned token seen fewer than RARE_COUNT times is rare; 8192 tokens left 78% of them rare there
  (0.0 bits/byte below the unigram level, with the cpu.toml model), 4096 tokens 40%, and 2048 13%
  (the best);
- parameters per training token: 3.3 learned, 18 did not;
- epochs of the planned steps: ...

No torch: `dlm tokenizer train` imports it; a model's parameters are counted from its config
(`dlm.config.shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dlm.config.schema import ModelConfig
from dlm.config.shapes import count_parameters, format_parameter_count

RARE_COUNT = 10
RARE_SHARE_LIMIT = 0.25
MAX_PARAMETERS_PER_TOKEN = 4
MAX_EPOCHS = 4



def text_size(text_bytes: int) -> str:
    return f"{text_bytes / 1e6:.1f} MB" if text_bytes >= 10**6 else f"{text_bytes / 1e3:.0f} kB"


@dataclass(frozen=True)
class Advice:
    """One sizing verdict: what was found, and what to change when something is too large."""

    detail: str
    fix: str = ""

    @property
    def too_large(self) -> bool:
        return bool(self.fix)


@dataclass(frozen=True)
class VocabularyFit:
    """How many of a vocabulary's learned tokens (past the byte alphabet and the special tokens)
    occur fewer than RARE_COUNT times in some text."""

    vocab_size: int
    learned: int
    rare: int

    @property
    def rare_share(self) -> float:
        return self.rare / self.learned if self.learned else 0.0

    @property
    def too_large(self) -> bool:
        return self.rare_share >= RARE_SHARE_LIMIT

    def suggested_sizes(self) -> tuple[int, int]:
        """The powers of two around the tokens that are not rare (bytes and specials included).

        Merges are learned most frequent first, so a smaller vocabulary keeps the frequent tokens,
        and its tokens occur more often than here: the upper end is the one to try first."""

        base = self.vocab_size - self.learned
        frequent = base + self.learned - self.rare
        upper = 1 << max(frequent - 1, 1).bit_length()
        if upper >= self.vocab_size:
            upper //= 2
        return max(upper // 2, base), max(upper, base)

    def detail(self, amount: str, where: str) -> str:
        """What was counted, e.g. "8192 tokens for 1.3 MB of text: 78% of the 7,933 learned tokens
        occur fewer than 10 times in it", with `amount` the size of the text and `where` the text;
        when the vocabulary is too large, the sizes that suit the text follow."""

        text = (
            f"{self.vocab_size} tokens for {amount}: {self.rare_share:.0%} of the {self.learned:,} learned tokens "
            f"occur fewer than {RARE_COUNT} times {where}"
        )
        if self.too_large:
            low, high = self.suggested_sizes()
            sizes = str(high) if low == high else f"{low}\u2013{high}"
            text += f", too rare to learn; about {sizes} tokens suit this size"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "learned_tokens": self.learned,
            "rare_tokens": self.rare,
            "rare_below": RARE_COUNT,
            "rare_share": self.rare_share,
            "too_large": self.too_large,
            "suggested_vocab_sizes": list(self.suggested_sizes()) if self.too_large else None,
        }


def vocabulary_fit(counts: np.ndarray, vocab_size: int, first_learned: int) -> VocabularyFit:
    """The fit of a vocabulary from `counts`, the occurrences of each token id in a text; the ids
    from `first_learned` up are the learned ones (a byte-level BPE's merges)."""

    learned = np.zeros(max(vocab_size - first_learned, 0), dtype=np.int64)
    seen = counts[first_learned:vocab_size]
    learned[: len(seen)] = seen
    return VocabularyFit(vocab_size, len(learned), int((learned < RARE_COUNT).sum()))


def corpus_vocabulary_warning(fit: VocabularyFit, text_bytes: int) -> str | None:
    """`dlm tokenizer train`'s one warning line, or None when the vocabulary suits the corpus."""

    if not fit.too_large:
        return None
    return (
        f"{fit.detail(f'{text_size(text_bytes)} of text', 'in it')} "
        f"(retrain with --vocab-size {fit.suggested_sizes()[1]}, or train on more text)"
    )


def packed_vocabulary_advice(fit: VocabularyFit, tokens: int) -> Advice:
    """The vocabulary against `tokens` packed training tokens (`dlm validate`)."""

    detail = fit.detail(f"{tokens:,} training tokens", "in them")
    if not fit.too_large:
        return Advice(detail)
    size = fit.suggested_sizes()[1]
    return Advice(detail, f"train a tokenizer with --vocab-size {size}, re-pack, set model.vocab_size = {size}; "
                          "or pack more text")  # fmt: skip


def model_advice(model: ModelConfig, tokens: int, vocab: int | None = None) -> Advice:
    """Parameters per training token; a model too large is shown a narrower one, with `vocab` tokens
    when the vocabulary advice suggests that many (with it the current width may already fit)."""

    parameters = count_parameters(model)
    per_token = parameters / max(tokens, 1)
    detail = f"{format_parameter_count(parameters)} parameters for {tokens:,} training tokens: "
    detail += f"{per_token:.1f} per token"
    limit = MAX_PARAMETERS_PER_TOKEN * tokens
    if parameters <= limit:
        return Advice(detail)
    detail += f", over {MAX_PARAMETERS_PER_TOKEN}: the model can memorise the data rather than learn from it"
    fix = f"a model of at most {format_parameter_count(limit)} parameters"
    if vocab is None:
        smaller = smaller_width(model, limit, model.d_model // 2)
    else:
        smaller = smaller_width(model.model_copy(update={"vocab_size": vocab}), limit, model.d_model)
    if smaller is not None:
        fix += f" (e.g. model.d_model = {smaller[0]}" + ("" if vocab is None else f" with {vocab} tokens")
        fix += f": {format_parameter_count(smaller[1])})"
    return Advice(detail, fix + ", or more text")


def smaller_width(model: ModelConfig, limit: int, from_width: int) -> tuple[int, int] | None:
    """The widest of `from_width` and its halvings (whole heads of even width) whose model has at
    most `limit` parameters, with that count; None when the FFN width is set by hand or no such
    width is left."""

    if model.ffn_hidden_size is not None:
        return None
    width = from_width
    while width >= 2 * model.n_heads and width % (2 * model.n_heads) == 0:
        parameters = count_parameters(model.model_copy(update={"d_model": width}))
        if parameters <= limit:
            return width, parameters
        width //= 2
    return None


def budget_advice(steps: int, blocks_per_step: int, seq_len: int, blocks: int) -> Advice:
    """The planned steps as epochs over `blocks` packed training blocks."""

    planned = steps * blocks_per_step
    epochs = planned / blocks
    detail = (
        f"{steps:,} steps x {blocks_per_step} blocks = {planned:,} blocks ({planned * seq_len:,} tokens) = "
        f"{epochs:.2f} epochs of {blocks:,} blocks, per process"
    )
    if epochs <= MAX_EPOCHS:
        return Advice(detail)
    fewer = max(int(MAX_EPOCHS * blocks / blocks_per_step), 1)
    return Advice(
        f"{detail}: over {MAX_EPOCHS} epochs, repeats add less than new text and the model may overfit",
        f"watch the validation loss; lower training.max_steps to about {fewer:,} ({MAX_EPOCHS} epochs), or pack "
        "more text",
    )
