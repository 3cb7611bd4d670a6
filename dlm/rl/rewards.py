"""Rewards for `dlm rl` and `dlm eval --reward`: a registry of verifiers, and your own functions.

A reward is a function `reward(completion: str, record: dict, **options) -> float`: `completion` is
the generated reply (up to its end-of-document token), `record` the prompt's JSON object (its
`answer` or any other field), `options` the `[[rl.rewards]]` entry's `options`. Built in:

- `exact_match`: 1.0 when the answer extracted from the completion equals `record[field]` (default
  `answer`) after stripping spaces, else 0.0. The answer is the completion itself, or with
  `pattern` the last match of that regular expression (its first group when it has one).
- `regex`: 1.0 when `pattern` matches anywhere in the completion (`re.search`), else 0.0.
- `length_penalty`: minus the share of the completion's characters beyond `max_chars` (0 when within).

A name of the form `module:function` imports that function when a config names it, and only then.
Every reward is checked before the run writes anything (`check_rewards`), and a reward that raises
or returns something that is not a finite number stops the run with one error naming the prompt.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dlm.config.rl import RewardSpec
from dlm.errors import UserError
from dlm.registry import Registry

Reward = Callable[..., float]
_REWARDS: Registry[Reward] = Registry("reward")


def register_reward(name: str, reward: Reward, replace: bool = False) -> None:
    _REWARDS.add(name, reward, replace=replace)


def reward_names() -> tuple[str, ...]:
    return _REWARDS.names()


def _extracted(completion: str, pattern: str | None) -> str | None:
    if pattern is None:
        return completion.strip()
    matches = list(re.finditer(pattern, completion))
    if not matches:
        return None
    last = matches[-1]
    return (last.group(1) if last.re.groups else last.group(0)).strip()


def exact_match(completion: str, record: dict[str, Any], *, field: str = "answer", pattern: str | None = None) -> float:
    answer = _extracted(completion, pattern)
    return float(answer is not None and answer == str(record[field]).strip())


def regex(completion: str, record: dict[str, Any], *, pattern: str) -> float:
    return float(re.search(pattern, completion) is not None)


def length_penalty(completion: str, record: dict[str, Any], *, max_chars: int) -> float:
    return -max(0, len(completion) - max_chars) / max(len(completion), 1)


register_reward("exact_match", exact_match)
register_reward("regex", regex)
register_reward("length_penalty", length_penalty)

# The record fields a built-in reads, by option: checked on every prompt up front.
_FIELD_OPTIONS = {"exact_match": ("field", "answer")}


@dataclass(frozen=True)
class BoundReward:
    """One configured term: the function, its weight and options, and the name it was configured by."""

    name: str
    function: Reward
    weight: float
    options: dict[str, Any]

    def __call__(self, completion: str, record: dict[str, Any]) -> float:
        return float(self.function(completion, record, **self.options))


def _import(name: str, where: str) -> Reward:
    module_name, _, function_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UserError(
            f"{where}: reward module {module_name!r} cannot be imported ({type(exc).__name__}: {exc})",
            fix="put the module on PYTHONPATH (or in the working directory) and check that it imports",
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise UserError(f"{where}: {module_name} has no function {function_name!r}", fix="name a function it defines")
    return function


def bind_rewards(specs: Sequence[RewardSpec], where: str = "rl.rewards") -> list[BoundReward]:
    """The configured rewards, each resolved (a user's imported) and its options checked against its signature."""

    bound = []
    for index, spec in enumerate(specs):
        place = f"{where}[{index}] ({spec.name})"
        if ":" in spec.name:
            function = _import(spec.name, place)
        else:
            found = _REWARDS.get(spec.name)
            if found is None:
                raise UserError(
                    f"{place}: no reward named {spec.name!r}",
                    fix=f"use one of: {', '.join(reward_names())}, or module:function for your own",
                )
            function = found
        try:
            inspect.signature(function).bind("", {}, **spec.options)
        except TypeError as exc:
            raise UserError(f"{place}: its options do not fit the function ({exc})", fix="see docs/rl.md") from None
        except ValueError:  # a builtin without a signature: checked when first called
            pass
        if "pattern" in spec.options and spec.options["pattern"] is not None:
            try:
                re.compile(spec.options["pattern"])
            except re.error as exc:
                raise UserError(f"{place}: options.pattern is not a regular expression ({exc})", fix="fix it") from None
        bound.append(BoundReward(spec.name, function, spec.weight, dict(spec.options)))
    return bound


def check_records(rewards: Sequence[BoundReward], records: Sequence[dict[str, Any]], source: str) -> None:
    """Refuse prompts that lack a field a built-in reward reads (the first one, by line)."""

    for reward in rewards:
        if reward.name not in _FIELD_OPTIONS:
            continue
        option, default = _FIELD_OPTIONS[reward.name]
        field = reward.options.get(option, default)
        for line, record in enumerate(records, 1):
            if field not in record:
                raise UserError(
                    f"prompt {line} has no {field!r} field, which the {reward.name} reward compares with",
                    path=source,
                    fix=f"add {field!r} to every prompt, or set options.{option} to the field that holds the answer",
                )


def score(rewards: Sequence[BoundReward], completion: str, record: dict[str, Any], where: str) -> list[float]:
    """Each term's value (before its weight) for one completion; one error naming `where` if one fails."""

    values = []
    for reward in rewards:
        try:
            value = reward(completion, record)
        except Exception as exc:
            raise UserError(
                f"the {reward.name} reward raised {type(exc).__name__}: {exc} on {where}",
                fix="make the reward return a number for every completion (0.0 for one it cannot parse)",
            ) from None
        if not isinstance(value, float) or not math.isfinite(value):
            raise UserError(f"the {reward.name} reward returned {value!r} on {where}", fix="return a finite number")
        values.append(value)
    return values
