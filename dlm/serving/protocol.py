"""The OpenAI request format: request bodies, their checks, and the error body every refusal uses.

A request is parsed by pydantic (types, unknown fields), then its sampler fields go through the same
`SamplingOptions` as `dlm sample`, and its prompt through the same prompt checks, so the server
refuses exactly what the command line refuses. Every refusal is an `ApiError`: an HTTP status and
OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, naming the field at fault.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from dlm.data.chat import ChatTemplate, Turn
from dlm.errors import UserError
from dlm.model.denoiser import block_size
from dlm.sampling.options import SamplingOptions
from dlm.sampling.prompt_batch import encode_prompts

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from dlm.config.schema import ModelConfig

MAX_STOP_STRINGS = 4  # OpenAI's limit
# The most steps a request may take: a step that reveals nothing costs no pass, but still the engine's
# time (its random draws), and a request of 10**8 steps would hold the engine for hours.
MIN_STEPS_CAP, STEPS_PER_TOKEN_CAP = 1024, 16


def steps_cap(length: int) -> int:
    """The most steps a request generating `length` tokens may ask for."""

    return max(MIN_STEPS_CAP, STEPS_PER_TOKEN_CAP * length)


def _null_is(default: Any) -> BeforeValidator:
    """A field an OpenAI client sends as null, meaning unset: its default."""

    return BeforeValidator(lambda value: default if value is None else value)


class ApiError(Exception):
    """A refused request: its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class SamplerFields(BaseModel):
    """The fields both endpoints share: OpenAI's, then dlm's sampler options as extra body fields."""

    # Strict, as OpenAI's API: "8" for a number, or 1 for true, is a 400, not quietly converted.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(None, le=2)  # OpenAI's range is [0, 2]; the sampler checks the rest
    top_p: float | None = None
    n: Annotated[int, _null_is(1)] = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: Annotated[bool, _null_is(False)] = False
    stream_options: dict[str, bool | None] | None = None  # {"include_usage": true}
    user: str | None = None  # accepted for compatibility; not used
    # OpenAI fields that clients send with their neutral values: accepted as such, refused (naming the
    # field) where a value asks for what dlm's sampler does not do, never silently ignored.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Of no effect on the text: accepted and not used.
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # dlm's own (`dlm sample`'s options of the same names)
    steps: int | None = None
    block_length: int | None = None
    threshold: float | None = None
    cache: str | None = None
    remasking: str | None = None
    top_k: int | None = None
    reveal_split: str | None = None
    # The seconds this request may take from its arrival to its answer (within the server's --request-timeout).
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)


class CompletionRequest(SamplerFields):
    prompt: str | list[str]
    logprobs: int | bool | None = None  # neutral: None, 0 or false (some clients send chat's false)
    echo: Annotated[bool, _null_is(False)] = False
    best_of: int | None = None  # neutral: None or 1
    suffix: str | None = None


