"""Generation by reversing the masking process of a masked diffusion language model.

A sequence starts as the prompt followed by `length` mask tokens. Time runs from t = 1 (all
generated positions masked) to t = 0 over `steps` equal steps; each step predicts the masked
positions and reveals ("commits") some of them. A revealed token never changes. How many depends on
the noise schedule the model was trained with (`dlm.diffusion.schedules`; m(t) = t for the default linear one).

Which masked positions are revealed at a step from t to s = t - 1/steps:

- `random`: ancestral sampling of the true reverse process; every masked position is revealed
  independently with the schedule's reveal probability (m(t) - m(s)) / m(t), which is 1 at the
  last step ((t - s) / t for linear).
- `confidence`: LLaDA's low-confidence remasking; the model's distribution is sampled at every
  masked position and the k most probable samples are kept, the rest stay masked. k follows the
  schedule: floor(n * m(s)) of a block's n positions stay masked at time s, none after the last step
  (`reveal_split="schedule"`, the default). `reveal_split="even"` is LLaDA's own split
  (`get_num_transfer_tokens`): n // steps each, the first n % steps steps one more, whatever the
  schedule. For 6 positions in 4 steps the schedule reveals 2, 1, 2, 1 and the even split 2, 2, 1, 1.
- `margin`: as `confidence`, but a position's confidence is top-1 minus top-2 probability.

`block_length` B makes the sampler semi-autoregressive: the positions to generate are split, left
to right, into blocks of B; each block runs its share of the steps and later blocks stay masked
until the earlier ones are complete.

Infilling templates (`text=`): `[MASK]` is one token to generate and `[MASK*N]` is N of them;
everything else is fixed text, kept token for token. Example: "ROMEO: [MASK*20] fair Verona".

A step that reveals nothing does not call the model: the revealed tokens would be the same for any
prediction, so its forward pass is skipped (MDLM's cached sampler gets the same saving by reusing
predictions while the noisy sequence is unchanged). `SampleResult.forward_passes` counts the calls.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, get_args

import torch

from dlm.choices import CacheMode, RevealSplit
from dlm.data.tokenizer import SPECIAL_TOKENS
from dlm.diffusion.schedules import LinearSchedule, Schedule, Time, get_schedule, model_schedule
from dlm.errors import UserError
from dlm.noise import RowNoise
from dlm.prompting import TemplatePart as TemplatePart
from dlm.prompting import build_sequence as build_sequence
from dlm.prompting import check_request as check_request
from dlm.prompting import parse_template as parse_template
from dlm.prompting import split_masked as split_masked
from dlm.remasking import remasking_names
from dlm.remasking import token_confidence as token_confidence

if TYPE_CHECKING:
    from dlm.model.attention import KVCache
    from dlm.model.denoiser import Denoiser

CACHE_CHOICES: tuple[str, ...] = get_args(CacheMode)
REVEAL_SPLITS: tuple[str, ...] = get_args(RevealSplit)
_LINEAR = LinearSchedule()  # the default schedule, as in `[diffusion]`
StepCallback = Callable[[int, torch.Tensor], None]
@dataclass(frozen=True)
class SamplingOptions:
    """How to run the reverse process; invalid values raise `UserError` naming the CLI option."""

    steps: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    # Measured (scripts/sampler_defaults.py, docs/benchmarks.md): on a weakly trained model, greedy or
    # confidence-ordered reveals commit the most frequent token (a newline) nearly everywhere; random
    # (ancestral) reveals with nucleus sampling give text.
    top_p: float | None = 0.9
    remasking: str = "random"  # a name registered in dlm.remasking (built-ins: dlm.choices.Remasking)
    block_length: int | None = None
    threshold: float | None = None  # `dlm.decoding`: commit every position above this confidence
    cache: CacheMode = "none"  # `dlm.decoding`: approximate KV cache of a whole-sequence model
    reveal_split: RevealSplit = "schedule"  # `reveal_count`: how fixed-count steps share a block's positions

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UserError(f"--steps must be at least 1 (got {self.steps})", fix="pass --steps 64")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(
                f"--temperature must be a finite number >= 0 (got {self.temperature})",
                fix="1.0 samples the model's distribution, 0 picks the most likely token",
            )
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"--top-k must be at least 1 (got {self.top_k})", fix="omit it to keep all tokens")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1] (got {self.top_p})", fix="try --top-p 0.9")
        if self.remasking not in remasking_names():
            raise UserError(f"--remasking must be one of {', '.join(remasking_names())} (got {self.remasking!r})")
        if self.block_length is not None and self.block_length < 1:
            raise UserError(
                f"--block-length must be at least 1 (got {self.block_length})",
                fix="omit it to denoise all positions together",
            )
        if self.threshold is not None and not 0 < self.threshold < 1:
            raise UserError(f"--threshold must be in (0, 1) (got {self.threshold})", fix="try --threshold 0.9")
        if self.cache not in CACHE_CHOICES:
            raise UserError(f"--cache must be one of {', '.join(CACHE_CHOICES)} (got {self.cache!r})")
        if self.reveal_split not in REVEAL_SPLITS:
            raise UserError(f"--reveal-split must be one of {', '.join(REVEAL_SPLITS)} (got {self.reveal_split!r})")
        if self.reveal_split != "schedule" and self.remasking == "random" and self.threshold is None:
            raise UserError(f"--reveal-split {self.reveal_split} sets how many positions a step reveals, which "
                            "ancestral steps (--remasking random) draw at random",
                            fix="add --remasking confidence or margin, or a --threshold")  # fmt: skip


@dataclass(frozen=True)
class SampleResult:
    """Generated samples: full texts and token ids (prompt or template included)."""

    texts: list[str]
    token_ids: list[list[int]]
    steps: int
    forward_passes: int
    seconds: float
    forward_tokens: int = 0  # token positions fed to the model over all passes (rows x length): compute
    lengths: list[int] = field(default_factory=list)  # generated tokens kept per sample
    prompt_tokens: list[int] = field(default_factory=list)  # per sample: tokens before the first generated one
    seeds: list[int] = field(default_factory=list)  # per sample: the seed of its random stream

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# Token sampling


def filter_logits(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf all but the top-k logits and all but the smallest top-p probability nucleus.

    Tokens tied with the k-th logit are kept. The most likely token always survives, so every row
    keeps a non-empty support.
    """

    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the more likely tokens before it already reach top_p.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of `logits` [N, V] by the Gumbel-max trick (argmax at temperature 0).

    The noise is float64: in 16-bit (or even 32-bit) precision the Gumbel tails are truncated and
    repeated samples lose diversity. `uniform` [N, V] gives the uniform draws instead of `generator`.
    """

    logits = logits.double()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / temperature, top_k=top_k, top_p=top_p)
    if uniform is None:
        uniform = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float64).tiny)))
    return (logits + gumbel).argmax(dim=-1)


# ---------------------------------------------------------------------------------------------
# The reverse process


def _noise_device(device: torch.device) -> torch.device:
    # MPS has no float64, so the sampling noise (and the generator) live on the CPU there.
    return torch.device("cpu") if device.type == "mps" else device


@dataclass(frozen=True)
class _Reverse:
    """What every step of one reverse process shares."""

    model: Denoiser
    options: SamplingOptions
    noise: RowNoise
    mask_id: int
    forbidden: torch.Tensor  # token ids never predicted (mask first), on the noise device
    pad: torch.Tensor | None = field(default=None, kw_only=True)  # leading padding per row of a batch of prompts

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """The model on `tokens` of the batch rows `rows` (None: all), with their padding if any."""

        if self.pad is None:
            if cache is None:
                return self.model(tokens, output_positions=positions)
            return self.model(tokens, output_positions=positions, cache=cache)
        pad = self.pad if rows is None else self.pad[rows]
        return self.model(tokens, output_positions=positions, cache=cache, pad=pad)

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The model's logits at `positions` of `tokens`, the batch rows `rows` (None: all) of the sequence."""

        return self.forward(tokens, positions, rows)

    def uniform(self, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | None:
        """Draws for `sample_tokens` at `positions` [R, L] of the rows `rows`, each row from its stream."""

        if self.options.temperature == 0:
            return None
        counts = positions.sum(dim=1)
        if rows is not None:
            counts = torch.zeros(rows.shape, dtype=counts.dtype, device=counts.device).masked_scatter(rows, counts)
        return self.noise.stacked(counts, self.model.config.vocab_size)

    def predict(
        self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sampled tokens [N] (and their confidences, when remasking needs them) at `positions`."""

        logits = self.logits(tokens, positions, rows).to(self.noise.device, torch.float64)
        logits[:, self.forbidden] = float("-inf")
        options = self.options
        new = sample_tokens(
            logits,
            temperature=options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            uniform=self.uniform(positions, rows),
        )
        confidence = None
        if options.remasking != "random":
            # The model's own (untempered, unfiltered) probabilities rank the samples, as in LLaDA.
            confidence = token_confidence(logits.softmax(dim=-1), new, options.remasking)
        return new.to(tokens.device), confidence

    def reveal_random(self, tokens: torch.Tensor, block: torch.Tensor, probability: Time) -> int:
        """Ancestral step: reveal each masked position of `block` with `probability`."""

        masked = tokens[:, block] == self.mask_id
        draws = self.noise.per_row(tuple(masked.shape))
        # draws < p, written as draws x (1 / p) < 1: the linear schedule's exact 1 / p is the number
        # of steps left, so its draws compare exactly as they always have.
        odds = float(1 / probability) if probability > 0 else math.inf
        reveal = masked & (draws * odds < 1).to(tokens.device)
        rows = reveal.any(dim=1)
        if not bool(rows.any()):
            return 0
        positions = torch.zeros_like(tokens, dtype=torch.bool)
        positions[:, block] = reveal
        # Only rows that reveal something need a prediction, and only at the revealed positions.
        sub_tokens, sub_positions = tokens[rows], positions[rows]
        new, _ = self.predict(sub_tokens, sub_positions, rows)
        sub_tokens[sub_positions] = new
        tokens[rows] = sub_tokens
        return 1

    def reveal_confident(self, tokens: torch.Tensor, block: torch.Tensor, count: int) -> int:
        """Remasking step: sample all masked positions of `block`, keep the `count` most confident."""

        if count == 0:
            return 0
        candidates = torch.zeros_like(tokens, dtype=torch.bool)
        candidates[:, block] = tokens[:, block] == self.mask_id
        new, confidence = self.predict(tokens, candidates)
        assert confidence is not None
        scores = torch.full(tokens.shape, float("-inf"), dtype=torch.float64, device=confidence.device)
        scores[candidates.to(scores.device)] = confidence
        # Every row has the same number of masked positions (>= count): top-k picks only candidates.
        chosen = scores.topk(count, dim=1).indices.to(tokens.device)
        proposal = tokens.clone()
        proposal[candidates] = new
        tokens.scatter_(1, chosen, proposal.gather(1, chosen))
        return 1


def _block_steps(steps: int, num_blocks: int) -> list[int]:
    """Split `steps` across blocks as evenly as possible, earlier blocks taking the remainder."""

    return [steps // num_blocks + (index < steps % num_blocks) for index in range(num_blocks)]


def step_times(steps: int, step: int) -> tuple[Fraction, Fraction]:
    """The times (t, s) that step `step` (0-based) of `steps` runs between, exactly: t = 1 - step / steps."""

    return Fraction(steps - step, steps), Fraction(steps - step - 1, steps)


def reveal_count(
    num_positions: int, steps: int, step: int, schedule: Schedule = _LINEAR, split: RevealSplit = "schedule"
) -> int:
    """Positions to reveal at `step` (0-based): so that floor(n * m(s)) stay masked at time s, or by
    the `even` split n // steps, one more in each of the first n % steps steps (LLaDA)."""

    if split == "even":
        return num_positions // steps + (step < num_positions % steps)
    t, s = step_times(steps, step)
    return schedule.masked_count(num_positions, t) - schedule.masked_count(num_positions, s)


def masked_after(
    num_positions: int, steps: int, step: int, schedule: Schedule = _LINEAR, split: RevealSplit = "schedule"
) -> int:
    """Positions of `num_positions` still masked after `step` (0-based) when every step reveals its `reveal_count`."""

    if split == "even":
        done = step + 1
        return num_positions - done * (num_positions // steps) - min(done, num_positions % steps)
    return schedule.masked_count(num_positions, step_times(steps, step)[1])


def denoise(
    model: Denoiser,
    tokens: torch.Tensor,
    fill_mask: torch.Tensor,
    options: SamplingOptions,
    *,
    generator: torch.Generator | RowNoise,
    forbidden_token_ids: Sequence[int] = (),
    on_step: StepCallback | None = None,
    schedule: Schedule | None = None,
    stop_token_id: int | None = None,
    pad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """Run the reverse process on `tokens` [B, L] where `fill_mask` [L] is true.

    Returns the completed tokens (no mask left in `fill_mask`, everything else unchanged) and the
    number of model forward passes. `model.config.mask_token_id` and `forbidden_token_ids` are
    never predicted. `on_step(step, tokens)` gets a copy of the tokens: step 0 is the starting
    sequence, then steps 1 .. `options.steps`. `schedule` defaults to the one the model was trained
    with (`dlm.diffusion.schedules.model_schedule`). Call it in eval mode under `torch.inference_mode()` (as
    `generate` does). A `dlm.noise.RowNoise` as `generator` gives groups of rows their own random
    streams; `pad` [B] counts each row's leading padding positions, which no position attends to.
    """

    mask_id = model.config.mask_token_id
    generator = RowNoise.of(generator, tokens.shape[0])
    schedule = model_schedule(model) if schedule is None else schedule
    if getattr(model.config, "is_block_model", False):  # block by block, prefix cached, may stop early
        from dlm.block_sampling import denoise_blocks
        from dlm.decoding import check_block_model_options

        check_block_model_options(options)

        return denoise_blocks(model, tokens, fill_mask, options, generator=generator, schedule=schedule,
                              forbidden_token_ids=forbidden_token_ids, on_step=on_step,
                              stop_token_id=stop_token_id, pad=pad)  # fmt: skip
    tokens = tokens.clone()
    tokens[:, fill_mask] = mask_id
    never = [mask_id, *(token for token in forbidden_token_ids if token != mask_id)]
    reverse = _Reverse(model, options, generator, mask_id, torch.tensor(never, device=generator.device), pad=pad)
    positions = fill_mask.nonzero().squeeze(-1)
    blocks = list(positions.split(options.block_length)) if options.block_length else [positions]
    if len(blocks) > options.steps:
        raise UserError(
            f"--steps ({options.steps}) is fewer than the {len(blocks)} blocks of --block-length "
            f"{options.block_length}",
            fix=f"use at least {len(blocks)} steps or a larger --block-length",
        )
    if options.threshold is not None or options.cache != "none" or stop_token_id is not None:
        from dlm.decoding import denoise_fast

        if on_step is not None:
            on_step(0, tokens.clone())
        return denoise_fast(model, tokens, fill_mask, options, blocks, generator=generator, schedule=schedule,
                            forbidden_token_ids=forbidden_token_ids, on_step=on_step,
                            stop_token_id=stop_token_id, pad=pad)  # fmt: skip
    forward_passes, step = 0, 0
    if on_step is not None:
        on_step(0, tokens.clone())
    for block, block_steps in zip(blocks, _block_steps(options.steps, len(blocks)), strict=True):
        for index in range(block_steps):
            if options.remasking == "random":
                t, s = step_times(block_steps, index)
                forward_passes += reverse.reveal_random(tokens, block, schedule.reveal_probability(s, t))
            else:
                count = reveal_count(block.numel(), block_steps, index, schedule, options.reveal_split)
                forward_passes += reverse.reveal_confident(tokens, block, count)
            step += 1
            if on_step is not None:
                on_step(step, tokens.clone())
    return tokens, forward_passes


def _model_device(model: Denoiser) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


@contextmanager
def _inference(model: Denoiser) -> Iterator[None]:
    """Eval mode without autograd, leaving the model's train / eval mode as it was."""

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


@contextmanager
def _counting_tokens(model: Denoiser) -> Iterator[list[int]]:
    """Count the token positions fed to the model (its first argument), the cost a cache saves."""

    fed = [0]

    def count(module: Any, args: tuple[Any, ...]) -> None:
        fed[0] += args[0].numel()

    handle = model.register_forward_pre_hook(count) if isinstance(model, torch.nn.Module) else None
    try:
        yield fed
    finally:
        if handle is not None:
            handle.remove()


def generate(
    model: Denoiser,
    tokenizer: Any,
    *,
    prompt: str = "",
    text: str | None = None,
    length: int = 64,
    steps: int = 64,
    num_samples: int = 1,
    seed: int = 0,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = 0.9,
    remasking: str = "random",
    block_length: int | None = None,
    device: str | torch.device | None = None,
    on_step: StepCallback | None = None,
    schedule: str | Schedule | None = None,
    stop_at_end: bool = False,
    threshold: float | None = None,
    cache: CacheMode = "none",
    prompts: Sequence[str] | None = None,
    reveal_split: RevealSplit = "schedule",
) -> SampleResult:
    """Generate `num_samples` texts: `prompt` + `length` new tokens, or fill the template `text`.

    Templates: `[MASK]` is one token to generate, `[MASK*N]` is N tokens; the rest is fixed text,
    e.g. "ROMEO: [MASK*20] fair Verona". `prompt` and `text` are exclusive; `length` is ignored
    with a template. A fixed `seed` repeats the tokens bit for bit on the same machine with the same
    batch shape; elsewhere they are equal up to float rounding (docs/reproducibility.md). `device`
    defaults to the model's; another device moves the model there. Texts keep special tokens such as
    `<|endoftext|>` so document boundaries stay visible. `schedule` (a name or a `Schedule`)
    defaults to the noise schedule the model was trained with, which `dlm.load` records. With
    `stop_at_end` each sample ends at its first generated end-of-document token, and generation
    stops once every sample has one (a block model at the end of a block); `SampleResult.lengths`
    counts the generated tokens kept. `threshold` and `cache` are described in `dlm.decoding`;
    `reveal_split` (`schedule` or LLaDA's `even`) at the top of this module.

    `prompts`, a list, samples each of them (`num_samples` rows each, prompt by prompt) in one
    padded batch: the i-th draws exactly the random numbers of `prompt=prompts[i], seed=seed + i`
    and gets its tokens up to float rounding: a choice that is a tie within rounding can go either
    way (`dlm.prompt_batch`, docs/reproducibility.md); `on_step` is not called then. A block model generates past its
    `max_seq_len` with a sliding window (`dlm.block_sampling`).
    """

    options = SamplingOptions(steps=steps, temperature=temperature, top_k=top_k, top_p=top_p, remasking=remasking,
                              block_length=block_length, threshold=threshold, cache=cache,
                              reveal_split=reveal_split)  # fmt: skip
    config = model.config
    device = _model_device(model) if device is None else torch.device(device)
    model.to(device)
    pad_id = tokenizer.token_to_id(SPECIAL_TOKENS["pad"])
    forbidden = [pad_id] if pad_id is not None and pad_id < config.vocab_size else []
    chosen = model_schedule(model) if schedule is None else get_schedule(schedule)
    end_id = tokenizer.token_to_id(SPECIAL_TOKENS["eos"]) if stop_at_end else None
    if prompts is not None:
        if prompt or text is not None:
            raise UserError("a list of prompts cannot be combined with --prompt or --text")
        from dlm.prompt_batch import generate_prompts

        return generate_prompts(model, tokenizer, prompts, length=length, num_samples=num_samples, seed=seed,
                                options=options, device=device, schedule=chosen, forbidden=forbidden,
                                end_id=end_id)  # fmt: skip
    parts = check_request(prompt=prompt, text=text, length=length, num_samples=num_samples, seed=seed)
    limit = None if getattr(config, "is_block_model", False) else config.max_seq_len  # a block model slides on
    ids, fill = build_sequence(tokenizer, parts, templated=text is not None, mask_token_id=config.mask_token_id,
                               max_seq_len=limit)  # fmt: skip
    generator = torch.Generator(device=_noise_device(device)).manual_seed(seed)
    tokens = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    fill_mask = torch.tensor(fill, dtype=torch.bool, device=device)
    start = time.perf_counter()
    with _inference(model), _counting_tokens(model) as fed:
        tokens, forward_passes = denoise(model, tokens, fill_mask, options, generator=generator,
                                         forbidden_token_ids=forbidden, on_step=on_step, schedule=chosen,
                                         stop_token_id=end_id)  # fmt: skip
        token_ids = tokens.tolist()  # waits for the device, so the timing covers all queued work
    if end_id is not None:
        from dlm.block_sampling import cut_after_stop

        token_ids = cut_after_stop(token_ids, fill, end_id)
    seconds = time.perf_counter() - start
    texts = [tokenizer.decode(row, skip_special_tokens=False) for row in token_ids]
    lengths = [sum(fill[: len(row)]) for row in token_ids]
    prompt_tokens = fill.index(True) if True in fill else len(fill)
    return SampleResult(texts, token_ids, steps, forward_passes, seconds, fed[0], lengths,
                        [prompt_tokens] * num_samples, [seed] * num_samples)  # fmt: skip
