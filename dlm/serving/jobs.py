"""A served request outside its sampler: its job in the queue, and how its rows become its client's answer.

Whichever way the engine samples a request (`dlm.serving.scheduler` runs `generate` for it in a greenlet;
`dlm.serving.cohort` advances it with the others of its kind as data), its text reaches the client the same
way: `Answer.update` streams each row's text as it becomes final (`dlm.serving.rows.RowStream`), and
`Answer.outcome` turns the finished rows into the choices, sending each stream the rest of its text.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dlm.serving.protocol import Generation
from dlm.serving.rows import Choice, RowStream, finish_row

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TextSink = Callable[[int, str], None]  # (choice index, text)


@dataclass(frozen=True)
class Outcome:
    choices: list[Choice]  # prompt by prompt, `n` each
    prompt_tokens: int
    completion_tokens: int


@dataclass(eq=False)  # a job is itself: the queue finds it by identity
class Job:
    """One request in the queue; `future` gets its `Outcome` or the exception that ended its batch."""

    request_id: str
    generation: Generation
    future: Future[Outcome] = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    on_text: TextSink | None = None  # streaming: each choice's text as it becomes final, then the rest
    cancelled: threading.Event = field(default_factory=threading.Event)  # its client has gone


Finished = tuple[Job, Outcome | BaseException, int, float]  # the job, its outcome, tokens kept, seconds


class Answer:
    """A running job's answer: its rows' streams (when it streams) and, once sampled, its outcome.
    `first_text(seconds)` hears the time from the job's arrival to its first text."""

    def __init__(
        self, job: Job, tokenizer: Tokenizer, mask_id: int, eos: int, first_text: Callable[[float], None]
    ) -> None:
        self.job, self.tokenizer, self.eos = job, tokenizer, eos
        self._first_text, self._silent = first_text, True
        generation = job.generation
        self.streams = (
            []
            if job.on_text is None
            else [RowStream(tokenizer, mask_id, eos, generation.stop) for _ in range(generation.rows)]
        )

    @property
    def streaming(self) -> bool:
        return bool(self.streams)

    def _send(self, row: int, text: str) -> None:
        if self._silent and text:
            self._silent = False
            self._first_text(time.perf_counter() - self.job.enqueued)
        assert self.job.on_text is not None
        self.job.on_text(row, text)

    def update(self, generated: list[list[int]]) -> None:
        """Stream what became final: `generated[row]` holds the row's generated positions, masks where
        not yet revealed."""

        for row, stream in enumerate(self.streams):
            text = stream.update(generated[row])
            if text:
                self._send(row, text)

    def outcome(self, token_ids: list[list[int]], prompt_tokens: list[int]) -> Outcome:
        """The choices of the finished rows (each cut after its end of document, as the sampler cuts it), the
        rest of each stream sent."""

        generation = self.job.generation
        choices = []
        for row in range(generation.rows):
            choice = finish_row(self.tokenizer, token_ids[row], prompt_tokens[row], self.eos, generation.stop)
            if self.streams:
                self._send(row, self.streams[row].finish(choice.text))
            choices.append(choice)
        completion_tokens = sum(choice.completion_tokens for choice in choices)
        return Outcome(choices, sum(generation.prompt_tokens), completion_tokens)
