"""Scoring and generating from token ids: what benchmark harnesses ask of a language model.

`Scorer` wraps a loaded model and answers three questions (`dlm.harness` serves them to
lm-evaluation-harness; they need nothing of it):

- `loglikelihood`: log p(continuation | context), bounded from below by the conditional ELBO of the
  continuation (the context is never masked), estimated from `mc_samples` Monte Carlo samples
  (`dlm.diffusion.elbo_nll`, the exact-count estimator by default), and whether the continuation
  is greedy: every one of its tokens is the argmax at its position when the whole continuation is
  masked (one denoising step; a block model sees the earlier blocks clean, as teacher forcing).
  A context too long for the model loses its oldest tokens.
- `rolling`: the log-likelihood of a whole text in windows of the model's length, each token
  scored once: the first window after an end-of-document token, each later one after the last
  token of the window before (lm-evaluation-harness's rolling windows, context 1), the last one
  after as much of the text as fits.
- `generate`: a continuation by the reverse process (`dlm.sampling.denoise`), cut at the first
  end-of-document token and at the first of the `until` strings.

Every request draws its noise from a generator seeded by (seed, its token ids), so its score does
not depend on the batch it was scored in or on the other requests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dlm.diffusion import ESTIMATORS, elbo_nll, noise_seed
from dlm.errors import UserError
from dlm.runtime import autocast_context
from dlm.schedule import model_schedule
from dlm.tokenizer import SPECIAL_TOKENS

_GENERATE_PASS = 1  # keeps generation noise apart from scoring noise of the same ids


@dataclass(frozen=True)
class Score:
    """The log-likelihood bound of one continuation."""

    logprob: float  # minus the negative ELBO of the continuation tokens, summed: <= log p
    stderr: float | None  # Monte Carlo standard error of `logprob` (None with one sample)
    is_greedy: bool
    tokens: int  # continuation tokens scored


def request_seed(seed: int, *parts: Sequence[int]) -> int:
    """A seed from `seed` and token id lists, the same on every run, machine and batch."""

    digest = hashlib.sha256(repr([list(part) for part in parts]).encode()).digest()
    return noise_seed(seed, int.from_bytes(digest[:8], "little"))


def rolling_windows(tokens: Sequence[int], prefix: int, length: int) -> list[tuple[list[int], list[int]]]:
    """(context, scored) pairs of at most `length` ids in all that score each of `tokens` once."""

    if length < 2:
        raise ValueError(f"windows need a length of at least 2, got {length}")
    tokens = list(tokens)
    windows, done = [], min(len(tokens), length - 1)
    if tokens:
        windows.append(([prefix], tokens[:done]))
    while done < len(tokens):
        end = min(len(tokens), done + length - 1)
        start = max(0, end - length)
        windows.append((tokens[start:done], tokens[done:end]))
        done = end
    return windows


class Scorer:
    """Log-likelihoods and generations of one model; see the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        mc_samples: int = 32,
        estimator: str = "exact-count",
        seed: int = 0,
        batch_size: int = 16,
        precision: str = "float32",
        mask_eps: float = 1e-3,
    ) -> None:
        if mc_samples < 1:
            raise UserError(f"mc_samples must be at least 1 (got {mc_samples})", fix="pass mc_samples=32")
        if estimator not in ESTIMATORS:
            raise UserError(f"estimator must be one of {', '.join(ESTIMATORS)} (got {estimator!r})")
        if batch_size < 1:
            raise UserError(f"batch_size must be at least 1 (got {batch_size})")
        self.model, self.tokenizer = model, tokenizer
        self.config = model.config
        self.mc_samples, self.estimator, self.seed = mc_samples, estimator, seed
        self.batch_size, self.precision, self.mask_eps = batch_size, precision, mask_eps
        self.device = next(model.parameters()).device
        self.eos_id = int(tokenizer.token_to_id(SPECIAL_TOKENS["eos"]))

    # ---------------------------------------------------------------------------- likelihood

    def _logits(self, clean: Tensor) -> Any:
        extra = {"clean_tokens": clean} if self.config.is_block_model else {}

        def logits(noisy: Tensor, positions: Tensor) -> Tensor:
            with autocast_context(self.device, self.precision):
                return self.model(noisy, output_positions=positions, **extra)

        return logits

    def _row(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[list[int], int]:
        """The ids to score (context cut from the left to fit) and where the continuation starts."""

        limit = self.config.max_seq_len
        if len(continuation) > limit:
            raise UserError(
                f"a continuation of {len(continuation)} tokens does not fit the model's {limit} positions",
                fix="score shorter continuations, or use loglikelihood_rolling for long texts",
            )
        ids = (list(context) + list(continuation))[-limit:]
        return ids, len(ids) - len(continuation)

    @torch.no_grad()
    def loglikelihood(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[Score]:
        """The score of each (context ids, continuation ids); rows of equal length share a batch."""

        rows = [self._row(context, continuation) for context, continuation in requests]
        keys = [request_seed(self.seed, ids, [start]) for ids, start in rows]  # what is scored, after any cut
        scores: list[Score | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
        while order:
            width = len(rows[order[0]][0])
            group = [i for i in order[: self.batch_size] if len(rows[i][0]) == width]
            order = order[len(group) :]
            batch = self._score([rows[i] for i in group], [keys[i] for i in group])
            for index, score in zip(group, batch, strict=True):
                scores[index] = score
        return [score for score in scores if score is not None]

    def _score(self, rows: list[tuple[list[int], int]], keys: list[int]) -> list[Score]:
        clean = torch.tensor([ids for ids, _ in rows], dtype=torch.long, device=self.device)
        starts = torch.tensor([start for _, start in rows], device=self.device)
        scored = torch.arange(clean.shape[1], device=self.device)[None, :] >= starts[:, None]
        counts = scored.sum(dim=1).tolist()
        if clean.shape[1] == 0 or not any(counts):  # nothing to score
            return [Score(0.0, None, True, 0) for _ in rows]
        generators = [torch.Generator(device=self.device).manual_seed(key) for key in keys]
        block = self.config.block_size if self.config.is_block_model else 0
        means, errors = elbo_nll(self._logits(clean), clean, self.config.mask_token_id, self.mc_samples,
                                 self.mask_eps, generators, schedule=model_schedule(self.model), block_size=block,
                                 loss_mask=scored, estimator=self.estimator)  # fmt: skip
        greedy = self._greedy(clean, scored)
        return [
            Score(-float(mean) * count, None if self.mc_samples == 1 else float(error) * count, is_greedy, count)
            for mean, error, is_greedy, count in zip(means, errors, greedy, counts, strict=True)
        ]

    def _greedy(self, clean: Tensor, scored: Tensor) -> list[bool]:
        """Whether each row's scored tokens are the argmax when all of them are masked at once."""

        noisy = clean.masked_fill(scored, self.config.mask_token_id)
        logits = self._logits(clean)(noisy, scored).float()
        logits[:, self.config.mask_token_id] = float("-inf")  # never a prediction
        hits = torch.ones_like(scored).masked_scatter(scored, logits.argmax(dim=-1) == clean[scored])
        return hits.all(dim=1).tolist()

    def rolling(self, documents: Sequence[Sequence[int]]) -> list[float]:
        """The log-likelihood bound of each whole document, summed over its windows."""

        windows = [rolling_windows(document, self.eos_id, self.config.max_seq_len) for document in documents]
        flat = [window for document in windows for window in document]
        scores = iter(self.loglikelihood(flat))
        return [sum(next(scores).logprob for _ in document) for document in windows]

    # ---------------------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(self, context: Sequence[int], *, max_tokens: int, until: Sequence[str] = (),
                 steps: int | None = None, **options: Any) -> str:  # fmt: skip
        """The text of up to `max_tokens` new tokens after `context` (its oldest tokens dropped when
        they do not fit), cut at the first `until` string; `options` are `SamplingOptions` fields."""

        from dlm.sampling import SamplingOptions, denoise

        limit = self.config.max_seq_len
        count = max(1, min(max_tokens, limit - 1 if context else limit))
        kept = list(context)[-(limit - count) :] if limit > count else []
        tokens = torch.tensor([kept + [self.config.mask_token_id] * count], dtype=torch.long, device=self.device)
        fill = torch.tensor([False] * len(kept) + [True] * count, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(request_seed(self.seed, kept, [_GENERATE_PASS]))
        pad = self.tokenizer.token_to_id(SPECIAL_TOKENS["pad"])
        sampling = SamplingOptions(steps=steps or count, **options)
        with autocast_context(self.device, self.precision):
            tokens, _ = denoise(self.model, tokens, fill, sampling, generator=generator, stop_token_id=self.eos_id,
                                forbidden_token_ids=[pad] if pad is not None else [],
                                schedule=model_schedule(self.model))  # fmt: skip
        new = tokens[0, len(kept) :].tolist()
        new = new[: new.index(self.eos_id)] if self.eos_id in new else new
        text: str = self.tokenizer.decode(new, skip_special_tokens=False)
        ends = [text.find(stop) for stop in until if stop and stop in text]
        return text[: min(ends)] if ends else text
