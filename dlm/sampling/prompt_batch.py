"""Many prompts of different lengths sampled as one batch, with the results of one-by-one sampling.

Rows are left-padded so that every prompt's generated positions share the same columns, which is
what the sampler's steps, blocks and caches index. Padding changes nothing a row computes: the
model gives each row its own positions (counted from its first real token) and no real position
attends to padding (`DiffusionTransformer.forward(pad=...)`); each prompt draws its random numbers
from its own generator, seeded with `seed + i` for the i-th prompt (`dlm.sampling.row_noise.RowNoise`). So prompt
i of a batch draws exactly the random numbers of `generate(prompt=prompts[i], seed=seed + i)`, and
its logits agree with that run's up to float rounding: the float sums of a padded, wider batch may
be split differently, and another CPU's kernels split them differently again. The tokens are the
same unless a choice (a sampled token, a rank, a threshold) is a tie within that rounding; from
such a tie on, the runs may differ (docs/reproducibility.md).

A block model's blocks are aligned to its first position, so rows can share block columns only
when padded by whole blocks: prompts whose lengths agree modulo the block size form one batch,
and such batches run one after the other.

A long list is sampled in chunks (`prompt_chunks`, `dlm sample --prompt-file --batch-size`): the
chunk that starts at prompt i is seeded seed + i, so every prompt keeps its own seed and stream,
and memory grows with the chunk, not the list.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dlm.errors import UserError
from dlm.model.denoiser import block_size
from dlm.sampling.dispatch import counting_tokens, denoise, inference
from dlm.sampling.options import SampleResult, StepCallback
from dlm.sampling.prompting import build_sequence, check_request
from dlm.sampling.reverse import cut_after_stop
from dlm.sampling.row_noise import RowNoise, noise_device

if TYPE_CHECKING:
    from dlm.diffusion.schedules import Schedule
    from dlm.model.denoiser import Denoiser
    from dlm.sampling.options import SamplingOptions


def _groups(config: Any, prompt_lengths: list[int]) -> list[list[int]]:
    """Indices of the prompts that share one padded batch."""

    block = block_size(config)
    if not block:
        return [list(range(len(prompt_lengths)))]
    by_phase: dict[int, list[int]] = {}
    for index, size in enumerate(prompt_lengths):
        by_phase.setdefault(size % block, []).append(index)
    return list(by_phase.values())


def prompt_offsets(config: Any, sizes: list[int]) -> list[int]:
    """Leading padding per prompt so that generation starts in the same column (whole blocks for a block model)."""

    block = block_size(config)
    if not block:
        return [max(sizes) - size for size in sizes]
    first = max(size // block for size in sizes)
    return [(first - size // block) * block for size in sizes]


def padded_batch(
    prompts: list[list[int]], offsets: list[int], num_samples: int, length: int, filler: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens [prompts x num_samples, W] (prompt i after `offsets[i]` fillers, then `length` to
    generate), the padding per row and the generated columns."""

    width = max(offset + len(ids) for offset, ids in zip(offsets, prompts, strict=True)) + length
    tokens = torch.full((len(prompts) * num_samples, width), filler, dtype=torch.long, device=device)
    for slot, (offset, ids) in enumerate(zip(offsets, prompts, strict=True)):
        rows = slice(slot * num_samples, (slot + 1) * num_samples)
        tokens[rows, offset : offset + len(ids)] = torch.tensor(ids, dtype=torch.long, device=device)
    pad = torch.tensor([offset for offset in offsets for _ in range(num_samples)], dtype=torch.long, device=device)
    fill_mask = torch.zeros(width, dtype=torch.bool, device=device)
    fill_mask[width - length :] = True
    return tokens, pad, fill_mask


