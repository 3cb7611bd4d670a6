"""What to generate: prompts, infilling templates and the starting sequence of the sampler.

A request is fixed text and spans to generate: `prompt` then `length` masks, or a template where
`[MASK]` is one token to generate and `[MASK*N]` is N of them, e.g. "ROMEO: [MASK*20] fair Verona".
Everything here works without a model, so a CLI can check its options before loading one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from dlm.errors import UserError

TemplatePart = str | int

# `[MASK]` or `[MASK*...]`; anything after the star is validated so typos fail loudly.
_MASK_SPAN = re.compile(r"\[MASK(\*[^\]]*)?\]")
_TEMPLATE_HELP = "write [MASK] for one token or [MASK*N] for N tokens, e.g. 'ROMEO: [MASK*20] Verona'"


def parse_template(text: str) -> list[TemplatePart]:
    """Split an infilling template into fixed text (str) and mask-span lengths (int)."""

    parts: list[TemplatePart] = []
    position = 0
    for match in _MASK_SPAN.finditer(text):
        if match.start() > position:
            parts.append(text[position : match.start()])
        spec = match.group(1)
        count = 1
        if spec is not None:
            if not re.fullmatch(r"\*\d+", spec):
                raise UserError(f"malformed mask span {match.group(0)!r} in --text", fix=_TEMPLATE_HELP)
            count = int(spec[1:])
            if count < 1:
                raise UserError(f"mask span {match.group(0)!r} in --text asks for no tokens", fix=_TEMPLATE_HELP)
        parts.append(count)
        position = match.end()
    if position < len(text):
        parts.append(text[position:])
    if not any(isinstance(part, int) for part in parts):
        raise UserError("--text has no [MASK] span to generate", fix=_TEMPLATE_HELP)
    return parts


def _encode(tokenizer: Any, text: str, option: str, mask_token_id: int) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False).ids
    if mask_token_id in ids:
        # A literal mask token would stay masked forever: it is not a position we were asked to fill.
        raise UserError(f"{option} contains the mask token itself", fix=_TEMPLATE_HELP)
    return ids


def _check_utf8(option: str, value: str | None) -> None:
    """Undecodable command-line bytes reach Python as lone surrogates, which no tokenizer encodes."""

    try:
        (value or "").encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(
            f"{option} is not valid UTF-8 text (at character {exc.start + 1})", fix="pass the text in UTF-8"
        ) from None


def check_request(
    *, prompt: str = "", text: str | None = None, length: int = 64, num_samples: int = 1, seed: int = 0
) -> list[TemplatePart]:
    """Validate what to generate (all but `SamplingOptions`) and return the sequence layout.

    The layout is fixed text (str) and spans to generate (int): `prompt` then `length` masks, or
    the parsed template `text`. Needs no model, so a CLI can check its options before loading one.
    """

    for option, value in (("--prompt", prompt), ("--text", text)):
        _check_utf8(option, value)
    if num_samples < 1:
        raise UserError(f"--num-samples must be at least 1 (got {num_samples})", fix="pass --num-samples 1")
    if not 0 <= seed < 2**63:
        raise UserError(f"--seed must be in [0, 2**63) (got {seed})")
    if text is not None:
        if prompt:
            raise UserError("--prompt and --text cannot be combined", fix="start the --text template with the prompt")
        return parse_template(text)
    if length < 1:
        raise UserError(f"--length must be at least 1 (got {length})", fix="pass --length 64")
    return [prompt, length] if prompt else [length]


def build_sequence(
    tokenizer: Any, parts: Sequence[TemplatePart], *, templated: bool, mask_token_id: int, max_seq_len: int | None
) -> tuple[list[int], list[bool]]:
    """Token ids of the starting sequence and, per position, whether it is to be generated.

    Each fixed piece of text is tokenized on its own so that it stays exactly as given around the
    generated spans. `templated` says whether `parts` came from --text (for error messages).
    `max_seq_len` None: no limit (a block model slides its context along a longer sequence).
    """

    option = "--text" if templated else "--prompt"
    ids: list[int] = []
    fill: list[bool] = []
    for part in parts:
        if isinstance(part, int):
            ids += [mask_token_id] * part
            fill += [True] * part
        else:
            piece = _encode(tokenizer, part, option, mask_token_id)
            ids += piece
            fill += [False] * len(piece)
    if max_seq_len is not None and len(ids) > max_seq_len:
        if templated:
            problem = f"the --text template is {len(ids)} tokens"
            fix = "shorten the template or its [MASK*N] spans"
        else:
            length = sum(fill)
            problem = f"--prompt ({len(ids) - length} tokens) plus --length ({length}) is {len(ids)} tokens"
            fix = "shorten the prompt or lower --length"
        raise UserError(
            f"{problem}, more than the model's max_seq_len ({max_seq_len})",
            fix=f"{fix} (a block model, [model] block_size, can generate past its context)",
        )
    return ids, fill


def split_masked(tokenizer: Any, ids: Sequence[int], mask_token_id: int) -> list[TemplatePart]:
    """Decoded runs of known tokens (str) and lengths of masked runs (int), for live views."""

    parts: list[TemplatePart] = []
    run: list[int] = []
    masked = 0
    for token in ids:
        if token == mask_token_id:
            if run:
                parts.append(tokenizer.decode(run, skip_special_tokens=False))
                run = []
            masked += 1
        else:
            if masked:
                parts.append(masked)
                masked = 0
            run.append(token)
    if run:
        parts.append(tokenizer.decode(run, skip_special_tokens=False))
    if masked:
        parts.append(masked)
    return parts


def template_fixed_text(text: str) -> str:
    """A template's fixed text: its `[MASK]` spans replaced by a space."""

    return _MASK_SPAN.sub(" ", text)
