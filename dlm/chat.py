"""Instruction data: the chat template, and turning one example into token ids plus a loss mask.

An example is a JSON object with `prompt` and `response` strings, or `messages`: a list of
`{"role": ..., "content": ...}` (roles `system`, `user`, `assistant`) whose last turn is the
assistant's. The default template (`DEFAULT_TEMPLATE`) writes each turn as a plain-text marker line
then the text, so that it works with any tokenizer:

    <|user|>
    What is the capital of France?
    <|assistant|>
    Paris.<|endoftext|>

The markers are ordinary text, not special tokens. When a `tokenizer_config.json` beside the
tokenizer file holds a `chat_template` (a Hugging Face Jinja template), that template is used
instead. Either way the prompt is everything before the last assistant turn's text, and only that
text and the end-of-document token after it are learned: `dlm pack --chat`, `dlm sample --chat`
and `dlm eval` on chat data all go through `ChatTemplate`, so they agree token for token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.errors import UserError

ROLES = ("system", "user", "assistant")
DEFAULT_TEMPLATE = {role: f"<|{role}|>\n{{content}}\n" for role in ROLES}  # the reply opens the assistant's
CONFIG_NAME = "tokenizer_config.json"


@dataclass(frozen=True)
class Turn:
    role: str
    content: str


def parse_example(record: Any, where: str) -> list[Turn]:
    """The turns of one JSONL record; `where` (file and line) names a bad one."""

    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        turns = [_turn(message, where) for message in record["messages"]]
    elif isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        turns = [Turn("user", record["prompt"]), Turn("assistant", record["response"])]
    else:
        raise UserError(f"{where}: expected an object with prompt and response strings, or a messages list")
    if not turns or turns[-1].role != "assistant":
        raise UserError(f"{where}: the last message must be the assistant's (the response to learn)")
    return turns


def _turn(message: Any, where: str) -> Turn:
    if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(message.get("content"), str):
        raise UserError(f"{where}: each message needs a role ({', '.join(ROLES)}) and a content string")
    return Turn(message["role"], message["content"])


class ChatTemplate:
    """Renders a conversation as (prompt text, response text); the default or the tokenizer's own."""

    def __init__(self, jinja_source: str | None = None):
        self.jinja_source = jinja_source
        self._jinja: Any = None
        if jinja_source is not None:
            import jinja2  # a dependency of torch, used only for a tokenizer's own template

            environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            self._jinja = environment.from_string(jinja_source)

    @classmethod
    def for_tokenizer(cls, tokenizer_path: str | Path) -> ChatTemplate:
        """The tokenizer's own template when a tokenizer_config.json beside it has one, else the default."""

        config = Path(tokenizer_path).parent / CONFIG_NAME
        if config.is_file():
            template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(template, str):
                return cls(template)
        return cls()

    @property
    def name(self) -> str:
        return "default" if self.jinja_source is None else f"{CONFIG_NAME} chat_template"

    def prompt(self, turns: list[Turn]) -> str:
        """The text before the reply: every turn, then the opening of the assistant's."""

        if self._jinja is not None:
            return str(self._jinja.render(messages=[vars(t) for t in turns], add_generation_prompt=True,
                                          bos_token="", eos_token=""))  # fmt: skip
        opening = DEFAULT_TEMPLATE["assistant"].split("{content}")[0]
        return "".join(DEFAULT_TEMPLATE[t.role].format(content=t.content) for t in turns) + opening

    def split(self, turns: list[Turn]) -> tuple[str, str]:
        """(prompt, response) of a conversation whose last turn is the assistant's reply."""

        prompt = self.prompt(turns[:-1])
        if self._jinja is None:
            return prompt, turns[-1].content
        whole = str(self._jinja.render(messages=[vars(t) for t in turns], add_generation_prompt=False,
                                       bos_token="", eos_token=""))  # fmt: skip
        if not whole.startswith(prompt):
            raise UserError("the tokenizer's chat_template does not render the prompt as a prefix of the conversation")
        return prompt, whole[len(prompt) :]


def encode_example(tokenizer: Any, template: ChatTemplate, turns: list[Turn], eos: int) -> tuple[list[int], int]:
    """(token ids, prompt length): prompt and reply encoded apart, so the boundary is a token boundary,
    then the end-of-document token that ends the reply."""

    prompt, response = template.split(turns)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    response_ids = tokenizer.encode(response, add_special_tokens=False).ids
    return [*prompt_ids, *response_ids, eos], len(prompt_ids)



def chat_prompt(tokenizer_path: str | Path, question: str) -> str:
    """The text `dlm sample --chat` conditions on: a one-turn conversation up to the reply, in the
    template that `dlm pack --chat` used for the same tokenizer file."""

    return ChatTemplate.for_tokenizer(tokenizer_path).prompt([Turn("user", question)])


def reply(tokenizer: Any, ids: list[int], prompt_length: int, eos: int) -> str:
    """The generated reply of one sample: the tokens after the prompt, up to its end-of-document."""

    generated = ids[prompt_length:]
    end = generated.index(eos) if eos in generated else len(generated)
    return str(tokenizer.decode(generated[:end], skip_special_tokens=False))


def chat_replies(model_path: str | Path, question: str, **options: Any) -> list[str]:
    """`dlm sample --chat`: each sample's reply to `question`, generated after the templated prompt
    (which stays fixed) and ended at the first end-of-document token. `options` go to `generate`,
    all of them; `stop_at_end` is always on (a reply ends there either way, stopping saves the rest)."""

    from dlm.loading import load_model_with_info
    from dlm.sampling import generate
    from dlm.tokenizer import special_token_id

    loaded = load_model_with_info(model_path, device=options.get("device") or "cpu")
    prompt = chat_prompt(loaded.info.tokenizer_path, question)
    result = generate(loaded.model, loaded.tokenizer, prompt=prompt, **(options | {"stop_at_end": True}))
    prompt_length = len(loaded.tokenizer.encode(prompt, add_special_tokens=False).ids)
    eos = special_token_id(loaded.tokenizer, "eos")
    return [reply(loaded.tokenizer, ids, prompt_length, eos) for ids in result.token_ids]
