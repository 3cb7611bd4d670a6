"""Forward passes shared by requests that each run the sampler as they would alone.

The cohort's requests (`dlm.serving.cohort`) hand the engine their calls as data; every other running
request samples with `dlm.sampling.generation.generate`, the very call that answers
it alone (in a greenlet of the engine thread), on a `RequestModel`: a stand-in for the served model
whose call is handed to the engine and waits for its logits. So a request draws its own random numbers in its
own order, keeps its own length, steps, blocks and options, and stops when it alone is done; only
the model's arithmetic is shared, and the token draws of requests of one kind (`run_draws`: each row
from its own request's uniforms). Once every running request waits for a pass (or has finished),
the scheduler runs the waiting calls that fit one batch together (`run_calls`) and gives each call
its own rows of the logits.

Which calls share a pass (`Call.group`):
- calls without a cache (a whole-sequence model without `cache`), and the whole passes that fill a
  whole-sequence model's `cache` at each block: all of them. Rows are left-padded to the widest
  (`DiffusionTransformer.forward(pad=...)`: no real position sees padding, positions count from a
  row's first real token); a block model's only when padded by whole blocks.
- calls with a cache that holds every position before them (nothing slid out of a block model's
  window): a block model's steps (one block fed, or the block just finished and the next, as a
  block's first step feeds them, the last block cut short where the sequence ends), whatever they
  store; other calls (a request's first, a
  whole-sequence model's `cache prefix` or `dual`) with those that feed as many positions, store
  alike (`committing`, `keep`) and hold as many keys after them (`dual`). Their caches are
  left-padded to the longest, so every row's fed tokens sit in the same columns (a block model's
  caches end on block boundaries, so its blocks stay aligned); a block model's fed tokens are
  right-padded to the widest (`forward(pad_after=...)`: no real position sees that padding either).
  What each storing call stores is cut back into its own cache. A group runs in as few passes as fit
  the model's context (`_within_context`).
- calls over rows of one KV pool (`dlm.model.kv_pool.PoolPass`: the cohort's block-model requests,
  `dlm.serving.pooled`): all of them, one block wide, each row over its own slot; the first calls of
  requests whose prompts span more than a block, fed whole, in a pass of their own.
Any other call runs alone, as the model's own call.

A shared pass gives each row the logits of its pass alone up to float rounding (a wider batch may
sum in another order), which is the promise of docs/reproducibility.md for batches of prompts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor, nn

from dlm.model.attention import KVCache
from dlm.model.denoiser import block_size
from dlm.model.kv_pool import PoolPass
from dlm.runtime.memory import is_out_of_memory
from dlm.sampling.tokens import sample_tokens, sample_with_probabilities

if TYPE_CHECKING:
    from dlm.config.schema import ModelConfig
    from dlm.model.transformer import DiffusionTransformer


class Departed(Exception):
    """The request's client has gone: its rows leave before their next pass."""


