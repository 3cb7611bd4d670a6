"""Hostile instruction data and chat templates, class by class, through the CLI.

A chat template comes from a file downloaded with a model: it is rendered in Jinja's sandbox and never
runs code. Every bad input (a template, its config file, a chat file's bytes, an input in a format
without records, an option of the other mode of `dlm pack`) is one `error:` line naming what to
fix, with exit code 2, no traceback, and nothing written. Chat data is read in every format that
holds records.
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CliResult

from dlm.data.chat import ChatTemplate, Turn

SEQ_LEN = 64
CONVERSATION = [
    {"role": "system", "content": "brief"},
    {"role": "user", "content": "hi <b>é</b>"},
    {"role": "assistant", "content": "hello"},
]
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
    result.assert_refused(
        str(tmp_path / "tok" / "tokenizer_config.json"),
        "Jinja's sandbox forbids",
        "move the file away to use dlm's default template",
    )
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
    "truncated JSON": ('{"chat_template": "{% for m in mess', "is not valid JSON (Unterminated string"),
    "not UTF-8": (b'{"chat_template": "\xff"}', "is not UTF-8 text"),
    "not an object": ("[1, 2]", "does not hold a JSON object"),
    "template not a string": ({"chat_template": 7}, "chat_template is a int, not a string"),
    "no default template": ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "none named default"),
    "named entry without a template": ({"chat_template": [{"name": "default"}]}, "entry 0 is not an object with"),
    "entry not an object": ({"chat_template": [{"name": "default", "template": "x"}, "y"]}, "entry 1 is not an"),
    "entry name not a string": ({"chat_template": [{"name": 1, "template": "x"}]}, "entry 0 is not an object"),
    "syntax error": ({"chat_template": "{% for m in messages %}{{ m.content }}"}, "syntax error on its line 1"),
    "undefined name": ({"chat_template": "{{ toolz.name }}"}, "uses an undefined name ('toolz' is undefined"),
    "undefined name printed": ({"chat_template": "{{ undefined_thing }}"}, "'undefined_thing' is undefined"),
    "misspelt eos_token": (
        {"chat_template": "{% for m in messages %}{{ m.content }}{{ eos_tokn }}{% endfor %}"},
        "'eos_tokn' is undefined",
    ),
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
    rendered = chat_template_utils.render_jinja_template(
        [messages], chat_template=HUB_TEMPLATE, bos_token="", eos_token=""
    )
    expected_prompt = chat_template_utils.render_jinja_template(
        [messages[:-1]], chat_template=HUB_TEMPLATE, add_generation_prompt=True, bos_token="", eos_token=""
    )
    assert (prompt, prompt + response) == (expected_prompt[0][0], rendered[0][0])
    assert '"hi <b>\\"é\\"</b>"' in prompt and response == "hello<|im_end|>\n"


def test_templates_see_the_special_tokens_of_their_config_and_can_test_names(tmp_path: Path) -> None:
    source = (
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if unk_token is defined %}[{{ unk_token }}]{% endif %}{% if nothing is defined %}!{% endif %}"
        "{% if tools %}tools{% endif %}{% if documents %}documents{% endif %}"
    )
    config = {"chat_template": source, "bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}}
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    template = ChatTemplate.for_tokenizer(directory / "tokenizer.json")
    assert template.split([Turn("user", "hi"), Turn("assistant", "yo")]) == ("<s>hi</s>", "yo</s>")
    assert template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    # With no special tokens in the config, bos_token and eos_token render as nothing, as before.
    assert ChatTemplate(source).prompt([Turn("user", "hi")]) == "hi"


@pytest.mark.parametrize("spelling", ["same path", "its directory"])
def test_a_chat_file_cannot_be_both_training_and_validation_input(
    spelling: str, tmp_path: Path, tiny_tokenizer_path: Path, run_cli
) -> None:
    chat = write_jsonl(tmp_path / "data" / "sft.jsonl", EXAMPLES)
    val = chat if spelling == "same path" else tmp_path / "data"
    result = pack_chat_cli(run_cli, tiny_tokenizer_path, tmp_path / "out", chat, "--val-input", val)
    result.assert_refused("file is both a training and a validation input", str(chat))
    assert not (tmp_path / "out").exists()


def test_invalid_utf8_in_chat_data_names_the_file_and_line(tmp_path: Path, tiny_tokenizer_path: Path, run_cli) -> None:
    chat = tmp_path / "chat.jsonl"
    good = json.dumps(EXAMPLES[0]).encode() + b"\n"
    chat.write_bytes(good + b"\n" + b'{"prompt": "caf\xe9", "response": "x"}\n')
    result = pack_chat_cli(run_cli, tiny_tokenizer_path, tmp_path / "out", chat)
    offset = len(good) + 1 + len(b'{"prompt": "caf')
    result.assert_refused(str(chat), f"invalid UTF-8 at byte {offset} on line 3", "convert the file to UTF-8")
    assert "--errors" not in result.stderr and not (tmp_path / "out").exists()  # --chat does not take --errors


def test_chat_inputs_are_found_as_dlm_pack_finds_them(tmp_path: Path, tiny_tokenizer_path: Path, run_cli) -> None:
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", EXAMPLES[:2])
    (data / "sub").mkdir()
    (data / "sub" / "b.jsonl.gz").write_bytes(gzip.compress(json.dumps(EXAMPLES[2]).encode() + b"\n"))
    result = pack_chat_cli(run_cli, tiny_tokenizer_path, tmp_path / "out", data, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["splits"]["train"]["examples"] == 3  # the directory, searched recursively
    sources = json.loads((tmp_path / "out" / "train.json").read_text())["sources"]
    assert [Path(source).name for source in sources] == ["a.jsonl", "b.jsonl.gz"]

    (data / "notes.txt").write_text("not instruction data\n")
    for inputs, fragments in (
        ([data], [str(data / "notes.txt"), "dlm pack --chat reads `.jsonl`", "e.g. 'data/*.jsonl'"]),
        ([data / "notes.txt"], [str(data / "notes.txt"), "not this file"]),
        ([tmp_path / "x.csv"], [str(tmp_path / "x.csv"), "not this file"]),
        ([tmp_path / "absent.jsonl"], [str(tmp_path / "absent.jsonl"), "input not found"]),
    ):
        (tmp_path / "x.csv").write_text("a,b\n")
        result = pack_chat_cli(run_cli, tiny_tokenizer_path, tmp_path / "new", *inputs)
        result.assert_refused(*fragments)
        assert "cannot write" not in result.stderr and not (tmp_path / "new").exists()  # it once said: a full disk
    pack_chat_cli(run_cli, tiny_tokenizer_path, tmp_path / "new").assert_refused("no inputs given", "examples")


def write_formats(directory: Path, records: list[dict[str, Any]]) -> dict[str, Path]:
    """The same examples as JSONL and in each other format that holds records."""

    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    zstandard = pytest.importorskip("zstandard")
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    jsonl = write_jsonl(directory / "chat.jsonl", records)
    (directory / "chat.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl.read_bytes()))
    table = pyarrow.Table.from_pylist(records)
    parquet.write_table(table, directory / "chat.parquet", row_group_size=3)
    datasets.Dataset(table).save_to_disk(str(directory / "saved"), num_shards=2)
    return {
        "jsonl.zst": directory / "chat.jsonl.zst",
        "parquet": directory / "chat.parquet",
        "saved dataset": directory / "saved",
        "jsonl": jsonl,
    }


@pytest.mark.data_extras
@pytest.mark.parametrize("shape", ["prompt/response", "messages"])
def test_chat_packs_every_format_with_records_to_the_same_blocks(
    shape: str, tmp_path: Path, tiny_tokenizer_path: Path, run_cli
) -> None:
    if shape == "messages":  # one shape per table: a column holds one type
        records: list[dict[str, Any]] = [
            {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
            for i in range(12)
        ]
    else:
        records = [{"prompt": f"say {i}", "response": f"{i} {i}"} for i in range(12)]
    records = [{**r, "id": i} for i, r in enumerate(records)]  # another field: never read, never in the split's draw
    inputs = write_formats(tmp_path / "in", records)
    outputs = {}
    for kind, path in inputs.items():
        result = pack_chat_cli(run_cli, tiny_tokenizer_path, tmp_path / kind, path, "--val-fraction", "0.3", "--json")
        assert result.exit_code == 0, result.stderr
        outputs[kind] = {
            name: (tmp_path / kind / name).read_bytes()
            for name in ("train.bin", "train.mask.bin", "val.bin", "val.mask.bin")
        }
    assert all(files == outputs["jsonl"] for files in outputs.values())


@pytest.mark.data_extras
def test_bad_rows_and_tables_of_chat_data_are_named(tmp_path: Path, tiny_tokenizer_path: Path, run_cli) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    no_columns, null_row = tmp_path / "text.parquet", tmp_path / "null.parquet"
    parquet.write_table(pyarrow.table({"text": ["a"]}), no_columns)
    parquet.write_table(pyarrow.table({"prompt": ["q", "q"], "response": ["a", None]}), null_row)
    pack_chat_cli(run_cli, tiny_tokenizer_path, tmp_path / "out", no_columns).assert_refused(
        str(no_columns), "has none of the columns prompt, response, messages (its columns: text)"
    )
    pack_chat_cli(run_cli, tiny_tokenizer_path, tmp_path / "out", null_row).assert_refused(
        f"{null_row}: row 1 (0-based): expected an object with prompt and response strings"
    )
    assert not (tmp_path / "out").exists()


MODE_OPTIONS = {
    "--long without --chat": ([], ["--long", "truncate"], ["--long does not apply to a plain pack", "pass --chat"]),
    "--long drop without --chat": ([], ["--long", "drop"], ["--long does not apply to a plain pack"]),
    "--mask-padding": (["--chat"], ["--mask-padding"], ["--mask-padding was removed", "drop it"]),
    "--mask-padding without --chat": ([], ["--mask-padding"], ["--mask-padding was removed"]),
    "--source with --chat": (["--chat"], ["--source", "SELF:2"], ["--source does not apply to --chat"]),
    "--text-field with --chat": (["--chat"], ["--text-field", "body"], ["--text-field does not apply to --chat"]),
    "--errors with --chat": (["--chat"], ["--errors", "replace"], ["--errors does not apply to --chat"]),
    "two at once": (["--chat"], ["--errors", "strict", "--text-field", "text"], ["--text-field, --errors do not"]),
}


@pytest.mark.parametrize("case", list(MODE_OPTIONS))
def test_an_option_of_the_other_mode_is_refused_not_ignored(
    case: str, tmp_path: Path, tiny_tokenizer_path: Path, run_cli
) -> None:
    mode, extra, fragments = MODE_OPTIONS[case]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{**record, "text": "plain"} for record in EXAMPLES])
    extra = [f"{chat}:2" if item == "SELF:2" else item for item in extra]
    result = run_cli("pack", *mode, chat, *extra, "-t", tiny_tokenizer_path, "-l", "8", "-o", tmp_path / "out")
    result.assert_refused(*fragments)
    assert not (tmp_path / "out").exists()
