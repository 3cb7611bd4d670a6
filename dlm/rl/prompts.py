"""The prompts of `dlm rl` and `dlm eval --prompts`: JSONL records rendered by the chat template.

Each line is a JSON object with `prompt` (the user's turn) or `messages` (a conversation up to, not
including, the assistant's reply), plus whatever fields its rewards read. The prompt text is what
`dlm pack --chat` puts before a reply for the same tokenizer file (`dlm.data.chat.ChatTemplate`), so
a model fine-tuned with `dlm pack --chat` is asked exactly as it was taught.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.data.chat import ChatTemplate, Turn, parse_example
from dlm.errors import UserError


@dataclass(frozen=True)
class PromptSet:
    """The prompts of one file: their records, their rendered text and token ids."""

    path: Path
    records: list[dict[str, Any]]
    texts: list[str]
    token_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.records)

    @property
    def longest(self) -> int:
        return max(len(ids) for ids in self.token_ids)


def _turns(record: Any, where: str) -> list[Turn]:
    if not isinstance(record, dict):
        raise UserError(
            f"{where} is not a JSON object", fix='write one object per line: {"prompt": ..., "answer": ...}'
        )
    if "messages" in record:
        if not isinstance(record["messages"], list):
            raise UserError(f"{where}: `messages` is not a list", fix='write [{"role": "user", "content": ...}]')
        # parse_example wants the assistant's reply last: give it an empty one and drop it.
        turns = parse_example({"messages": [*record["messages"], {"role": "assistant", "content": ""}]}, where)
        return turns[:-1]
    if not isinstance(record.get("prompt"), str):
        raise UserError(f"{where} has neither a `prompt` string nor `messages`", fix="add one of them")
    return [Turn("user", record["prompt"])]


def read_prompts(path: str | Path, tokenizer: Any, tokenizer_path: str | Path, limit: int | None = None) -> PromptSet:
    """The first `limit` (all) prompts of the JSONL file `path`, rendered and encoded; one error naming
    the line for a record that is not a prompt."""

    path = Path(path)
    template = ChatTemplate.for_tokenizer(tokenizer_path)
    records, texts, ids = [], [], []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"the prompts cannot be read ({exc})", path=path, fix="name a UTF-8 JSONL file") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"line {number} is not JSON ({exc.msg})", path=path, fix="one JSON object per line"
            ) from None
        text = template.prompt(_turns(record, where))
        records.append(record)
        texts.append(text)
        ids.append(tokenizer.encode(text, add_special_tokens=False).ids)
        if limit is not None and len(records) == limit:
            break
    if not records:
        raise UserError("no prompts in this file", path=path, fix='one JSON object per line: {"prompt": ...}')
    return PromptSet(path, records, texts, ids)


def completion_length(prompts: PromptSet, max_seq_len: int, configured: int | None, *, slides: bool) -> int:
    """Tokens to sample per completion: `configured`, or what fills the context after the longest prompt.
    A model that `slides` (a block model) has no context limit to fill."""

    room = max_seq_len - prompts.longest
    if configured is None:
        if room < 1:
            raise UserError(
                f"the longest prompt ({prompts.longest} tokens) leaves no room in max_seq_len {max_seq_len}",
                path=prompts.path,
                fix="shorten the prompts or set rl.completion_length",
            )
        return room
    if configured > room and not slides:
        raise UserError(
            f"rl.completion_length {configured} after the longest prompt ({prompts.longest} tokens) exceeds "
            f"max_seq_len {max_seq_len}",
            path=prompts.path,
            fix=f"set rl.completion_length to at most {max(room, 1)} or shorten the prompts",
        )
    return configured