@dataclass(eq=False)
class Call:
    """One request's model call, waiting for its pass."""

    tokens: Tensor
    output_positions: Tensor | None
    cache: KVCache | PoolPass | None
    pad: Tensor | None
    others: dict[str, Any] = field(default_factory=dict)  # keywords sampling never passes: the call runs alone
    done: bool = False  # answered: the engine answers every call before it resumes the request
    result: Tensor | None = None
    error: BaseException | None = None

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def sequences(self) -> int:
        """The request rows it advances: its rows, but one per slot of a pool pass, whose finished block or
        prompt may be fed as a row of its own beside the block of the same slot."""

        return len(set(self.cache.slots)) if isinstance(self.cache, PoolPass) else self.rows

    def group(self, block: int) -> tuple[Any, ...] | None:
        """Calls of equal groups share a pass; None: this one runs alone."""

        if self.others or self.output_positions is None or self.output_positions.dtype != torch.bool:
            return None
        cache, width = self.cache, int(self.tokens.shape[1])
        if isinstance(cache, PoolPass):  # rows of one pool: a block wide each, or prompts fed whole
            return ("pool", id(cache.pool), width <= block)
        if cache is None:
            # A block model's rows keep their block columns only when padded by whole blocks.
            return ("whole", width % block if block else 0)
        if not block and not cache.length and not cache.stored and cache.committing and cache.keep is None:
            return ("fresh",)  # a whole-sequence model's cache refresh: a whole pass that keeps every key
        after = cache.stored - cache.length  # keys of positions after the fed ones (`cache dual`)
        if cache.dropped or after < 0 or (after and (block or cache.committing)) or (block and cache.length % block):
            return None
        if block and width <= 2 * block:
            # A block model's step: up to two blocks fed after the cache (the last cut short where its
            # sequence ends); the rows are right-padded to the widest, padding no real position sees.
            return ("blocks",)
        return ("cached", width, cache.committing, cache.keep, after)

    @property
    def kv(self) -> KVCache | None:
        """The call's own `KVCache` (None: no cache, or rows of a KV pool)."""

        return self.cache if isinstance(self.cache, KVCache) else None

    @property
    def stores(self) -> int:
        """Positions of the fed tokens this call stores in its cache (0: it stores none)."""

        if not isinstance(self.cache, KVCache) or not self.cache.committing:
            return 0
        return int(self.tokens.shape[1]) if self.cache.keep is None else self.cache.keep

    def answer(self, result: Tensor | None = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.done = result, error, True


@dataclass(eq=False)
class Draw:
    """One request's token draw (`dlm.sampling.tokens.sample_tokens` on the logits of its rows), waiting for
    the draws of the other requests: the engine draws those of one kind in one call."""

    logits: Tensor
    uniform: Tensor | None  # each row's uniform draws, from the request's own streams
    temperature: float
    top_k: int | None
    top_p: float | None
    probabilities: bool  # the model's own distribution too (`sample_with_probabilities`)
    done: bool = False
    result: tuple[Tensor, Tensor | None] | None = None
    error: BaseException | None = None

    def group(self) -> tuple[Any, ...]:
        """Draws of equal groups run as one: the same options on logits of one width, type and device."""

        return (
            self.probabilities,
            self.temperature,
            self.top_k,
            self.top_p,
            self.uniform is None,
            self.logits.shape[1:],
            self.logits.dtype,
            self.logits.device,
        )

    def answer(self, result: tuple[Tensor, Tensor | None] | None = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.done = result, error, True


def run_draws(draws: list[Draw]) -> None:
    """Answer every draw: those of one group by one `sample_tokens` (`sample_with_probabilities`) over
    their rows stacked. A row's token depends only on its logits and its uniforms, so each request gets
    what it draws alone (up to the float rounding of a wider batch); the draw's work per step is paid
    once, not once a request."""

    groups: dict[tuple[Any, ...], list[Draw]] = {}
    for draw in draws:
        groups.setdefault(draw.group(), []).append(draw)
    if draws:
        _answer_in_batches(list(groups.values()), _split_draw, draws[0].logits.device, "token draw")


def _split_draw(batch: list[Draw]) -> list[tuple[Tensor, Tensor | None]]:
    tokens, probabilities = _draw_together(batch)
    sizes = [int(draw.logits.shape[0]) for draw in batch]
    if probabilities is None:
        return [(part, None) for part in tokens.split(sizes)]
    return list(zip(tokens.split(sizes), probabilities.split(sizes), strict=True))


Work = TypeVar("Work", Call, Draw)  # what a request waits on: a model call or a token draw


def _answer_in_batches(
    batches: list[list[Work]],
    run: Callable[[list[Work]], Sequence[Any]],
    device: torch.device,
    what: str,
    on_done: Callable[[list[Work], float], None] = lambda batch, seconds: None,
) -> None:
    """Answer the work of each batch with `run(batch)` (one result each), then `on_done(batch, seconds)`.
    An error fails its batch's requests only; out of memory runs the batch's work one by one, as each
    request runs alone, and answers `OutOfMemory` where even that does not fit."""

    while batches:
        batch = batches.pop(0)
        started = time.perf_counter()
        try:
            results = run(batch)
        except Exception as exc:  # each request of the batch fails with it; the others go on
            if is_out_of_memory(exc):
                _release_memory(device)
                if len(batch) > 1:  # too large together: each alone
                    batches[:0] = [[work] for work in batch]
                    continue
                exc = OutOfMemory(f"the request's {what} does not fit the device's memory now; retry later")
            for work in batch:
                work.answer(error=exc)
            continue
        on_done(batch, time.perf_counter() - started)
        for work, result in zip(batch, results, strict=True):
            work.answer(result)


def _draw_together(batch: list[Draw]) -> tuple[Tensor, Tensor | None]:
    first = batch[0]
    logits = torch.cat([draw.logits for draw in batch]) if len(batch) > 1 else first.logits
    uniform = None
    if first.uniform is not None:
        uniforms = [draw.uniform for draw in batch if draw.uniform is not None]
        uniform = torch.cat(uniforms) if len(uniforms) > 1 else uniforms[0]
    options: dict[str, Any] = {
        "temperature": first.temperature,
        "top_k": first.top_k,
        "top_p": first.top_p,
        "uniform": uniform,
    }
    if first.probabilities:
        return sample_with_probabilities(logits, **options)
    return sample_tokens(logits, **options), None


def _leading_pad(call: Call, extra: int) -> Tensor:
    pad = call.pad if call.pad is not None else torch.zeros(call.rows, dtype=torch.long, device=call.tokens.device)
    return pad + extra


def _whole_pass(model: DiffusionTransformer, calls: list[Call], filler: int) -> list[Tensor]:
    """Calls without a cache, or each with an empty cache that keeps every key, as one batch, left-padded to
    the widest; each cache gets its own rows' keys, without the padding."""

    width = max(int(call.tokens.shape[1]) for call in calls)
    fresh = KVCache(committing=True) if calls[0].cache is not None else None
    tokens, positions, pads = [], [], []
    for call in calls:
        extra = width - int(call.tokens.shape[1])
        assert call.output_positions is not None
        tokens.append(nn.functional.pad(call.tokens, (extra, 0), value=filler))
        positions.append(nn.functional.pad(call.output_positions, (extra, 0), value=False))
        pads.append(_leading_pad(call, extra))
    unpadded = all(call.pad is None and call.tokens.shape[1] == width for call in calls)
    logits = model(
        torch.cat(tokens), output_positions=torch.cat(positions), cache=fresh, pad=None if unpadded else torch.cat(pads)
    )
    start = 0
    for call in calls:
        if fresh is not None and call.kv is not None:
            rows, extra = slice(start, start + call.rows), width - int(call.tokens.shape[1])
            call.kv.layers = [
                None if kv is None else (kv[0][rows, :, extra:].contiguous(), kv[1][rows, :, extra:].contiguous())
                for kv in fresh.layers
            ]
            call.kv.length = int(call.tokens.shape[1])
        start += call.rows
    return list(logits.split([int(call.output_positions.sum()) for call in calls if call.output_positions is not None]))


def _merged_cache(calls: list[Call], keep: int) -> tuple[KVCache, list[int]]:
    """One cache for the calls' rows, each left-padded with zero keys to the longest, storing the first
    `keep` fed positions (0: none); the padding of each."""

    caches = [call.kv for call in calls if call.kv is not None]
    # Every cache holds as many keys after its fed positions (none but `cache dual`'s, which attends
    # without a mask, in any key order): left-padding all to the most keys keeps each row's rotary
    # positions (counted from its padding) and hides the padding keys.
    after = caches[0].stored - caches[0].length
    length = max(cache.stored for cache in caches) - after
    extras = [length - cache.length for cache in caches]
    layers: list[tuple[Tensor, Tensor] | None] = []
    for index in range(max(len(cache.layers) for cache in caches)):
        held = [cache.layers[index] for cache in caches if index < len(cache.layers)]
        template = next((kv for kv in held if kv is not None), None)  # any call's: its heads and width
        if template is None:  # no call holds this layer's keys yet
            layers.append(None)
            continue
        keys, values = [], []
        for call, cache, extra in zip(calls, caches, extras, strict=True):
            stored = cache.layers[index] if index < len(cache.layers) else None
            if stored is None:  # an empty cache: padding only
                heads, dim = template[0].shape[1], template[0].shape[3]
                empty = template[0].new_zeros(call.rows, heads, 0, dim)
                stored = (empty, empty)
            keys.append(nn.functional.pad(stored[0], (0, 0, extra, 0)))
            values.append(nn.functional.pad(stored[1], (0, 0, extra, 0)))
        layers.append((torch.cat(keys), torch.cat(values)))
    return KVCache(layers, length=length, committing=keep > 0, keep=keep or None), extras


def _cached_pass(model: DiffusionTransformer, calls: list[Call], filler: int) -> list[Tensor]:
    """Calls with caches that hold every position before them, as one batch: the caches left-padded to the
    longest, the fed tokens right-padded to the widest (a block model's calls, whose padding no real
    position sees); what each storing call stores is cut back into its own cache."""

    merged, extras = _merged_cache(calls, max(call.stores for call in calls))
    tokens, positions, widened = _right_padded(calls, filler)
    after = [extra for call, extra in zip(calls, widened, strict=True) for _ in range(call.rows)]
    pad = torch.cat([_leading_pad(call, extra) for call, extra in zip(calls, extras, strict=True)])
    pad_after = torch.tensor(after, device=pad.device) if any(after) else None
    logits = model(tokens, output_positions=positions, cache=merged, pad=pad, pad_after=pad_after)
    start = 0
    for call, extra in zip(calls, extras, strict=True):
        assert call.kv is not None
        rows, end = slice(start, start + call.rows), extra + call.kv.length + call.stores
        if call.stores:
            call.kv.layers = [
                None if kv is None else (kv[0][rows, :, extra:end].contiguous(), kv[1][rows, :, extra:end].contiguous())
                for kv in merged.layers
            ]
            call.kv.length += call.stores
        start += call.rows
    return list(logits.split([int(call.output_positions.sum()) for call in calls if call.output_positions is not None]))


def _right_padded(calls: list[Call], filler: int) -> tuple[Tensor, Tensor, list[int]]:
    """The calls' fed tokens and output positions as one batch, each right-padded to the widest (with
    `filler`, and no output there); the padding of each."""

    width = max(int(call.tokens.shape[1]) for call in calls)
    tokens, positions, extras = [], [], []
    for call in calls:
        assert call.output_positions is not None
        extra = width - int(call.tokens.shape[1])
        tokens.append(nn.functional.pad(call.tokens, (0, extra), value=filler) if extra else call.tokens)
        positions.append(
            nn.functional.pad(call.output_positions, (0, extra), value=False) if extra else call.output_positions
        )
        extras.append(extra)
    return torch.cat(tokens), torch.cat(positions), extras


def _pool_pass(model: DiffusionTransformer, calls: list[Call], filler: int) -> list[Tensor]:
    """Calls over rows of one `KVPool` as one pass: their fed tokens right-padded to the widest (padding
    whose keys no real position reads, `dlm.model.kv_pool`)."""

    tokens, positions, _ = _right_padded(calls, filler)
    passes = [call.cache for call in calls if isinstance(call.cache, PoolPass)]
    logits = model(tokens, output_positions=positions, cache=PoolPass.together(passes))
    return list(logits.split([int(call.output_positions.sum()) for call in calls if call.output_positions is not None]))


def run_calls(
    model: DiffusionTransformer, calls: list[Call], on_pass: Callable[[int, float], None] = lambda rows, seconds: None
) -> None:
    """Answer every call: those of one group in one pass, the others alone; `on_pass(rows, seconds)` after
    each pass, with the request rows it advanced (`Call.sequences`).
    Call it under `torch.inference_mode()` with the model in eval mode."""

    config = model.config
    block = block_size(config)
    groups: dict[tuple[Any, ...], list[Call]] = {}
    alone: list[Call] = []
    for call in calls:
        key = call.group(block)
        (alone if key is None else groups.setdefault(key, [])).append(call)
    batches = [[call] for call in alone]
    for group in groups.values():
        pooled = isinstance(group[0].cache, PoolPass)  # each row within the context in its own slot
        batches += [group] if pooled else _within_context(group, config.max_seq_len)
    _answer_in_batches(
        batches,
        lambda batch: _run_batch(model, batch, config),
        next(iter(model.parameters())).device,
        "forward pass",
        lambda batch, seconds: on_pass(sum(call.sequences for call in batch), seconds),
    )


def _within_context(calls: list[Call], context: int) -> list[list[Call]]:
    """The calls of one group in as few batches as fit the model's context. Merged caches are left-padded
    to the longest and the fed tokens right-padded to the widest, so a batch spans the most keys any of
    its calls holds plus the widest feed, which can exceed the context when requests are far apart
    (one near its end, another starting its second block): those run in separate passes."""

    def span(batch: list[Call]) -> int:
        return max(call.kv.stored if call.kv is not None else 0 for call in batch) + max(
            int(call.tokens.shape[1]) for call in batch
        )

    batches: list[list[Call]] = []
    for call in calls:
        home = next((batch for batch in batches if span([*batch, call]) <= context), None)
        if home is None:
            batches.append([call])
        else:
            home.append(call)
    return batches


class OutOfMemory(Exception):
    """A request's pass did not fit the device's memory, even alone: answered 503, worth a retry."""


def _release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_batch(model: DiffusionTransformer, batch: list[Call], config: ModelConfig) -> list[Tensor]:
    if len(batch) == 1:  # the request's own call, as it would run alone
        call = batch[0]
        keywords = dict(call.others)
        if call.cache is not None:
            keywords["cache"] = call.cache
        if call.pad is not None:
            keywords["pad"] = call.pad
        return [model(call.tokens, output_positions=call.output_positions, **keywords)]
    if isinstance(batch[0].cache, PoolPass):
        return _pool_pass(model, batch, config.mask_token_id)
    if batch[0].cache is None or batch[0].group(block_size(config)) == ("fresh",):
        return _whole_pass(model, batch, config.mask_token_id)
    return _cached_pass(model, batch, config.mask_token_id)


class RequestModel:
    """The served model as one request's sampler sees it: its calls wait for a shared pass (`submit`).

    It is a `dlm.model.denoiser.Denoiser`: the config, parameters and buffers of the served model, the
    eval mode it is always in. `departed` is set when the request's client has gone: its next call raises
    `Departed`, so its rows leave before that pass.
    """

    training = False

    def __init__(
        self, model: DiffusionTransformer, submit: Callable[[Call | Draw], None], departed: threading.Event
    ) -> None:
        self._model, self._submit, self._departed = model, submit, departed

    @property
    def config(self) -> ModelConfig:
        return self._model.config

    def __call__(
        self,
        tokens: Tensor,
        output_positions: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        pad: Tensor | None = None,
        **others: Any,
    ) -> Tensor:
        call = Call(tokens, output_positions, cache, pad, others)
        self._wait_for(call)
        assert call.result is not None
        return call.result

    def draw_tokens(
        self,
        logits: Tensor,
        *,
        probabilities: bool,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        uniform: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """`sample_tokens` of the request's rows (`sample_with_probabilities` with `probabilities`), drawn
        in one batch with the other requests' draws."""

        draw = Draw(logits, uniform, temperature, top_k, top_p, probabilities)
        self._wait_for(draw)
        assert draw.result is not None
        return draw.result

    def _wait_for(self, work: Call | Draw) -> None:
        """Hand `work` to the engine and return once it is answered (raising its error); `Departed` first
        if the client has gone."""

        if self._departed.is_set():
            raise Departed
        self._submit(work)  # returns once the work is answered
        if not work.done:
            raise RuntimeError(f"a {type(work).__name__.lower()} came back unanswered")
        if work.error is not None:
            raise work.error

    def train(self, mode: bool = True) -> RequestModel:
        return self  # the served model stays in eval mode

    def eval(self) -> RequestModel:
        return self

    def to(self, device: torch.device) -> RequestModel:
        return self  # the served model stays where it was loaded; `generate` asks for its own device

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return iter(self._model.parameters(recurse))

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        return iter(self._model.buffers(recurse))
