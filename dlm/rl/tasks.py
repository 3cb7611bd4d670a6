"""Bundled verifiable tasks (`dlm task NAME`): data a few-million-parameter model can learn on a laptop.

A task writes everything a supervised-then-RL walk-through needs into one directory:

- `sft.jsonl`: prompt/response examples for `dlm pack --chat`;
- `prompts.jsonl`: RL prompts with the field their reward checks (`answer`), none of them in `sft.jsonl`;
- `heldout.jsonl`: evaluation prompts, disjoint from both;
- `tokenizer_config.json`: a compact chat template (`347+85=` then the reply), read by `dlm pack --chat`,
  `dlm rl` and `dlm eval` alike once `dlm tokenizer train --output DIR/tokenizer.json` puts the
  tokenizer beside it.

Problems are drawn from a generator seeded by `seed`, so the same call writes the same files.

`noise` makes the demonstrations of mixed quality, as collected data often is: that share of the
`sft.jsonl` responses is a plausible wrong answer (one digit off, as a dropped carry is). Imitation
then learns the mistakes with the answers; a reward that checks the answer does not. The RL and
held-out answers stay right, and the problems are the same as without noise.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dlm.data.chat import TOKENIZER_CONFIG_NAME
from dlm.errors import UserError
from dlm.fileio import atomic_path

# The user's text then `=`; the reply follows. Rendered in Jinja's sandbox like any model's template.
COMPACT_TEMPLATE = (
    "{% for message in messages %}{% if message.role == 'user' %}{{ message.content }}={% else %}"
    "{{ message.content }}{% endif %}{% endfor %}"
)
TASK_FILES = ("sft.jsonl", "prompts.jsonl", "heldout.jsonl", TOKENIZER_CONFIG_NAME)


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


@dataclass(frozen=True)
class TaskSummary:
    output: Path
    counts: dict[str, int]  # problems per file
    wrong_responses: int = 0  # sft.jsonl responses made wrong (`noise`)


def addition_problems(digits: int, rng: random.Random) -> Iterator[Problem]:
    """Endless distinct `a+b` problems with operands of 1 to `digits` digits (each length equally likely)."""

    seen: set[tuple[int, int]] = set()
    space = (10**digits) ** 2
    while len(seen) < space:
        a, b = (_operand(rng.randrange(digits) + 1, rng) for _ in range(2))
        if (a, b) in seen:
            continue
        seen.add((a, b))
        yield Problem(f"{a}+{b}", str(a + b))


def _operand(length: int, rng: random.Random) -> int:
    """A number of exactly `length` digits (0 to 9 for one digit)."""

    return rng.randrange(0 if length == 1 else 10 ** (length - 1), 10**length)


def wrong_answer(answer: str, rng: random.Random) -> str:
    """`answer` (a non-negative integer) with one digit moved up or down by one: never the answer itself,
    never negative."""

    value, place = int(answer), 10 ** rng.randrange(len(answer))
    step = place if rng.random() < 0.5 or value < place else -place
    return str(value + step)


TASKS: dict[str, Callable[[int, random.Random], Iterator[Problem]]] = {"addition": addition_problems}


def write_task(
    name: str,
    output: str | Path,
    *,
    sft: int = 3_000,
    prompts: int = 5_500,
    heldout: int = 500,
    digits: int = 2,
    seed: int = 0,
    noise: float = 0.0,
    overwrite: bool = False,
) -> TaskSummary:
    """Write task `name`'s files (`TASK_FILES`) into `output`: `sft` supervised examples, `prompts` RL
    prompts and `heldout` evaluation prompts, all distinct problems; `noise` of the supervised responses
    wrong (module docstring)."""

    if name not in TASKS:
        raise UserError(f"no task named {name!r}", fix=f"choose one of: {', '.join(sorted(TASKS))}")
    if digits < 1 or digits > 6:
        raise UserError(f"--digits must be between 1 and 6 (got {digits})", fix="for example --digits 3")
    if not 0.0 <= noise < 1.0:
        raise UserError(f"--noise must be at least 0 and below 1 (got {noise})", fix="for example --noise 0.3")
    counts = {"sft.jsonl": sft, "prompts.jsonl": prompts, "heldout.jsonl": heldout}
    if min(counts.values()) < 1:
        raise UserError("every split needs at least one problem", fix="pass positive --sft, --prompts, --heldout")
    if sum(counts.values()) > (10**digits) ** 2 * 9 // 10:  # the last distinct problems take long to draw
        raise UserError(
            f"{sum(counts.values())} distinct problems do not fit in {digits}-digit addition",
            fix="ask for fewer problems or more --digits",
        )
    output = Path(output)
    existing = [file for file in TASK_FILES if (output / file).exists()]
    if existing and not overwrite:
        raise UserError(f"{existing[0]} already exists here", path=output, fix="pass --overwrite or another --output")
    output.mkdir(parents=True, exist_ok=True)
    problems = TASKS[name](digits, random.Random(seed))
    mistakes, wrong = random.Random(f"{seed}-noise"), 0  # apart from the problems' generator
    for file, count in counts.items():
        with atomic_path(output / file) as temporary, temporary.open("w", encoding="utf-8") as handle:
            for _ in range(count):
                problem = next(problems)
                if file == "sft.jsonl":
                    response = problem.answer
                    if noise and mistakes.random() < noise:
                        response, wrong = wrong_answer(problem.answer, mistakes), wrong + 1
                    record = {"prompt": problem.prompt, "response": response}
                else:
                    record = {"prompt": problem.prompt, "answer": problem.answer}
                handle.write(json.dumps(record) + "\n")
    with atomic_path(output / TOKENIZER_CONFIG_NAME) as temporary:
        settings = {"chat_template": COMPACT_TEMPLATE, "eos_token": "<|endoftext|>"}
        temporary.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    return TaskSummary(output, counts, wrong)
