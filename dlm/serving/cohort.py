"""The requests of the common kind, advanced together as data rather than each by its own sampler.

Most served requests ask a diffusion model for steps in any order: ancestral (`random`), `dilated`, or
ranked by a confidence (`confidence`, `margin`, any registered one), with or without a `threshold`; a
whole-sequence model's without a cache, a block model's over the exact cache of its finished blocks
(each row's keys in its own slot of a KV pool, `dlm.serving.pooled`). For those the engine
(`dlm.serving.scheduler`) needs no sampler per request: the cohort keeps every such request's rows in
one token tensor, right-aligned (a row's leading padding is its `pad`, which no real position sees),
with each request's step, block and random streams beside it, and makes each step's per-row work one
tensor operation for all of them: which masked positions of each row's block are revealed, the float
conversion of the logits, the writing of the drawn tokens, the end of document check. What stays per
request is what must be its own: its random draws (each from its own generators, in the order its
sampler draws them alone), its model call (so that an error or an out-of-memory retry concerns it alone,
`dlm.serving.passes.run_calls`), its token draw (drawn with the others by
`dlm.serving.passes.run_draws`), and its stream.

A round of the cohort (`calls`) takes every request to its next step that reveals something, as its
sampler alone would (a step that reveals nothing needs no pass), and returns those steps' model calls;
once the engine has answered them, `settle` draws and writes the tokens and finishes the requests that
are done. The steps are those of `dlm.sampling.fast.denoise_fast` and of `dlm.sampling.block_model`
(blocks of `block_length` or the model's own, the schedule's reveal odds,
`dlm.sampling.reverse.planned_positions` for `dilated`, `reveal_count` and the most confident candidates
for a ranked order, `reveal_threshold`'s commits and early block ends for a threshold, the end of
document: a block model's request ends as soon as every row has it with nothing masked before, where its
sampler alone finishes the block first, which adds nothing to its text), and every random number is
drawn from the request's streams in the same order, so each request gets the tokens of `generate` alone,
up to float rounding (the tests compare them token for token in float64).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from dlm.data.tokenizer import never_sampled_ids
from dlm.model.denoiser import block_size
from dlm.runtime.memory import is_out_of_memory
from dlm.sampling.block_model import check_block_model_options, model_blocks
from dlm.sampling.fast import ended_rows
from dlm.sampling.prompt_batch import encode_prompts, padded_batch, prompt_offsets
from dlm.sampling.remasking import ANCESTRAL, DILATED, token_confidence
from dlm.sampling.reverse import (
    cut_after_stop,
    masked_after,
    most_confident,
    never_predicted,
    planned_positions,
    reveal_count,
    scored,
    sequence_blocks,
    step_odds,
    steps_per_block,
    threshold_commits,
    threshold_ranking,
)
from dlm.sampling.row_noise import RowNoise, noise_device
from dlm.sampling.tokens import draws_per_row
from dlm.serving.jobs import Answer, Finished, Job, Outcome
from dlm.serving.member import Member, staying
from dlm.serving.passes import Call, Departed, Draw, OutOfMemory, run_draws
from dlm.serving.pooled import PooledRows

if TYPE_CHECKING:
    from collections.abc import Callable

    from tokenizers import Tokenizer

    from dlm.choices import RevealSplit
    from dlm.diffusion.schedules import Schedule
    from dlm.model.transformer import DiffusionTransformer
    from dlm.serving.protocol import Generation

CHANCES_KEPT = 4096  # steps whose reveal odds, plans and counts the cohort keeps, recomputed when dropped
# Steps a round takes a request through, at most, on the way to one that reveals something: a request of
# many steps that reveal nothing goes on next round, and the others' passes, departures and deadlines wait
# for it no longer than that.
STEPS_PER_ROUND = 256


class OwnSampler(Exception):
    """A block model's request the cohort leaves to a sampler of its own: one longer than the model's
    context (the sampler slides a window over it), or with prompts of different lengths modulo the block
    size (the sampler takes them in separate batches, each with blocks of its own)."""


def joins_cohort(model: DiffusionTransformer, generation: Generation) -> bool:
    """Whether the cohort samples `generation`: a diffusion model's steps in any order, with or without a
    threshold, a whole-sequence model's without a cache, a block model's over its exact cache of finished
    blocks (`dlm.serving.pooled`; some raise `OwnSampler` as they join). Every
    other request (an autoregressive model's, a `cache` option's) runs its own sampler."""

    config, options = model.config, generation.options
    if config.attention == "causal":
        return False
    if block_size(config):  # a model whose logits are shifted cannot step over a cache: whole passes only
        return not config.shift_logits
    return options.cache == "none"


class Cohort:
    """The cohort's rows and requests. Runs on the engine's thread only."""

    def __init__(
        self,
        model: DiffusionTransformer,
        tokenizer: Tokenizer,
        schedule: Schedule,
        eos: int,
        answer: Callable[[Job], Answer],
    ) -> None:
        self.model, self.tokenizer, self.schedule, self.eos = model, tokenizer, schedule, eos
        self._answer = answer
        config = model.config
        self.mask_id = config.mask_token_id
        self.device = next(iter(model.parameters())).device
        self.noise_device = noise_device(self.device)
        forbidden = never_sampled_ids(tokenizer, config.vocab_size)
        self.filler = forbidden[0] if forbidden else 0  # what padding holds does not matter: nothing sees it
        self.forbidden = never_predicted(self.mask_id, forbidden, self.noise_device)
        self.members: list[Member] = []
        self.tokens = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.pad = torch.zeros(0, dtype=torch.long, device=self.device)
        self.block_mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # each row's current block
        self.generated = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # each row's generated columns
        self._chances: dict[tuple[int, int, int, str, str, bool], tuple[float, Tensor | None, int]] = {}
        self._finished: list[Finished] = []
        self._revealed: Tensor | None = None  # what this round's calls reveal [rows, columns]
        block = block_size(config)  # a block model's rows hold their finished blocks' keys in a pool
        self.pooled = PooledRows(config.max_seq_len, block) if block else None

    def __len__(self) -> int:
        return len(self.members)

    # -- rows in and out --------------------------------------------------------------------------

    def join(self, job: Job) -> None:
        """Add `job`'s rows, its prompts encoded and masked as `generate` does for a list of prompts."""

        generation, config = job.generation, self.model.config
        seeds = [generation.seed + index for index in range(len(generation.prompts))]
        prompts = encode_prompts(
            self.tokenizer, config, generation.prompts, length=generation.length, num_samples=generation.n, seeds=seeds
        )
        offsets = prompt_offsets(config, [len(ids) for ids in prompts])
        tokens, pad, fill_mask = padded_batch(
            prompts, offsets, generation.n, generation.length, self.filler, self.device
        )
        if self.pooled is None:
            tokens, blocks = sequence_blocks(tokens, fill_mask, generation.options, self.mask_id)
        else:
            check_block_model_options(generation.options)
            tokens, blocks = model_blocks(tokens, fill_mask, generation.options, self.pooled.block_size, self.mask_id)
            if tokens.shape[1] > config.max_seq_len:
                raise OwnSampler(f"{tokens.shape[1]} positions, past the model's {config.max_seq_len}")
            if len({len(ids) % self.pooled.block_size for ids in prompts}) > 1:
                raise OwnSampler("prompts in different phases of the model's blocks")
        generators = tuple(torch.Generator(device=self.noise_device).manual_seed(seed) for seed in seeds)
        member = Member(
            job,
            self._answer(job),
            RowNoise(generators, (generation.n,) * len(prompts)),
            int(tokens.shape[1]),
            offsets,
            [len(ids) for ids in prompts],
            [(int(block[0]), int(block[-1]) + 1) for block in blocks],
            steps_per_block(generation.options.steps, len(blocks)),
        )
        before = int(self.tokens.shape[1])
        width = max(before, member.width)
        joined = torch.cat([self._widened(self.tokens, width), self._widened(tokens, width)])
        joined_pad = torch.cat([self.pad + (width - before), pad + (width - member.width)])
        kept = self.tokens, self.pad
        self.tokens, self.pad = joined, joined_pad
        self.members.append(member)
        try:
            self._relayout()
            if self.pooled is not None:  # its rows' own positions: the widest from column 0 of its layout
                self.pooled.join(member.rows, member.width)
        except BaseException:  # all or nothing: the request fails alone, the cohort is as it was
            self.members.pop()
            self.tokens, self.pad = kept
            self._relayout()
            raise

    def _widened(self, tokens: Tensor, width: int) -> Tensor:
        return nn.functional.pad(tokens, (width - tokens.shape[1], 0), value=self.filler)

    def _leave(self, gone: list[Member]) -> None:
        """Take the rows of `gone` out; cut the leading columns no row needs any more. A member that leaves
        gives its place to the last member where their rows are as many, so that only that member's rows
        move (a block model's keys in the pool are copied once a request ends, and only where they move)."""

        if not gone:
            return
        kept = staying(self.members, gone)
        rows = [row for member in kept for row in range(member.first, member.first + member.rows)]
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        width = max((member.width for member in kept), default=0)
        cut = self.tokens.shape[1] - width
        self.tokens = self.tokens.index_select(0, index)[:, cut:]
        self.pad = self.pad.index_select(0, index) - cut
        self.members = kept
        if self.pooled is not None:
            self.pooled.keep(rows)
        self._relayout()

    def _relayout(self) -> None:
        """Each member's first row, and the generated and block columns of every row."""

        first = 0
        for member in self.members:
            member.first, first = first, first + member.rows
        shape = tuple(self.tokens.shape)
        self.generated = torch.zeros(shape, dtype=torch.bool, device=self.device)
        for member in self.members:
            self.generated[member.span, shape[1] - member.job.generation.length :] = True
        self._mark_blocks()

    def _mark_blocks(self) -> None:
        self.block_mask = torch.zeros(tuple(self.tokens.shape), dtype=torch.bool, device=self.device)
        for member in self.members:
            if not member.done:
                start, end = member.blocks[member.block]
                shift = self.tokens.shape[1] - member.width
                self.block_mask[member.span, shift + start : shift + end] = True

    # -- a round --------------------------------------------------------------------------------

    def calls(self) -> list[Call]:
        """Every request taken to its next step that reveals something (those whose client has gone, or
        whose steps run out first, finish); the model calls of those steps."""

        self._finished, self._revealed = [], None
        departed = [member for member in self.members if member.job.cancelled.is_set()]
        for member in departed:
            self._finish(member, Departed())
        self._leave(departed)
        pending = [member for member in self.members if not member.done]
        calls = []
        for _ in range(STEPS_PER_ROUND):  # those still pending after as many steps go on next round
            if not pending:
                break
            reveal = self._reveals(pending)
            counts = reveal.sum(dim=1).tolist()  # one read from the device for all of them
            still, moved, stepping = [], False, []
            for member in pending:
                member.counts = counts[member.span]
                if member.thresholded and not any(member.counts):  # its block filled early: the next block
                    member.block, member.index, moved = member.block + 1, 0, True
                elif any(member.counts) and (member.thresholded or member.keep or not member.ranked):
                    stepping.append(member)
                    continue
                else:
                    moved |= member.advance()  # a step that reveals nothing: no pass, the next step
                if member.done:
                    self._finish(member)  # its rows leave once the round is settled
                else:
                    still.append(member)
            for member, call in zip(stepping, self._calls(stepping, reveal), strict=True):
                member.call = call
                calls.append(call)
            if moved:
                self._mark_blocks()
            if len(still) < len(pending):  # rows of other members reveal nothing: the round's reveals
                self._revealed = reveal if self._revealed is None else self._revealed | reveal
            pending = still
        if pending and self._revealed is not None:  # those going on next round draw nothing in this one
            self._revealed = self._revealed.clone()
            for member in pending:
                self._revealed[member.span] = False
        return calls

    def settle(self) -> list[Finished]:
        """After the engine has answered this round's calls: each request's tokens drawn (with the others'
        draws of its kind) and written, its step taken; the requests done (their steps run out or every
        row at its end of document), failed or gone, with their outcomes, their rows taken out."""

        stepped = [member for member in self.members if member.call is not None]
        for member in stepped:
            assert member.call is not None
            if member.job.cancelled.is_set():  # as a sampler's step callback ends a request whose client left
                self._finish(member, Departed())
            elif member.call.error is not None:
                self._finish(member, member.call.error)
        drawn = [member for member in stepped if not member.done]
        if drawn:
            self._draw(drawn, stepped)
        drawn = [member for member in drawn if not member.done]
        if drawn:
            self._step(drawn)
        for member in stepped:
            member.call = None
        if self.pooled is not None:
            self.pooled.settled()
        self._leave([member for member in self.members if member.done])
        finished, self._finished = self._finished, []  # handed out last: `fail` answers them if anything raised
        return finished

    def _draw(self, members: list[Member], stepped: list[Member]) -> None:
        """Each member's tokens at what it reveals, drawn from its logits as its sampler draws them
        (`Reverse.scores`, `Reverse.uniform`, `sample_tokens`), and written."""

        draws = []
        for member, part in zip(members, self._scores(members), strict=True):
            if isinstance(part, BaseException):
                self._finish(member, part)
                continue
            options = member.job.generation.options
            uniform = (
                None if options.temperature == 0 else member.noise.stacked(member.counts, draws_per_row(options.top_p))
            )
            probabilities = member.ranked or member.thresholded  # what ranks its candidates
            draws.append(Draw(part, uniform, options.temperature, options.top_k, options.top_p, probabilities))
        members = [member for member in members if not member.done]
        run_draws(draws)  # each its own work, so that one too large for memory is retried alone
        assert self._revealed is not None
        tokens = []
        for member, draw in zip(members, draws, strict=True):
            if draw.error is not None or draw.result is None:
                self._finish(member, draw.error or RuntimeError("a token draw came back unanswered"))
            elif member.ranked or member.thresholded:
                tokens.append(self._committed(member, *draw.result))
            else:
                tokens.append(draw.result[0])
        written = self._revealed
        failed = [member for member in stepped if member.done]
        if failed:  # their rows keep their tokens: they are leaving
            written = written.clone()
            for member in failed:
                written[member.span] = False
        if tokens:  # in row order, as `written` holds them
            self.tokens[written] = (torch.cat(tokens) if len(tokens) > 1 else tokens[0]).to(self.device)

    def _scores(self, members: list[Member]) -> list[Tensor | BaseException]:
        """Each member's logits as its sampler scores them (`scored`, as `Reverse.scores` does): moved
        together, or one by one where together they do not fit the device's memory (a member that does
        not fit alone gets `OutOfMemory`)."""

        results = []
        for member in members:
            assert member.call is not None and member.call.result is not None
            results.append(member.call.result)
        try:
            logits = scored(torch.cat(results) if len(results) > 1 else results[0], self.noise_device, self.forbidden)
            return list(logits.split([sum(member.counts) for member in members]))
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
        parts: list[Tensor | BaseException] = []
        for result in results:
            try:
                parts.append(scored(result, self.noise_device, self.forbidden))
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                parts.append(OutOfMemory("the request's token draw does not fit the device's memory now; retry later"))
        return parts

    def _committed(self, member: Member, new: Tensor, probabilities: Tensor | None) -> Tensor:
        """A ranked or threshold step's tokens at its candidates: the drawn token where the step commits
        (`Reverse.reveal_confident`, `reveal_threshold`: ranked in the member's own columns, as it ranks
        them alone), the mask elsewhere, which stays masked."""

        assert probabilities is not None and self._revealed is not None
        options = member.job.generation.options
        own = self._revealed[member.span, self.tokens.shape[1] - member.width :].to(new.device)
        if options.threshold is None:
            candidates = own
            confidence = token_confidence(probabilities, new, options.remasking)
            commit = most_confident(confidence, candidates, member.keep)
        else:
            start, end = member.blocks[member.block]
            candidates = own[:, start:end]
            confidence = token_confidence(probabilities, new, threshold_ranking(options.remasking))
            commit = threshold_commits(confidence, candidates, member.keep, options.threshold)
        return torch.where(commit[candidates], new, self.mask_id)

    def _step(self, members: list[Member]) -> None:
        """The step taken: each member's next step, its new text streamed, and those done finished."""

        ended = self._ended()
        moved = False
        for member in members:
            moved |= member.advance()
            if member.done or all(ended[member.span]):
                self._finish(member)
        streaming = [member for member in members if not member.done and member.answer.streaming]
        if streaming:
            host = self.tokens.tolist()  # one copy to the host for every stream
            for member in streaming:
                length = member.job.generation.length
                try:  # a stream that cannot take its text (its loop closed) fails its request alone
                    member.answer.update([row[len(row) - length :] for row in host[member.span]])
                except Exception as exc:
                    self._finish(member, exc)
        if moved:
            self._mark_blocks()

    def _ended(self) -> list[bool]:
        """Per row: whether it has ended at its end of document (`dlm.sampling.fast.ended_rows`)."""

        ended: list[bool] = ended_rows(self.tokens, self.generated, self.eos, self.mask_id).tolist()
        return ended

    def _finish(self, member: Member, error: BaseException | None = None) -> None:
        """`member` is done: its outcome (its rows cut after their end of document, as `generate` cuts
        them), or `error`. Its rows leave when the round is settled."""

        member.block, seconds = len(member.blocks), time.perf_counter() - member.started
        if error is not None:
            self._finished.append((member.job, error, 0, seconds))
            return
        generation = member.job.generation
        rows = self.tokens[member.span].tolist()
        shift = self.tokens.shape[1] - member.width
        token_ids: list[list[int]] = []
        prompt_tokens: list[int] = []
        for slot, (offset, size) in enumerate(zip(member.offsets, member.prompts, strict=True)):
            own = [row[shift + offset :] for row in rows[slot * generation.n : (slot + 1) * generation.n]]
            token_ids += cut_after_stop(own, [False] * size + [True] * generation.length, self.eos)
            prompt_tokens += [size] * generation.n
        kept = sum(len(ids) - size for ids, size in zip(token_ids, prompt_tokens, strict=True))
        try:  # sends the rest of each stream: a stream that cannot take it fails its request alone
            outcome: Outcome | BaseException = member.answer.outcome(token_ids, prompt_tokens)
        except Exception as exc:
            outcome, kept = exc, 0
        self._finished.append((member.job, outcome, kept, seconds))

    def fail(self, error: BaseException) -> list[Finished]:
        """Every request ends with `error` (the cohort's own failure: nothing it holds can be trusted)."""

        finished = self._finished + [
            (member.job, error, 0, time.perf_counter() - member.started) for member in self.members if not member.done
        ]
        self.members, self._finished = [], []
        if self.pooled is not None:
            self.pooled.clear()
        self.tokens = self.tokens[:0]
        self.pad = self.pad[:0]
        self._relayout()
        return finished

    def _reveals(self, members: list[Member]) -> Tensor:
        """The positions each member's current step reveals [rows, columns] (none in other rows): its
        block's masked positions whose uniform draw x odds < 1, the draws from its own streams. A planned
        (dilated) step's chances are 0 where it reveals and 1 elsewhere, at odds 1; a ranked step's are 0
        (every masked position of its block is a candidate, `_most_confident` keeps its `keep`)."""

        odds, pending = [1.0] * self.tokens.shape[0], [False] * self.tokens.shape[0]
        chances = []
        for member in members:
            options = member.job.generation.options
            start, end = member.blocks[member.block]
            steps = member.block_steps[member.block]
            member_odds, planned, member.keep = self._chance(
                end - start, steps, member.index, options.remasking, options.reveal_split, member.thresholded
            )
            shape = (member.rows, end - start)
            chances.append(member.noise.per_row(shape) if planned is None else planned.expand(shape))
            odds[member.span], pending[member.span] = [member_odds] * member.rows, [True] * member.rows
        where = self.block_mask
        if len(members) < len(self.members):
            where = where & torch.tensor(pending, device=self.device)[:, None]
        draws = torch.ones(tuple(self.tokens.shape), dtype=torch.float64, device=self.noise_device)
        draws[where.to(self.noise_device)] = torch.cat([chance.reshape(-1) for chance in chances])
        hits = draws * torch.tensor(odds, dtype=torch.float64, device=self.noise_device)[:, None] < 1
        return where & (self.tokens == self.mask_id) & hits.to(self.device)

    def _chance(
        self, size: int, steps: int, index: int, remasking: str, split: RevealSplit, thresholded: bool
    ) -> tuple[float, Tensor | None, int]:
        """A step's reveal odds, for a planned, ranked or threshold step its chances (see `_reveals`), for a
        ranked step the positions it reveals per row (`reveal_count`) and for a threshold step those it may
        leave masked (`masked_after`), computed once."""

        key = (size, steps, index, remasking, split, thresholded)
        known = self._chances.get(key)
        if known is None:
            if thresholded:  # every masked position of the block is a candidate
                keep = masked_after(size, steps, index, self.schedule, split)
                known = (1.0, torch.zeros(size, dtype=torch.float64, device=self.noise_device), keep)
            elif remasking == ANCESTRAL:
                known = (step_odds(self.schedule, steps, index), None, 0)
            elif remasking != DILATED:  # ranked: every masked position of the block is a candidate
                keep = reveal_count(size, steps, index, self.schedule, split)
                known = (1.0, torch.zeros(size, dtype=torch.float64, device=self.noise_device), keep)
            else:
                chosen = planned_positions(size, steps, index, self.schedule, split)
                planned = torch.ones(size, dtype=torch.float64, device=self.noise_device)
                planned[chosen.to(self.noise_device)] = 0.0
                known = (1.0, planned, 0)
            if len(self._chances) >= CHANCES_KEPT:  # steps are the clients' to choose: keep the memory bounded
                self._chances.clear()
            self._chances[key] = known
        return known

    def _calls(self, members: list[Member], reveal: Tensor) -> list[Call]:
        """The model call of each member's step: its rows that reveal something, logits at what they reveal
        (a block model's over its rows' slots of the KV pool, `dlm.serving.pooled`)."""

        if self.pooled is not None:
            return self.pooled.calls(self.tokens, reveal, members)
        return [self._call(member, reveal) for member in members]

    def _call(self, member: Member, reveal: Tensor) -> Call:
        """The model call of a whole-sequence model's member: its rows that reveal something."""

        span = member.span
        if all(member.counts):
            return Call(self.tokens[span], reveal[span], None, self.pad[span])
        rows = torch.tensor(
            [member.first + row for row, count in enumerate(member.counts) if count], device=self.device
        )
        return Call(
            self.tokens.index_select(0, rows), reveal.index_select(0, rows), None, self.pad.index_select(0, rows)
        )
