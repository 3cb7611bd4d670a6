"""Sizing the vocabulary, the model and the step budget to the training text.

The one owner of the rules behind `dlm tokenizer train`'s warning and `dlm validate`'s sizing rows
(`train data vocabulary`, `model size for data`, `training budget`): what is too large for the data,
and what to pick instead. Each verdict is an `Advice` (a detail, and a fix when something is too
large); the callers only place it. Warnings never fail a command.

The thresholds come from float32 runs of ten minutes at an AVX2-only CPU's pace on 1.3 MB of English
(0.11 lab notes, "Sizing to a small corpus": git show cece22c:docs/benchmarks.md; held-out bits per byte,
lower is better):

- training tokens per vocabulary entry: 74 (4096 tokens) scored best on the corpus tuned on, 164
  (2048) 0.047 worse with the same model, 36 (8192, the cpu.toml model) 0.083 worse; on the
  corpus reported on, 94 (4096) beat 42 (8192, the cpu.toml model) by 0.155. Below
  MIN_TOKENS_PER_ENTRY the vocabulary is too large, and the largest power of two that gives that
  many is suggested;
- parameters per training token: 3.3 to 4.5 learned best, 15 and 18 (the cpu.toml model) fell
  behind at equal time;
- epochs: at 3.6 and 4.5 parameters per token the validation loss still fell at the end of 14.7 and
  18.6 epochs.

No torch: `dlm tokenizer train` imports it; a model's parameters are counted from its config
(`dlm.config.shapes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dlm.config.schema import ModelConfig
from dlm.config.shapes import count_parameters, format_parameter_count

MIN_TOKENS_PER_ENTRY = 64
RARE_COUNT = 10  # a learned token seen fewer times is rare: reported beside the rule
MAX_PARAMETERS_PER_TOKEN = 5
MAX_EPOCHS = 16


def _text_size(text_bytes: int) -> str:
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
    """A vocabulary against the text it encodes: the tokens of the text per vocabulary entry, and how
    many learned tokens (past the byte alphabet and the special tokens) occur fewer than RARE_COUNT
    times in it."""

    vocab_size: int
    learned: int
    rare: int
    tokens: int

    @property
    def rare_share(self) -> float:
        return self.rare / self.learned if self.learned else 0.0

    @property
    def tokens_per_entry(self) -> float:
        return self.tokens / self.vocab_size

    @property
    def too_large(self) -> bool:
        return self.tokens_per_entry < MIN_TOKENS_PER_ENTRY

    def suggested_size(self) -> int:
        """The largest power of two with MIN_TOKENS_PER_ENTRY tokens an entry, below the current size,
        and never below the byte alphabet and special tokens. A smaller vocabulary splits the text
        into more tokens, so its entries average a little more than estimated here."""

        base = self.vocab_size - self.learned
        size = 1 << max(int(self.tokens // MIN_TOKENS_PER_ENTRY), 1).bit_length() - 1
        while size >= self.vocab_size:
            size //= 2
        return max(size, base)

    def detail(self, amount: str) -> str:
        """What was counted, e.g. "8192 tokens for 291,840 training tokens: 36 per entry (78% of the
        7,933 learned tokens occur fewer than 10 times)", with `amount` the size of the text; when the
        vocabulary is too large, the size that suits the text follows."""

        text = (
            f"{self.vocab_size} tokens for {amount}: {self.tokens_per_entry:,.0f} per entry ({self.rare_share:.0%} "
            f"of the {self.learned:,} learned tokens occur fewer than {RARE_COUNT} times)"
        )
        if self.too_large:
            text += f", under {MIN_TOKENS_PER_ENTRY}: too few to learn them; "
            text += f"about {self.suggested_size()} suit this size"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "tokens": self.tokens,
            "tokens_per_entry": self.tokens_per_entry,
            "learned_tokens": self.learned,
            "rare_tokens": self.rare,
            "rare_below": RARE_COUNT,
            "rare_share": self.rare_share,
            "too_large": self.too_large,
            "suggested_vocab_size": self.suggested_size() if self.too_large else None,
        }


def vocabulary_fit(counts: np.ndarray, vocab_size: int, first_learned: int) -> VocabularyFit:
    """The fit of a vocabulary from `counts`, the occurrences of each token id in a text; the ids
    from `first_learned` up are the learned ones (a byte-level BPE's merges)."""

    learned = np.zeros(max(vocab_size - first_learned, 0), dtype=np.int64)
    seen = counts[first_learned:vocab_size]
    learned[: len(seen)] = seen
    return VocabularyFit(vocab_size, len(learned), int((learned < RARE_COUNT).sum()), int(counts.sum()))


def corpus_vocabulary_warning(fit: VocabularyFit, text_bytes: int) -> str | None:
    """`dlm tokenizer train`'s one warning line, or None when the vocabulary suits the corpus."""

    if not fit.too_large:
        return None
    return (
        f"{fit.detail(f'{_text_size(text_bytes)} of text ({fit.tokens:,} tokens)')} "
        f"(retrain with --vocab-size {fit.suggested_size()}, or train on more text)"
    )


def packed_vocabulary_advice(fit: VocabularyFit, tokens: int) -> Advice:
    """The vocabulary against `tokens` packed training tokens (`dlm validate`; `fit` counted them)."""

    detail = fit.detail(f"{tokens:,} training tokens")
    if not fit.too_large:
        return Advice(detail)
    size = fit.suggested_size()
    return Advice(
        detail, f"train a tokenizer with --vocab-size {size}, re-pack, set model.vocab_size = {size}; or pack more text"
    )


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


def epoch_limit_steps(blocks_per_step: int, blocks: int) -> int:
    """The steps of `blocks_per_step` blocks that make MAX_EPOCHS epochs over `blocks`."""

    return max(int(MAX_EPOCHS * blocks / blocks_per_step), 1)


def budget_advice(steps: int, blocks_per_step: int, seq_len: int, blocks: int, *, fewer_by: str = "") -> Advice:
    """The planned steps as epochs over `blocks` packed training blocks. `fewer_by`: how to train
    fewer steps, up to the number of them (default: lower training.max_steps to about)."""

    planned = steps * blocks_per_step
    epochs = planned / blocks
    detail = (
        f"{steps:,} steps x {blocks_per_step} blocks = {planned:,} blocks ({planned * seq_len:,} tokens) = "
        f"{epochs:.2f} epochs of {blocks:,} blocks, per process"
    )
    if epochs <= MAX_EPOCHS:
        return Advice(detail)
    limit = epoch_limit_steps(blocks_per_step, blocks)
    return Advice(
        f"{detail}: over {MAX_EPOCHS} epochs, repeats add less than new text and the model may overfit",
        f"watch the validation loss; {fewer_by or 'lower training.max_steps to about'} {limit:,} steps "
        f"({MAX_EPOCHS} epochs), or pack more text",
    )