def generate_prompts(
    model: Denoiser,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    length: int,
    num_samples: int,
    seeds: Sequence[int],
    options: SamplingOptions,
    device: torch.device,
    schedule: Schedule,
    forbidden: list[int],
    end_id: int | None,
    on_step: StepCallback | None = None,
) -> SampleResult:
    """`dlm.sampling.generation.generate` for a list of prompts: `num_samples` rows per prompt, prompt by prompt,
    prompt i with its own random stream seeded `seeds[i]`. `on_step` sees the padded batch (prompt i's rows after
    its leading padding, the generated tokens in the last `length` columns) when the prompts form one batch (all
    but a block model's prompts whose lengths differ modulo its block size); it is not called otherwise."""

    config = model.config
    encoded = encode_prompts(tokenizer, config, prompts, length=length, num_samples=num_samples, seeds=seeds)
    filler = forbidden[0] if forbidden else 0  # what padding holds does not matter: nothing sees it
    rows: dict[int, list[list[int]]] = {}
    passes = fed_total = 0
    start = time.perf_counter()
    groups = _groups(config, [len(ids) for ids in encoded])
    for group in groups:
        offsets = prompt_offsets(config, [len(encoded[i]) for i in group])
        tokens, pad, fill_mask = padded_batch([encoded[i] for i in group], offsets, num_samples, length, filler, device)
        generators = tuple(torch.Generator(device=noise_device(device)).manual_seed(seeds[i]) for i in group)
        noise = RowNoise(generators, (num_samples,) * len(group))
        with inference(model), counting_tokens(model) as fed:
            tokens, group_passes = denoise(
                model,
                tokens,
                fill_mask,
                options,
                generator=noise,
                schedule=schedule,
                forbidden_token_ids=forbidden,
                stop_token_id=end_id,
                pad=pad,
                on_step=on_step if len(groups) == 1 else None,
            )
            result = tokens.tolist()
        passes, fed_total = passes + group_passes, fed_total + fed[0]
        for slot, index in enumerate(group):
            rows[index] = [row[offsets[slot] :] for row in result[slot * num_samples : (slot + 1) * num_samples]]
    seconds = time.perf_counter() - start
    token_ids, lengths, prompt_tokens = [], [], []
    for index, ids in enumerate(encoded):
        fill = [False] * len(ids) + [True] * length
        kept = rows[index] if end_id is None else cut_after_stop(rows[index], fill, end_id)
        token_ids += kept
        lengths += [len(row) - len(ids) for row in kept]
        prompt_tokens += [len(ids)] * num_samples
    texts = [tokenizer.decode(row, skip_special_tokens=False) for row in token_ids]
    return SampleResult(
        texts,
        token_ids,
        options.steps,
        passes,
        seconds,
        fed_total,
        lengths,
        prompt_tokens,
        [seeds[index] for index in range(len(prompts)) for _ in range(num_samples)],
    )


def encode_prompts(
    tokenizer: Any, config: Any, prompts: Sequence[str], *, length: int, num_samples: int, seeds: Sequence[int]
) -> list[list[int]]:
    """The tokens of every prompt, each checked as `--prompt` with `--seed seeds[i]` would be."""

    if not prompts:
        raise UserError("no prompts to sample", fix="give at least one prompt (one per line of --prompt-file)")
    limit = None if block_size(config) else config.max_seq_len  # a block model slides on
    encoded = []
    for index, prompt in enumerate(prompts):
        parts = check_request(prompt=prompt, length=length, num_samples=num_samples, seed=seeds[index])
        ids, _ = build_sequence(
            tokenizer, parts, templated=False, mask_token_id=config.mask_token_id, max_seq_len=limit
        )
        encoded.append(ids[: len(ids) - length])
    return encoded


def consecutive_seeds(seed: int, count: int) -> list[int]:
    """Seeds `seed`, `seed + 1`, ... for `count` prompts: prompt i of a list sampled with `seed`."""

    if seed + count > 2**63:
        raise UserError(f"--seed {seed} plus the {count} prompts passes 2**63", fix="use a smaller --seed")
    return [seed + index for index in range(count)]


def prompt_chunks(prompts: Sequence[str], batch_size: int, seed: int) -> Iterator[tuple[list[str], int]]:
    """`prompts` in chunks of `batch_size`, each with its seed: that of its first prompt, so prompt i keeps seed + i."""

    for start in range(0, len(prompts), batch_size):
        yield list(prompts[start : start + batch_size]), seed + start


def read_prompt_file(path: str | Path) -> list[str]:
    """The prompts of a text file, one a line; blank lines are skipped."""

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError("no such prompt file", path=path, fix="pass a text file with one prompt a line") from None
    except UnicodeDecodeError:
        raise UserError("the prompt file is not UTF-8 text", path=path, fix="save it as UTF-8") from None
    except OSError as exc:
        raise UserError(f"cannot read the prompt file: {exc.strerror or exc}", path=path) from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError("the prompt file has no prompt", path=path, fix="write one prompt a line")
    return prompts


def prompt_records(
    result: SampleResult, prompts: Sequence[str], tokenizer: Any, end_id: int | None
) -> list[dict[str, Any]]:
    """One record per sample: its prompt, sample number, seed, generated text and token count, and
    why it stopped (`end`: at its end-of-document token, `length`: after all its tokens)."""

    samples = len(result.token_ids) // len(prompts)
    records = []
    for row, ids in enumerate(result.token_ids):
        generated = ids[result.prompt_tokens[row] :]
        stopped = end_id is not None and bool(generated) and generated[-1] == end_id
        records.append(
            {
                "prompt": prompts[row // samples],
                "sample": row % samples,
                "seed": result.seeds[row],
                "text": tokenizer.decode(generated, skip_special_tokens=False),
                "tokens": result.lengths[row],
                "stop": "end" if stopped else "length",
            }
        )
    return records
