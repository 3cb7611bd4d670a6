"""The text of a generated row: final once its batch ends, or streamed as its tokens become final.

A row ends at its end-of-document token (which the sampler keeps) or at the first stop string,
whichever comes first.

Streaming: a position the sampler has revealed never changes again, so the tokens of a row before its first
masked position are final, and so is their text, with two exceptions held back until more is known:
the end of a multi-byte character split across tokens (decoded as U+FFFD for now), and the last
characters that could be the start of a stop string. A block model reveals its blocks left to
right, so its text arrives a block at a time; so does semi-autoregressive decoding (`block_length`);
a whole-sequence sampler reveals positions anywhere, so its text arrives as its left end fills.
Whatever was sent is a prefix of the final text (`RowStream.finish` sends the rest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class TextDecoder(Protocol):
    """What the rows use of a tokenizer (a `tokenizers.Tokenizer`)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class Choice:
    text: str
    finish_reason: str  # "stop": end of document or a stop string; "length": all its tokens
    completion_tokens: int


def stop_string_cut(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the first stop string starts in `text` (None: none occurs)."""

    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return min(found) if found else None


def tokens_covering(tokenizer: TextDecoder, ids: list[int], characters: int) -> int:
    """The fewest leading tokens of `ids` whose text holds its first `characters` characters."""

    low, high = 0, len(ids)
    while low < high:
        middle = (low + high) // 2
        if len(tokenizer.decode(ids[:middle], skip_special_tokens=False)) >= characters:
            high = middle
        else:
            low = middle + 1
    return low


def finish_row(tokenizer: TextDecoder, ids: list[int], prompt_tokens: int, eos: int, stops: tuple[str, ...]) -> Choice:
    """The generated text of one row: up to its end-of-document token (kept by the sampler's cut) or
    the first stop string, whichever comes first."""

    generated = ids[prompt_tokens:]
    ended = bool(generated) and generated[-1] == eos
    body = generated[:-1] if ended else generated
    text = str(tokenizer.decode(body, skip_special_tokens=False))
    cut = stop_string_cut(text, stops)
    if cut is not None:
        return Choice(text[:cut], "stop", tokens_covering(tokenizer, body, cut))
    return Choice(text, "stop" if ended else "length", len(generated))


REPLACEMENT = "\ufffd"


class RowStream:
    """What of one row's text has been sent, and what may be sent next.

    The text is decoded incrementally, as the tokens become final: each update decodes the tokens
    made final since the last from the previous decode's start (`prefix` .. `read`), and keeps what
    the longer decode adds, as Hugging Face's streamers do, so that a decoder's treatment of its
    first token (a leading space) cancels out. A decode that ends inside a character (U+FFFD) waits
    for the next token. The work per update is the new tokens and one earlier chunk, not the whole
    prefix: a long stream costs linear time, not quadratic.
    """

    def __init__(self, tokenizer: TextDecoder, mask_id: int, eos: int, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.mask_id, self.eos, self.stops = tokenizer, mask_id, eos, stops
        self.longest_stop = max((len(stop) for stop in stops), default=0)
        self.held_back = max(self.longest_stop, 1) - 1
        self.sent = 0  # characters
        self.text = ""  # the text of the tokens before `read`, whole characters only
        self.prefix = 0  # where the last decode started (tokens)
        self.read = 0  # the tokens whose text is in `text`
        self.stopped = False  # a stop string was found: nothing more is sent before `finish`

    def update(self, generated: list[int]) -> str:
        """The text newly final in `generated` (the row's generated positions, masks where not yet revealed)."""

        if self.stopped:
            return ""
        final = generated.index(self.mask_id) if self.mask_id in generated else len(generated)
        ended = self.eos in generated[:final]
        if ended:
            final = generated.index(self.eos)
        if final <= self.read:
            return ""
        self._decode(generated, final)
        complete = (ended or final == len(generated)) and self.read == final
        bound = len(self.text) if complete else len(self.text) - self.held_back
        if self.stops:  # a new stop string can only end in the new text
            start = max(0, self.sent - self.longest_stop)
            cut = stop_string_cut(self.text[start:], self.stops)
            if cut is not None and start + cut <= bound:
                bound, self.stopped = start + cut, True
        delta = self.text[self.sent : max(bound, self.sent)]
        self.sent = max(bound, self.sent)
        return delta

    def _decode(self, ids: list[int], final: int) -> None:
        """Extend `text` with the tokens up to `final`, unless their text ends inside a character."""

        before = str(self.tokenizer.decode(ids[self.prefix : self.read], skip_special_tokens=False))
        after = str(self.tokenizer.decode(ids[self.prefix : final], skip_special_tokens=False))
        if after.endswith(REPLACEMENT) or len(after) < len(before):
            return
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, final

    def finish(self, text: str) -> str:
        """The rest of the final `text`."""

        return text[self.sent :]