class TextPart(BaseModel):
    """One part of a message's content as current OpenAI clients send it: text only (a client's own keys
    beside it, such as a cache hint, are of no effect here and ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # "developer" is OpenAI's newer name for the system message: rendered as one.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None  # null: an assistant's turn sent back as the SDK holds it
    name: str | None = None  # accepted for compatibility; the template does not render it
    # An assistant message as the SDK returns it (`message.model_dump()`), sent back in the conversation:
    # these fields come along, empty; dlm's models send no refusals, tool calls or audio.
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[Any] | None = None

    @model_validator(mode="after")
    def _text_alone(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its content")
        for name in ("refusal", "tool_calls", "function_call", "audio", "annotations"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported: dlm's models send back text alone")
        return self

    @property
    def text(self) -> str:
        """The content as one text: the parts joined by newlines, as OpenAI-compatible servers do."""

        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class ChatRequest(SamplerFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # neutral: None or false
    top_logprobs: int | None = None  # neutral: None or 0
    response_format: dict[str, Any] | None = None  # neutral: {"type": "text"}
    tools: list[dict[str, Any]] | None = None  # neutral: none
    tool_choice: str | dict[str, Any] | None = None  # neutral: "none" (or "auto" with no tools)
    parallel_tool_calls: bool | None = None  # of no effect without tools


# Each OpenAI field dlm accepts only at its neutral value: (is it neutral?, what to say otherwise).
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "presence_penalty": (lambda v: not v, "dlm's sampler has no repetition penalties; send 0 or leave it out"),
    "frequency_penalty": (lambda v: not v, "dlm's sampler has no repetition penalties; send 0 or leave it out"),
    "logit_bias": (lambda v: not v, "dlm's sampler takes no logit bias; leave it out"),
    "logprobs": (lambda v: not v, "dlm does not return log-probabilities; leave it out"),
    "top_logprobs": (lambda v: not v, "dlm does not return log-probabilities; leave it out"),
    "echo": (lambda v: not v, "dlm does not echo the prompt; leave it out"),
    "best_of": (lambda v: v in (None, 1), "dlm does not rank samples; use n for several"),
    "suffix": (lambda v: v is None, "use the infilling of `dlm sample --template` instead"),
    "response_format": (
        lambda v: v is None or v.get("type") == "text",
        'dlm does not constrain the output to JSON; send {"type": "text"} or leave it out',
    ),
    "tools": (lambda v: not v, "dlm's models do not call tools; leave it out"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "dlm's models do not call tools; leave it out"),
}


def _check_neutral(request: SamplerFields) -> None:
    for name, (neutral, fix) in _NEUTRAL.items():
        value = getattr(request, name, None)
        if not neutral(value):
            raise ApiError(400, f"{name} = {value!r} is not supported: {fix}", param=name)


# Tokens a request without max_tokens gets (at most the room it has): a client that forgets the field
# should not cost a whole context of steps, one per token.
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class Limits:
    """What one request may ask: `max_tokens` (None: the model's context, or a block model's window),
    what it gets without asking (`default_max_tokens`, within that), `n`, the prompt's tokens (None: the
    model's context), the body's bytes, and the seconds it may take from its arrival to its answer
    (`request_timeout`; None: no deadline), and how long one engine round may run before /health calls
    the server stalled (`stall_seconds`)."""

    max_tokens: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_n: int = 8
    max_prompt_tokens: int | None = None
    max_body_bytes: int = 1 << 20
    request_timeout: float | None = None
    stall_seconds: float = 60.0  # /health answers 503 while one engine round has run longer


@dataclass(frozen=True)
class Generation:
    """One checked request, ready for the scheduler: prompts (each with `n` rows), tokens to generate,
    the first prompt's seed (prompt i has seed + i) and the sampler options."""

    prompts: tuple[str, ...]
    prompt_tokens: tuple[int, ...]
    length: int
    n: int
    seed: int
    options: SamplingOptions
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    chat: bool
    timeout: float | None = None  # seconds from arrival to answer: the request's own or the server's, the less

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    @property
    def tokens(self) -> int:
        """What the request costs a batch: every row's prompt and generated positions."""

        return self.n * sum(prompt + self.length for prompt in self.prompt_tokens)


def validation_error(exc: ValidationError) -> ApiError:
    """The most specific problem pydantic found (the deepest; of those the first), as a 400 naming its field
    (`messages.0.role`): for a union, the member that got furthest (`messages.0.content.0.type`)."""

    first = max(exc.errors(), key=lambda error: len(error["loc"]))
    param = ".".join(str(part) for part in first["loc"] if not _UNION_TAG.match(str(part))) or None
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field {param!r}", param=param)
    if first["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first['msg']}")
    return ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)


_FLAG = re.compile(r"--([a-z][a-z-]*)")
# What pydantic adds to a location for the member of a union it tried (`prompt.str`, `stop.list[str]`).
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\])$")


def _options(
    request: SamplerFields, length: int, model_steps: int | None = None, model_remasking: str | None = None
) -> SamplingOptions:
    """The request's sampler options through `SamplingOptions`: its refusal becomes a 400 naming the field.
    Without `steps`: a distilled student's `model_steps`, else one token a step; without `remasking`: its
    `model_remasking`, else ancestral."""

    given = {
        name: getattr(request, name)
        for name in (
            "temperature",
            "top_p",
            "steps",
            "block_length",
            "threshold",
            "cache",
            "remasking",
            "top_k",
            "reveal_split",
        )
    }
    given = {name: value for name, value in given.items() if value is not None}
    given.setdefault("steps", length if model_steps is None else model_steps)
    if given["steps"] > steps_cap(length):
        raise ApiError(
            400, f"steps: at most {steps_cap(length)} for {length} tokens (got {given['steps']})", param="steps"
        )
    if model_remasking is not None:
        given.setdefault("remasking", model_remasking)
    # OpenAI's default: the whole distribution (`dlm sample`'s own default cuts it at 0.9). A request
    # that leaves top_p out is sampled as an OpenAI client expects.
    if request.top_p is None:  # left out, or null as some clients send for "unset"
        given["top_p"] = 1.0
    try:
        return SamplingOptions(**given)
    except UserError as exc:
        raise sampler_error(exc) from None


def sampler_error(exc: UserError) -> ApiError:
    """A refusal of dlm's sampler (worded for `dlm sample`'s options) as a 400 naming the body field."""

    flag = _FLAG.search(str(exc))
    param = flag.group(1).replace("-", "_") if flag else None
    return ApiError(400, _FLAG.sub(lambda match: match.group(1).replace("-", "_"), str(exc)), param=param)


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings (got {len(stops)})", param="stop")
    if any(not text for text in stops):
        raise ApiError(400, "stop: a stop string cannot be empty", param="stop")
    return tuple(stops)


