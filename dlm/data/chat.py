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
FIELDS = ("prompt", "response", "messages")  # what an example is read for: other fields are never read
DEFAULT_TEMPLATE = {role: f"<|{role}|>\n{{content}}\n" for role in ROLES}  # the reply opens the assistant's
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"


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


# What a template may be told to fix, whatever went wrong in it.
TEMPLATE_FIX = "correct the chat_template, or move the file away to use dlm's default template"
MIN_JINJA = (3, 1, 6)  # older versions have known sandbox escapes (transformers requires it too)


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_config(config: Path) -> dict[str, Any]:
    """The settings of a tokenizer_config.json; one `UserError` naming it when it cannot be read."""

    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read it: {exc.strerror or exc}", path=config) from None
    except UnicodeDecodeError:
        raise UserError("is not UTF-8 text", path=config, fix=TEMPLATE_FIX) from None
    except ValueError as exc:  # json.JSONDecodeError
        raise UserError(f"is not valid JSON ({exc})", path=config, fix=TEMPLATE_FIX) from None
    except RecursionError:
        raise UserError("is not valid JSON (nested too deeply)", path=config, fix=TEMPLATE_FIX) from None
    if not isinstance(settings, dict):
        raise UserError("does not hold a JSON object", path=config, fix=TEMPLATE_FIX)
    return settings


def read_chat_template(config: Path) -> str | None:
    """The `chat_template` of a tokenizer_config.json, or None when it has none.

    Hugging Face also writes a list of named templates; as in transformers, the one named "default"
    is the chat template."""

    return chat_template_of(read_config(config), config)


