"""Hostile chat templates, through the CLI.

A chat template comes from a file downloaded with a model: it is rendered in Jinja's sandbox and never
runs code. A template that the sandbox stops, that does not compile or that fails is one `error:`
line naming its file, with exit code 2, no traceback, and nothing written.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CliResult

from dlm.chat import ChatTemplate, Turn

SEQ_LEN = 64
CONVERSATION = [{"role": "system", "content": "brief"}, {"role": "user", "content": "hi <b>é</b>"},
                {"role": "assistant", "content": "hello"}]  # fmt: skip
EXAMPLES = [
    {"prompt": "say to", "response": "to to"},
    {"messages": CONVERSATION},
    {"prompt": "say be", "response": "be be"},
    {"prompt": "say or", "response": "or or"},
]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def tokenizer_with_config(directory: Path, tokenizer: Path, config: str | bytes | dict[str, Any]) -> Path:
    """A copy of `tokenizer` with a tokenizer_config.json beside it (a dict is written as JSON)."""

    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer, directory / "tokenizer.json")
    data = json.dumps(config) if isinstance(config, dict) else config
    (directory / "tokenizer_config.json").write_bytes(data if isinstance(data, bytes) else data.encode())
    return directory / "tokenizer.json"


def pack_chat_cli(run_cli: Callable[..., CliResult], tokenizer: Path, output: Path, *args: str | Path) -> CliResult:
    return run_cli("pack", "--chat", *args, "-t", tokenizer, "-l", str(SEQ_LEN), "-o", output)


def escapes(marker: Path) -> dict[str, str]:
    """Templates that would create `marker` (or reach the interpreter) outside a sandbox."""

    command = f"touch {marker}"
    return {
        "cycler globals": f"{{{{ cycler.__init__.__globals__.os.system('{command}') }}}}",
        "lipsum globals": f"{{{{ lipsum.__globals__['os'].popen('{command}').read() }}}}",
        "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "namespace": "{% set ns = namespace(__class__=1) %}{{ ns }}",
    }


@pytest.mark.parametrize("name", ["cycler globals", "lipsum globals", "subclasses", "namespace"])
def test_a_chat_template_never_runs_code(name: str, tmp_path: Path, tiny_tokenizer_path: Path, run_cli) -> None:
    marker = tmp_path / "created-by-the-template"
    template = escapes(marker)[name]
    tokenizer = tokenizer_with_config(tmp_path / "tok", tiny_tokenizer_path, {"chat_template": template})
    chat = write_jsonl(tmp_path / "chat.jsonl", EXAMPLES)
    result = pack_chat_cli(run_cli, tokenizer, tmp_path / "out", chat)
    result.assert_refused(str(tmp_path / "tok" / "tokenizer_config.json"), "Jinja's sandbox forbids",
                          "move the file away to use dlm's default template")  # fmt: skip
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_sample_chat_renders_in_the_sandbox_too(tmp_path: Path, tiny_data_dir: Path, run_cli) -> None:
    from helpers import train_tiny_run

    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    run = train_tiny_run(data, tmp_path / "run")
    marker = tmp_path / "created-by-the-template"
    (data / "tokenizer_config.json").write_text(json.dumps({"chat_template": escapes(marker)["cycler globals"]}))
    result = run_cli("sample", run / "latest.pt", "--chat", "hi", "--length", "4", "--num-samples", "1")
    result.assert_refused(str(data / "tokenizer_config.json"), "Jinja's sandbox forbids")
    assert not marker.exists()


BROKEN_CONFIGS: dict[str, tuple[str | bytes | dict[str, Any], str]] = {
    "syntax error": ({"chat_template": "{% for m in messages %}{{ m.content }}"}, "syntax error on its line 1"),
    "undefined name": ({"chat_template": "{{ tools.name }}"}, "uses an undefined name ('tools' is undefined"),
    "raise_exception": ({"chat_template": "{{ raise_exception('no tools') }}"}, "raised an error: no tools"),
    "error in an expression": ({"chat_template": "{{ messages[0].content + 1 }}"}, "failed: TypeError"),
    "prompt not a prefix": ({"chat_template": "{{ messages | length }}"}, "does not render the prompt as a prefix"),
}


@pytest.mark.parametrize("case", list(BROKEN_CONFIGS))
def test_a_broken_template_or_config_is_one_error_line(
    case: str, tmp_path: Path, tiny_tokenizer_path: Path, run_cli
) -> None:
    config, fragment = BROKEN_CONFIGS[case]
    tokenizer = tokenizer_with_config(tmp_path / "tok", tiny_tokenizer_path, config)
    result = pack_chat_cli(run_cli, tokenizer, tmp_path / "out", write_jsonl(tmp_path / "chat.jsonl", EXAMPLES))
    result.assert_refused(str(tmp_path / "tok" / "tokenizer_config.json"), fragment)
    assert not (tmp_path / "out").exists()


# A ChatML template as models publish them: raise_exception in a branch, a loop control, tojson, and the
# `generation` block that transformers uses for assistant masks.
HUB_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role') }}{% endif %}{% if message['content'] == '' %}{% continue %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] | tojson }}"
    "{{ '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_hub_templates_render_as_transformers_renders_them(tmp_path: Path) -> None:
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    turns = [Turn("system", "brief"), Turn("user", 'hi <b>"é"</b>'), Turn("assistant", "hello")]
    prompt, response = ChatTemplate(HUB_TEMPLATE, tmp_path / "tokenizer_config.json").split(turns)
    messages = [vars(turn) for turn in turns]
    rendered = chat_template_utils.render_jinja_template([messages], chat_template=HUB_TEMPLATE, bos_token="",
                                                         eos_token="")  # fmt: skip
    expected_prompt = chat_template_utils.render_jinja_template([messages[:-1]], chat_template=HUB_TEMPLATE,
                                                                add_generation_prompt=True, bos_token="",
                                                                eos_token="")  # fmt: skip
    assert (prompt, prompt + response) == (expected_prompt[0][0], rendered[0][0])
    assert '"hi <b>\\"é\\"</b>"' in prompt and response == "hello<|im_end|>\n"
