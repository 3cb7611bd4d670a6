"""`dlm sample --chat`: replies to a question, generated after the model's chat template."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlm.data.chat import chat_prompt, reply
from dlm.data.tokenizer import special_token_id

if TYPE_CHECKING:
    from dlm.model.denoiser import Denoiser


def chat_replies(model: Denoiser, tokenizer: Any, tokenizer_path: Path, question: str, **options: Any) -> list[str]:
    """Each sample's reply to `question`, generated after the templated prompt (which stays fixed;
    the template is read beside `tokenizer_path`) and ended at the first end-of-document token.
    `options` go to `generate`, all of them; `stop_at_end` is always on (a reply ends there either
    way, stopping saves the rest)."""

    from dlm.sampling.generation import generate  # looked up per call: tests count the calls

    prompt = chat_prompt(tokenizer_path, question)
    result = generate(model, tokenizer, prompt=prompt, **(options | {"stop_at_end": True}))
    prompt_length = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
    eos = special_token_id(tokenizer, "eos")
    return [reply(tokenizer, ids, prompt_length, eos) for ids in result.token_ids]
