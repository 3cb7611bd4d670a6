"""The two shapes of OpenAI's answers: text completions and chat completions.

Everything that differs between `/v1/completions` and `/v1/chat/completions` is here, as data and
small methods of one `ResponseShape` each: the request model, how its prompts are read, the ids and
object names of the answer and of its stream's chunks, and how a choice, a piece of streamed text
and a finished choice are written. The handlers in `dlm.serving.app` take a shape and never ask
which one they have.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from dlm.data.chat import ChatTemplate
from dlm.serving.protocol import ChatRequest, CompletionRequest, SamplerFields, chat_prompt_text
from dlm.serving.rows import Choice

Json = dict[str, Any]


class ResponseShape(ABC):
    """One endpoint's request model and answer layout; `CHAT` and `COMPLETION` are the two."""

    request_model: type[SamplerFields]
    id_prefix: str  # of the answer's id
    answer_object: str  # the "object" of a whole answer
    chunk_object: str  # the "object" of a streamed chunk

    @abstractmethod
    def prompts(self, request: SamplerFields, template: ChatTemplate) -> list[str]:
        """The request's prompts, rendered."""

        ...

    def response_id(self, request_id: str) -> str:
        return f"{self.id_prefix}-{request_id}"

    @abstractmethod
    def choice(self, index: int, choice: Choice) -> Json:
        """A whole answer's choice."""

        ...

    def opening(self, index: int) -> Json | None:
        """The chunk that opens a streamed choice, if the shape has one."""

        return None

    @abstractmethod
    def piece(self, index: int, text: str) -> Json:
        """A streamed piece of a choice's text."""

        ...

    @abstractmethod
    def ending(self, index: int, finish_reason: str) -> Json:
        """The streamed chunk that ends a choice."""

        ...


class _Chat(ResponseShape):
    request_model, id_prefix = ChatRequest, "chatcmpl"
    answer_object, chunk_object = "chat.completion", "chat.completion.chunk"

    def prompts(self, request: SamplerFields, template: ChatTemplate) -> list[str]:
        assert isinstance(request, ChatRequest)
        return [chat_prompt_text(template, request.messages)]

    def choice(self, index: int, choice: Choice) -> Json:
        message = {"role": "assistant", "content": choice.text}
        return {"index": index, "message": message, "finish_reason": choice.finish_reason}

    def opening(self, index: int) -> Json | None:  # OpenAI opens each chat choice with its role
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}

    def piece(self, index: int, text: str) -> Json:
        return {"index": index, "delta": {"content": text}, "finish_reason": None}

    def ending(self, index: int, finish_reason: str) -> Json:
        return {"index": index, "delta": {}, "finish_reason": finish_reason}


class _Completion(ResponseShape):
    request_model, id_prefix = CompletionRequest, "cmpl"
    answer_object = chunk_object = "text_completion"

    def prompts(self, request: SamplerFields, template: ChatTemplate) -> list[str]:
        assert isinstance(request, CompletionRequest)
        return [request.prompt] if isinstance(request.prompt, str) else list(request.prompt)

    def choice(self, index: int, choice: Choice) -> Json:
        return {"index": index, "text": choice.text, "finish_reason": choice.finish_reason, "logprobs": None}

    def piece(self, index: int, text: str) -> Json:
        return {"index": index, "text": text, "finish_reason": None, "logprobs": None}

    def ending(self, index: int, finish_reason: str) -> Json:
        return {"index": index, "text": "", "finish_reason": finish_reason, "logprobs": None}


CHAT: ResponseShape = _Chat()
COMPLETION: ResponseShape = _Completion()
