"""A streamed row's text (`dlm.serving.rows.RowStream`): decoded incrementally, in linear work, and the
same text as decoding the whole row at once."""

from __future__ import annotations

from typing import Any

import pytest
import test_sampling
from tokenizers import Tokenizer

from dlm.serving.rows import RowStream

tokenizer = pytest.fixture(scope="module")(test_sampling.tokenizer.__wrapped__)  # the sampler tests' tokenizer
MASK, EOS = 1, 0


class CountingTokenizer:
    """The tokenizer, counting the tokens every decode reads."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids: list[int], **options: Any) -> str:
        self.decoded += len(ids)
        return str(self.tokenizer.decode(ids, **options))


def test_a_long_stream_decodes_each_token_a_bounded_number_of_times(tokenizer: Tokenizer) -> None:
    text = "ROMEO: But soft, what light through yonder window breaks? " * 12
    ids = tokenizer.encode(text).ids
    counting = CountingTokenizer(tokenizer)
    stream = RowStream(counting, MASK, EOS, ())
    sent = ""
    for revealed in range(len(ids) + 1):  # left to right, one position at a time
        sent += stream.update(ids[:revealed] + [MASK] * (len(ids) - revealed))
    whole = tokenizer.decode(ids, skip_special_tokens=False)
    assert sent == whole  # the incremental text is the whole decode, sent in full once all is final
    # Re-decoding the prefix at every step reads ~n^2 / 2 tokens; the incremental decode ~2 per token.
    assert len(ids) > 300 and counting.decoded <= 4 * len(ids), (len(ids), counting.decoded)


def test_blocks_revealed_at_once_and_a_stop_string_in_a_later_block(tokenizer: Tokenizer) -> None:
    text = "To be, or not to be: that is the question. STOP Whether tis nobler"
    ids = tokenizer.encode(text).ids
    stream = RowStream(tokenizer, MASK, EOS, ("STOP",))
    sent = ""
    for revealed in range(0, len(ids) + 4, 4):  # a block of 4 at a time
        revealed = min(revealed, len(ids))
        sent += stream.update(ids[:revealed] + [MASK] * (len(ids) - revealed))
    final = text[: text.index("STOP")]
    assert final.startswith(sent) and sent + stream.finish(final) == final
    assert len(final) - len(sent) <= len("STOP") - 1  # only what could begin the stop string was held
