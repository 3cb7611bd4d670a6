"""`dlm sample --chat`: replies to a question, generated after the model's chat template."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlm.data.chat import chat_prompt, reply
from dlm.data.tokenizer import special_token_id
from dlm.errors import UserError
from dlm.model.denoiser import block_size

if TYPE_CHECKING:
    from dlm.model.denoiser import Denoiser
    from dlm.sampling.options import SampleResult


def chat_sample(
    model: Denoiser, tokenizer: Any, tokenizer_path: Path, question: str, **options: Any
) -> tuple[list[str], SampleResult]:
    """Each sample's reply to `question`, generated after the templated prompt (which stays fixed;
    the template is read beside `tokenizer_path`) and ended at the first end-of-document token, and
    the sampler's whole result (texts with the prompt, counts of passes and tokens). `options` go to
    `generate`, all of them; `stop_at_end` is always on (a reply ends there either way, stopping
    saves the rest)."""

    from dlm.sampling.generation import generate  # looked up per call: tests count the calls

    prompt = chat_prompt(tokenizer_path, question)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    prompt_length = len(prompt_ids)
    _check_prompt(model, prompt_ids, options.get("length", 64))
    result = generate(model, tokenizer, prompt=prompt, **(options | {"stop_at_end": True}))
    eos = special_token_id(tokenizer, "eos")
    return [reply(tokenizer, ids, prompt_length, eos) for ids in result.token_ids], result


def _check_prompt(model: Denoiser, prompt_ids: list[int], length: int) -> None:
    """Refuse, in the words of --chat, a templated question that holds the mask token or leaves no room
    for --length tokens (the sampler's own checks would name --prompt, which the user did not pass)."""

    if model.config.mask_token_id in prompt_ids:
        raise UserError("--chat contains the mask token itself", fix="ask without spelling the mask token")
    prompt_length = len(prompt_ids)
    limit = None if block_size(model.config) else model.config.max_seq_len  # a block model slides on
    if limit is not None and prompt_length + length > limit:
        raise UserError(
            f"--chat ({prompt_length} tokens, the question in the chat template) plus --length "
            f"({length}) is {prompt_length + length} tokens, more than the model's max_seq_len ({limit})",
            fix="shorten the question or lower --length (a block model, [model] block_size, can "
            "generate past its context)",
        )