def length_limit(config: ModelConfig, limits: Limits) -> int:
    """The most tokens one request may generate: the configured limit, else the model's context (a block
    model's sliding window, as it generates past it block by block)."""

    return limits.max_tokens if limits.max_tokens is not None else config.max_seq_len


def _length(asked: int | None, param: str, prompt_tokens: int, config: ModelConfig, limits: Limits) -> int:
    limit = length_limit(config, limits)
    room = limit if block_size(config) else min(limit, config.max_seq_len - prompt_tokens)
    if asked is None:
        if room < 1:
            raise ApiError(
                400,
                f"the prompt ({prompt_tokens} tokens) fills the model's context ({config.max_seq_len} tokens)",
                param="prompt",
            )
        return min(room, limits.default_max_tokens)
    if asked < 1:
        raise ApiError(400, f"{param} must be at least 1 (got {asked})", param=param)
    if asked > room:
        where = "" if room == limit else f" with a prompt of {prompt_tokens} tokens"
        raise ApiError(400, f"{param} is {asked}, more than this server allows ({room}{where})", param=param)
    return asked


def _prompt_tokens(
    prompts: list[str], param: str, tokenizer: Tokenizer, config: ModelConfig, limits: Limits
) -> list[int]:
    """The token count of each prompt, within the limits."""

    if not prompts or len(prompts) > limits.max_n:
        raise ApiError(400, f"{param}: give 1 to {limits.max_n} prompts (got {len(prompts)})", param=param)
    for prompt in prompts:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate, which JSON can spell and no tokenizer encodes
            raise ApiError(
                400, f"{param} is not valid UTF-8 text (at character {exc.start + 1})", param=param
            ) from None
    counts = [len(tokenizer.encode(prompt, add_special_tokens=False).ids) for prompt in prompts]
    limit = limits.max_prompt_tokens if limits.max_prompt_tokens is not None else config.max_seq_len
    if max(counts) > limit:
        raise ApiError(400, f"{param} is {max(counts)} tokens, more than this server allows ({limit})", param=param)
    return counts


def _asked_length(request: SamplerFields) -> tuple[int | None, str]:
    """The tokens the request asks for and the field that asks (chat's newer `max_completion_tokens`)."""

    if isinstance(request, ChatRequest) and request.max_tokens is None:
        return request.max_completion_tokens, "max_completion_tokens"
    return request.max_tokens, "max_tokens"


def check_generation(
    request: SamplerFields,
    prompts: list[str],
    *,
    chat: bool,
    served: str,
    config: ModelConfig,
    tokenizer: Tokenizer,
    limits: Limits,
    model_steps: int | None = None,
    model_remasking: str | None = None,
) -> Generation:
    """The request as a `Generation`, or the `ApiError` naming the first field at fault. `model_steps` and
    `model_remasking`: the steps and reveal order a distilled student samples in when the request names none."""

    _check_neutral(request)
    if request.model is not None and request.model != served:
        raise ApiError(
            404,
            f"the model {request.model!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )
    if not 1 <= request.n <= limits.max_n:
        raise ApiError(400, f"n must be in [1, {limits.max_n}] (got {request.n})", param="n")
    if request.seed is not None and not 0 <= request.seed < 2**62:
        raise ApiError(400, f"seed must be in [0, 2**62) (got {request.seed})", param="seed")
    prompt_param = "messages" if chat else "prompt"
    counts = _prompt_tokens(prompts, prompt_param, tokenizer, config, limits)
    asked, param = _asked_length(request)
    length = _length(asked, param, max(counts), config, limits)
    options = _options(request, length, model_steps, model_remasking)
    seed = secrets.randbelow(2**62) if request.seed is None else request.seed
    try:  # the prompt checks of `dlm sample` (the mask token spelt out, invalid text)
        encode_prompts(
            tokenizer,
            config,
            prompts,
            length=length,
            num_samples=request.n,
            seeds=[seed + index for index in range(len(prompts))],
        )
    except UserError as exc:
        raise ApiError(400, str(exc).replace("--prompt", prompt_param), param=prompt_param) from None
    include_usage = bool((request.stream_options or {}).get("include_usage", False))
    return Generation(
        tuple(prompts),
        tuple(counts),
        length,
        request.n,
        seed,
        options,
        _stops(request.stop),
        request.stream,
        include_usage,
        chat,
        _deadline(request.timeout, limits.request_timeout),
    )


def _deadline(asked: float | None, server: float | None) -> float | None:
    """The tighter of the request's own timeout and the server's (None: no deadline)."""

    given = [seconds for seconds in (asked, server) if seconds is not None]
    return min(given) if given else None


def chat_prompt_text(template: ChatTemplate, messages: list[Message]) -> str:
    """The conversation in the model's chat template (that of `dlm pack --chat`), up to the reply."""

    try:
        return template.prompt([Turn(message.template_role, message.text) for message in messages])
    except UserError as exc:
        raise ApiError(400, f"messages: the chat template cannot render them ({exc})", param="messages") from None