def chat_template_of(settings: dict[str, Any], config: Path) -> str | None:
    template = settings.get("chat_template")
    if isinstance(template, list):
        for index, entry in enumerate(template):  # transformers fails on such an entry too: never skip it
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise UserError(
                    f"chat_template entry {index} is not an object with name and template strings",
                    path=config,
                    fix=TEMPLATE_FIX,
                )
        named = {entry["name"]: entry["template"] for entry in template}
        if "default" not in named:
            names = ", ".join(str(name) for name in named) or "none"
            raise UserError(
                f"chat_template lists templates ({names}) but none named default", path=config, fix=TEMPLATE_FIX
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise UserError(f"chat_template is a {type(template).__name__}, not a string", path=config, fix=TEMPLATE_FIX)
    return template


def special_tokens_of(settings: dict[str, Any]) -> dict[str, str]:
    """The special tokens a tokenizer_config.json names, as the template variables transformers passes
    (`bos_token`, `eos_token`, ...): a token is a string or an added-token object with `content`."""

    found: dict[str, str] = {}
    for name in SPECIAL_TOKENS:
        value = settings.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def _raise_exception(message: str) -> None:
    """`raise_exception(...)`, which Hugging Face templates call to refuse a conversation."""

    # lazy (jinja2, here and below): only a tokenizer_config.json's chat_template needs it, and jinja2 (a
    # dependency of torch, not one of dlm's own) would add ~15 ms to every `dlm pack`'s start
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' `tojson`: Jinja's own escapes HTML characters, which would change the prompt."""

    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _sandbox() -> Any:
    """Jinja's immutable sandbox with the extras Hugging Face templates use, set up as transformers
    does: `raise_exception`, `tojson`, loop controls, the `generation` block (rendered as its body),
    and `dict` and `namespace` that refuse underscore names. `strftime_now` is left out: a pack must
    not depend on the day it runs."""

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    version = tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit())
    if version < MIN_JINJA:
        raise UserError(
            f"rendering a tokenizer's chat_template safely needs jinja2 >= 3.1.6, not {jinja2.__version__}",
            fix="pip install -U jinja2",
        )
    # StrictUndefined: a name dlm does not pass stops the command instead of rendering as nothing
    # (`is defined` still tests a name).
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
        extensions=[_generation_extension(), loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, dict=_TemplateDict(), namespace=_namespace_class())
    return environment


def _generation_extension() -> Any:
    import jinja2
    from jinja2.ext import Extension

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text for transformers' masks;
        dlm finds the reply by rendering, so the block is its body."""

        tags = {"generation"}  # noqa: RUF012 - the type Jinja declares

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return Generation


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without the type itself, as transformers gives templates."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _namespace_class() -> type:
    """Jinja's `namespace`, refusing underscore-prefixed names (which reach CPython internals)."""

    import jinja2

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore name {name!r}")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature, so namespace(self=...) works
            self, attributes = args[0], dict(*args[1:], **kwargs)
            for name in attributes:
                check(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def compile_template(source: str, origin: Path | None) -> Any:
    """A sandboxed Jinja template; a syntax error is one `UserError`."""

    import jinja2

    try:
        return _sandbox().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(
            f"chat_template has a syntax error on its line {exc.lineno}: {_one_line(exc)}",
            path=origin,
            fix=TEMPLATE_FIX,
        ) from None


def render_template(template: Any, origin: Path | None, **context: Any) -> str:
    """Render in the sandbox. Whatever fails inside is the template's doing, so every failure is one
    `UserError`: an attribute the sandbox refuses, an undefined name, `raise_exception`, or any other
    error its expressions raise."""

    import jinja2

    try:
        return str(template.render(**context))
    except jinja2.exceptions.SecurityError as exc:
        what = f"does something Jinja's sandbox forbids ({_one_line(exc)})"
    except jinja2.UndefinedError as exc:
        passed = ", ".join(sorted(context))
        what = f"uses an undefined name ({_one_line(exc)}; dlm passes {passed})"
    except jinja2.TemplateError as exc:
        what = f"raised an error: {_one_line(exc)}"
    except Exception as exc:  # the template's own expressions failed (1 + 'a'), not dlm
        what = f"failed: {type(exc).__name__}: {_one_line(exc)}"
    raise UserError(f"chat_template {what}", path=origin, fix=TEMPLATE_FIX)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


class ChatTemplate:
    """Renders a conversation as (prompt text, response text); the default or the tokenizer's own.

    A tokenizer's template comes from a file downloaded with a model: it is untrusted code, rendered
    in Jinja's sandbox. A template that fails to compile or to render is one
    `UserError` naming `origin`, the file it came from."""

    def __init__(
        self,
        jinja_source: str | None = None,
        origin: str | Path | None = None,
        special_tokens: dict[str, str] | None = None,
    ):
        self.jinja_source = jinja_source
        self.origin = None if origin is None else Path(origin)
        # bos_token and eos_token are always passed (empty when the config names none), as before.
        self.special_tokens = {"bos_token": "", "eos_token": "", **(special_tokens or {})}
        self._jinja: Any = None
        if jinja_source is not None:
            self._jinja = compile_template(jinja_source, self.origin)

    @classmethod
    def for_tokenizer(cls, tokenizer_path: str | Path) -> ChatTemplate:
        """The tokenizer's own template when a tokenizer_config.json beside it has one, else the default."""

        config = Path(tokenizer_path).parent / TOKENIZER_CONFIG_NAME
        if not config.is_file():
            return cls()
        settings = read_config(config)
        template = chat_template_of(settings, config)
        return cls() if template is None else cls(template, config, special_tokens_of(settings))

    @property
    def name(self) -> str:
        return "default" if self.jinja_source is None else f"{TOKENIZER_CONFIG_NAME} chat_template"

    def _render(self, turns: list[Turn], add_generation_prompt: bool) -> str:
        # What transformers passes: the conversation, no tools or documents, and the config's special tokens.
        return render_template(
            self._jinja,
            self.origin,
            messages=[vars(t) for t in turns],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )

    def prompt(self, turns: list[Turn]) -> str:
        """The text before the reply: every turn, then the opening of the assistant's."""

        if self._jinja is not None:
            return self._render(turns, add_generation_prompt=True)
        opening = DEFAULT_TEMPLATE["assistant"].split("{content}")[0]
        return "".join(DEFAULT_TEMPLATE[t.role].format(content=t.content) for t in turns) + opening

    def split(self, turns: list[Turn]) -> tuple[str, str]:
        """(prompt, response) of a conversation whose last turn is the assistant's reply."""

        prompt = self.prompt(turns[:-1])
        if self._jinja is None:
            return prompt, turns[-1].content
        whole = self._render(turns, add_generation_prompt=False)
        if not whole.startswith(prompt):
            raise UserError(
                "chat_template does not render the prompt as a prefix of the conversation",
                path=self.origin,
                fix="use a template whose generation prompt opens the assistant's "
                "turn, or remove chat_template to use dlm's default",
            )
        return prompt, whole[len(prompt) :]

    def check(self) -> None:
        """Render a one-turn conversation, so that a broken template stops a command before it writes."""

        self.split([Turn("user", "?"), Turn("assistant", "!")])


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
