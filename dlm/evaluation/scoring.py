"""Scoring and generating from token ids: what benchmark harnesses ask of a language model.

`Scorer` wraps a loaded model and answers three questions (`dlm.harness` serves them to
lm-evaluation-harness; they need nothing of it):

- `loglikelihood`: log p(continuation | context), bounded from below by the conditional ELBO of the
  continuation (the context is never masked), estimated from `mc_samples` Monte Carlo samples
  (`dlm.diffusion.objective.elbo_nll`, the exact-count estimator by default), and whether the continuation
  is greedy: what `generate` writes after the context at temperature 0, with this scorer's steps,
  remasking and block length, the reverse process a diffusion model decodes greedily by (one
  argmax of the fully masked continuation is not it: each step conditions on the tokens already
  revealed). A context too long for the model loses its oldest tokens.
- `rolling`: the log-likelihood of a whole text in windows of the model's length, each token
  scored once: the first window after an end-of-document token, each later one after the last
  token of the window before (lm-evaluation-harness's rolling windows, context 1), the last one
  after as much of the text as fits.
- `generate`: a continuation by the reverse process (`dlm.sampling.dispatch.denoise`; `steps`, default one
  per token, `remasking`, default `confidence`, and `block_length`), cut at the first
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

from dlm.choices import RevealSplit
from dlm.data.tokenizer import never_sampled_ids, special_token_id
from dlm.diffusion.distillation import distilled_steps
from dlm.diffusion.objective import ESTIMATORS, elbo_nll, noise_seed
from dlm.diffusion.schedules import DEFAULT_MASK_EPS, model_schedule
from dlm.errors import UserError
from dlm.model.denoiser import block_size, masked_logits
from dlm.runtime.device import autocast_context
from dlm.sampling.options import SamplingOptions, sampling_steps
from dlm.sampling.row_noise import RowNoise

_GENERATE_PASS = 1  # keeps generation noise apart from scoring noise of the same ids


@dataclass(frozen=True)
class Score:
    """The log-likelihood bound of one continuation."""

    logprob: float  # minus the negative ELBO of the continuation tokens, summed: <= log p
    stderr: float | None  # Monte Carlo standard error of `logprob` (None with one sample)
    is_greedy: bool | None  # None when not asked for (rolling windows)
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
        mask_eps: float = DEFAULT_MASK_EPS,
        steps: int | None = None,
        remasking: str = "confidence",
        block_length: int | None = None,
        reveal_split: RevealSplit = "schedule",
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
        SamplingOptions(
            steps=steps or 1, remasking=remasking, block_length=block_length, reveal_split=reveal_split
        )  # refuses bad values now
        # A distilled student generates in the steps it was distilled for unless told otherwise.
        steps = distilled_steps(model) if steps is None else sampling_steps(model, steps)
        self.steps, self.remasking, self.block_length = steps, remasking, block_length
        self.reveal_split = reveal_split
        self.device = next(model.parameters()).device
        self.eos_id = special_token_id(tokenizer, "eos")
        self.forbidden = never_sampled_ids(tokenizer, model.config.vocab_size)

    # ---------------------------------------------------------------------------- likelihood

    def _logits(self, clean: Tensor) -> Any:
        def logits(noisy: Tensor, positions: Tensor) -> Tensor:
            with autocast_context(self.device, self.precision):
                return masked_logits(self.model, noisy, positions, clean)

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
    def loglikelihood(
        self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *, greedy: bool = True
    ) -> list[Score]:
        """The score of each (context ids, continuation ids); rows of equal length share a batch.
        `greedy=False` skips the greedy check (a reverse process per request); is_greedy is None."""

        rows = [self._row(context, continuation) for context, continuation in requests]
        keys = [request_seed(self.seed, ids, [start]) for ids, start in rows]  # what is scored, after any cut
        scores: list[Score | None] = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
        while order:
            width = len(rows[order[0]][0])
            group = [i for i in order[: self.batch_size] if len(rows[i][0]) == width]
            order = order[len(group) :]
            batch = self._score([rows[i] for i in group], [keys[i] for i in group], greedy)
            for index, score in zip(group, batch, strict=True):
                scores[index] = score
        return [score for score in scores if score is not None]

    def _score(self, rows: list[tuple[list[int], int]], keys: list[int], greedy: bool) -> list[Score]:
        clean = torch.tensor([ids for ids, _ in rows], dtype=torch.long, device=self.device)
        starts = torch.tensor([start for _, start in rows], device=self.device)
        scored = torch.arange(clean.shape[1], device=self.device)[None, :] >= starts[:, None]
        counts = scored.sum(dim=1).tolist()
        if clean.shape[1] == 0 or not any(counts):  # nothing to score
            return [Score(0.0, None, True if greedy else None, 0) for _ in rows]
        generators = [torch.Generator(device=self.device).manual_seed(key) for key in keys]
        block = block_size(self.config)
        means, errors = elbo_nll(
            self._logits(clean),
            clean,
            self.config.mask_token_id,
            self.mc_samples,
            self.mask_eps,
            generators,
            schedule=model_schedule(self.model),
            block_size=block,
            loss_mask=scored,
            estimator=self.estimator,
        )
        verdicts: list[bool | None] = list(self._greedy(rows)) if greedy else [None] * len(rows)
        return [
            Score(-float(mean) * count, None if self.mc_samples == 1 else float(error) * count, is_greedy, count)
            for mean, error, is_greedy, count in zip(means, errors, verdicts, counts, strict=True)
        ]

    def _greedy(self, rows: list[tuple[list[int], int]]) -> list[bool]:
        """Whether `generate` at temperature 0, given each row's context, writes exactly its continuation.

        Rows with the same context length share one reverse process. It runs without stopping at
        an end-of-document token: `generate` keeps the same tokens up to the first one and drops
        the rest, so the written text is the tokens up to and including it."""

        verdicts = [True] * len(rows)
        for start in sorted({start for ids, start in rows if len(ids) > start}):
            group = [index for index, (ids, first) in enumerate(rows) if first == start]
            contexts = [rows[index][0][:start] for index in group]
            count = len(rows[group[0]][0]) - start
            sampling = SamplingOptions(
                steps=self.steps or count,
                temperature=0.0,
                top_p=None,
                remasking=self.remasking,
                block_length=self.block_length,
                reveal_split=self.reveal_split,
            )
            written = self._reverse(contexts, count, sampling, stop=False).tolist()
            for index, new in zip(group, written, strict=True):
                kept = new[: new.index(self.eos_id) + 1] if self.eos_id in new else new
                verdicts[index] = kept == rows[index][0][start:]
        return verdicts

    @torch.inference_mode()
    def _reverse(self, contexts: list[list[int]], count: int, sampling: Any, *, stop: bool) -> Tensor:
        """The `count` ids [R, count] that the reverse process writes after each context (all of one
        length), each row with the noise of its context alone; `stop` ends at end-of-document tokens."""

        from dlm.sampling.dispatch import denoise  # looked up per call: a test replaces it to see the options

        mask_id, width = self.config.mask_token_id, len(contexts[0])
        tokens = torch.tensor(
            [context + [mask_id] * count for context in contexts], dtype=torch.long, device=self.device
        )
        fill = torch.tensor([False] * width + [True] * count, device=self.device)
        streams = [
            torch.Generator(device=self.device).manual_seed(request_seed(self.seed, context, [_GENERATE_PASS]))
            for context in contexts
        ]
        noise = RowNoise(tuple(streams), (1,) * len(streams))
        with autocast_context(self.device, self.precision):
            tokens, _ = denoise(
                self.model,
                tokens,
                fill,
                sampling,
                generator=noise,
                stop_token_id=self.eos_id if stop else None,
                forbidden_token_ids=self.forbidden,
                schedule=model_schedule(self.model),
            )
        return tokens[:, width:]

    def rolling(self, documents: Sequence[Sequence[int]]) -> list[float]:
        """The log-likelihood bound of each whole document, summed over its windows."""

        windows = [rolling_windows(document, self.eos_id, self.config.max_seq_len) for document in documents]
        flat = [window for document in windows for window in document]
        scores = iter(self.loglikelihood(flat, greedy=False))
        return [sum(next(scores).logprob for _ in document) for document in windows]

    # ---------------------------------------------------------------------------- generation

    def generate(
        self,
        context: Sequence[int],
        *,
        max_tokens: int,
        until: Sequence[str] = (),
        steps: int | None = None,
        **options: Any,
    ) -> str:
        """The text of up to `max_tokens` new tokens after `context` (its oldest tokens dropped when
        they do not fit), cut at the first `until` string; `options` are `SamplingOptions` fields,
        `steps`, `remasking`, `block_length` and `reveal_split` by default the scorer's."""

        limit = self.config.max_seq_len
        count = max(1, min(max_tokens, limit - 1 if context else limit))
        kept = list(context)[-(limit - count) :] if limit > count else []
        options = {
            "remasking": self.remasking,
            "block_length": self.block_length,
            "reveal_split": self.reveal_split,
            **options,
        }
        sampling = SamplingOptions(steps=steps or self.steps or count, **options)
        [new] = self._reverse([kept], count, sampling, stop=True).tolist()
        new = new[: new.index(self.eos_id)] if self.eos_id in new else new
        text: str = self.tokenizer.decode(new, skip_special_tokens=False)
        ends = [text.find(stop) for stop in until if stop and stop in text]
        return text[: min(ends)] if ends else text
