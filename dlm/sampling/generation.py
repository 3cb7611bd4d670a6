"""`generate`: text in, text out: the prompt or template, the tokenizer, the sampler, the timing."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dlm.choices import CacheMode, RevealSplit
from dlm.data.tokenizer import never_sampled_ids, optional_token_id
from dlm.diffusion.schedules import Schedule, get_schedule, model_schedule
from dlm.errors import UserError
from dlm.model.denoiser import block_size
from dlm.sampling.autoregressive import autoregressive_options
from dlm.sampling.dispatch import counting_tokens, denoise, inference
from dlm.sampling.options import SampleResult, SamplingOptions, StepCallback, sampling_remasking, sampling_steps
from dlm.sampling.prompt_batch import consecutive_seeds, encode_prompts, generate_prompts, prompt_chunks, prompt_records
from dlm.sampling.prompting import build_sequence, check_request
from dlm.sampling.reverse import cut_after_stop
from dlm.sampling.row_noise import noise_device

if TYPE_CHECKING:
    from dlm.model.denoiser import Denoiser


def _model_device(model: Denoiser) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def generate(
    model: Denoiser,
    tokenizer: Any,
    *,
    prompt: str = "",
    text: str | None = None,
    length: int = 64,
    steps: int | None = None,
    num_samples: int = 1,
    seed: int = 0,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = 0.9,
    remasking: str | None = None,
    block_length: int | None = None,
    device: str | torch.device | None = None,
    on_step: StepCallback | None = None,
    schedule: str | Schedule | None = None,
    stop_at_end: bool = False,
    threshold: float | None = None,
    cache: CacheMode = "none",
    prompts: Sequence[str] | None = None,
    reveal_split: RevealSplit = "schedule",
    seeds: Sequence[int] | None = None,
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
    counts the generated tokens kept. `threshold` and `cache` are described in `dlm.sampling.fast`;
    `reveal_split` (`schedule` or LLaDA's `even`) in `dlm.sampling.reverse`. `steps` None takes the
    steps a distilled student was distilled for (`dlm distill`), else 64 (`sampling_steps`); `remasking`
    None its reveal order, else `random` (ancestral).

    `prompts`, a list, samples each of them (`num_samples` rows each, prompt by prompt) in one
    padded batch: the i-th draws exactly the random numbers of `prompt=prompts[i], seed=seed + i`
    and gets its tokens up to float rounding: a choice that is a tie within rounding can go either
    way (`dlm.sampling.prompt_batch`, docs/reproducibility.md); `on_step` sees the padded batch when the prompts
    form one (`generate_prompts`). `seeds`
    gives each prompt its own seed instead (the i-th draws the random numbers of `seed=seeds[i]`). A
    block model generates past its `max_seq_len` with a sliding window (`dlm.sampling.block_model`).
    """

    steps = sampling_steps(model, steps)
    options = SamplingOptions(
        steps=steps,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        remasking=sampling_remasking(model, remasking),
        block_length=block_length,
        threshold=threshold,
        cache=cache,
        reveal_split=reveal_split,
    )
    config = model.config
    device = _model_device(model) if device is None else torch.device(device)
    model.to(device)
    forbidden = never_sampled_ids(tokenizer, config.vocab_size)
    chosen = model_schedule(model) if schedule is None else get_schedule(schedule)
    end_id = optional_token_id(tokenizer, "eos") if stop_at_end else None
    if prompts is not None:
        if prompt or text is not None:
            raise UserError("a list of prompts cannot be combined with --prompt or --text")

        if seeds is not None and len(seeds) != len(prompts):
            raise UserError(f"{len(seeds)} seeds for {len(prompts)} prompts", fix="give one seed per prompt")
        per_prompt = consecutive_seeds(seed, len(prompts)) if seeds is None else list(seeds)
        if config.is_autoregressive:  # one step per token, whatever `steps` says: the result says so
            options = autoregressive_options(options, length)
        return generate_prompts(
            model,
            tokenizer,
            prompts,
            length=length,
            num_samples=num_samples,
            seeds=per_prompt,
            options=options,
            device=device,
            schedule=chosen,
            forbidden=forbidden,
            end_id=end_id,
            on_step=on_step,
        )
    if seeds is not None:
        raise UserError("seeds are for a list of prompts", fix="pass prompts=[...] with them, or seed= alone")
    parts = check_request(prompt=prompt, text=text, length=length, num_samples=num_samples, seed=seed)
    limit = None if block_size(config) else config.max_seq_len  # a block model slides on
    ids, fill = build_sequence(
        tokenizer, parts, templated=text is not None, mask_token_id=config.mask_token_id, max_seq_len=limit
    )
    if config.is_autoregressive:  # one step per token, whatever `steps` says: the result says so
        options = autoregressive_options(options, sum(fill))
        steps = options.steps
    generator = torch.Generator(device=noise_device(device)).manual_seed(seed)
    tokens = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    fill_mask = torch.tensor(fill, dtype=torch.bool, device=device)
    start = time.perf_counter()
    with inference(model), counting_tokens(model) as fed:
        tokens, forward_passes = denoise(
            model,
            tokens,
            fill_mask,
            options,
            generator=generator,
            forbidden_token_ids=forbidden,
            on_step=on_step,
            schedule=chosen,
            stop_token_id=end_id,
        )
        token_ids = tokens.tolist()  # waits for the device, so the timing covers all queued work
    if end_id is not None:
        token_ids = cut_after_stop(token_ids, fill, end_id)
    seconds = time.perf_counter() - start
    texts = [tokenizer.decode(row, skip_special_tokens=False) for row in token_ids]
    lengths = [sum(fill[: len(row)]) for row in token_ids]
    prompt_tokens = fill.index(True) if True in fill else len(fill)
    return SampleResult(
        texts,
        token_ids,
        steps,
        forward_passes,
        seconds,
        fed[0],
        lengths,
        [prompt_tokens] * num_samples,
        [seed] * num_samples,
    )


def generate_records(
    model: Denoiser,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    batch_size: int,
    length: int,
    num_samples: int,
    seed: int,
    stop_at_end: bool = False,
    **options: Any,
) -> Iterator[dict[str, Any]]:
    """`generate` on many prompts in batches of `batch_size`, yielding one record per sample
    (`dlm.sampling.prompt_batch.prompt_records`) as each batch ends. Every prompt is checked before the
    first batch runs; prompt i keeps seed `seed + i`, as in one batch. `options` are `generate`'s."""

    encode_prompts(
        tokenizer,
        model.config,
        prompts,
        length=length,
        num_samples=num_samples,
        seeds=consecutive_seeds(seed, len(prompts)),
    )
    end_id = optional_token_id(tokenizer, "eos") if stop_at_end else None
    for chunk, chunk_seed in prompt_chunks(prompts, batch_size, seed):
        result = generate(
            model,
            tokenizer,
            prompts=chunk,
            length=length,
            num_samples=num_samples,
            seed=chunk_seed,
            stop_at_end=stop_at_end,
            **options,
        )
        yield from prompt_records(result, chunk, tokenizer, end_id)
