"""An export carries the tokenizer's chat_template, so that `dlm sample --chat` on it renders the
prompt in the template the chat data was packed with."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from helpers import train_tiny_run

from dlm.artifacts.export import export_model
from dlm.artifacts.hf_export import export_hf
from dlm.data.chat import chat_prompt
from dlm.data.chat_pack import pack_chat
from dlm.errors import UserError, UserNote

TEMPLATE = (
    "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>> {% endif %}"
)


@pytest.fixture(scope="module")
def templated_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run whose tokenizer file has a tokenizer_config.json with a custom template beside it."""

    root = tmp_path_factory.mktemp("templated")
    (root / "tok").mkdir()
    shutil.copyfile(tiny_data_dir / "tokenizer.json", root / "tok" / "tokenizer.json")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE, "model_max_length": 64}
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps(settings))
    return train_tiny_run(tiny_data_dir, root / "run", f"training.tokenizer={root / 'tok' / 'tokenizer.json'}")


def test_both_formats_carry_the_chat_template(templated_run: Path, tmp_path: Path) -> None:
    expected = "<<user>> hi there\n<<assistant>> "
    assert chat_prompt(templated_run.parent / "tok" / "tokenizer.json", "hi there") == expected
    plain = export_model(templated_run, tmp_path / "plain")
    assert (plain / "tokenizer_config.json").read_bytes() == (
        templated_run.parent / "tok" / "tokenizer_config.json"
    ).read_bytes()
    hf = export_hf(templated_run, tmp_path / "hf")
    settings = json.loads((hf / "tokenizer_config.json").read_text())
    assert settings["chat_template"] == TEMPLATE and settings["tokenizer_class"] == "PreTrainedTokenizerFast"
    back = export_model(hf, tmp_path / "back")  # hf -> plain keeps it too
    for directory in (plain, hf, back, export_hf(plain, tmp_path / "hf-of-plain")):
        assert chat_prompt(directory / "tokenizer.json", "hi there") == expected, directory
    assert (hf / "README.md").read_text().startswith("# hf\n")  # the card's title is the export's name


def test_no_tokenizer_config_means_no_chat_template(tiny_data_dir: Path, tmp_path: Path) -> None:
    run = train_tiny_run(tiny_data_dir, tmp_path / "run")
    assert not (export_model(run, tmp_path / "plain") / "tokenizer_config.json").exists()
    assert "chat_template" not in json.loads((export_hf(run, tmp_path / "hf") / "tokenizer_config.json").read_text())


def test_a_damaged_tokenizer_config_is_refused_not_copied(templated_run: Path, tmp_path: Path) -> None:
    settings = templated_run.parent / "tok" / "tokenizer_config.json"
    original = settings.read_text()
    try:
        settings.write_text('{"chat_template": 3}')
        for export in (export_model, export_hf):
            with pytest.raises(UserError, match="chat_template is a int, not a string"):
                export(templated_run, tmp_path / "out")
    finally:
        settings.write_text(original)
    assert not (tmp_path / "out").exists()


def test_transformers_renders_the_hf_export_s_template(templated_run: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export_hf(templated_run, tmp_path / "hf")))
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi there"}], tokenize=False, add_generation_prompt=True
    )
    expected = "<<user>> hi there\n<<assistant>> "
    assert rendered == chat_prompt(tmp_path / "hf" / "tokenizer.json", "hi there") == expected


def test_a_template_lost_since_packing_is_warned_about(templated_run: Path, tmp_path: Path) -> None:
    examples = [{"prompt": f"say {i}", "response": f"{i}"} for i in range(30)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(example) + "\n" for example in examples))
    pack_chat(
        [tmp_path / "sft.jsonl"],
        templated_run.parent / "tok" / "tokenizer.json",
        64,
        tmp_path / "sft",
        val_fraction=0.1,
    )
    assert json.loads((tmp_path / "sft" / "train.json").read_text())["chat"]["template"] != "default"
    run = train_tiny_run(tmp_path / "sft", tmp_path / "run", f"training.init_from={templated_run}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = export_model(run, tmp_path / "kept")
    assert chat_prompt(kept / "tokenizer.json", "hi") == "<<user>> hi\n<<assistant>> "
    # A pack made before packs copied the tokenizer_config.json beside their tokenizer.json lacks it.
    (tmp_path / "sft" / "tokenizer_config.json").unlink()
    for export in (export_model, export_hf):
        with pytest.warns(UserNote, match=r"packed with a tokenizer_config\.json chat_template, but no "):
            export(run, tmp_path / export.__name__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_model(templated_run, tmp_path / "quiet")  # its data is plain text: nothing to warn about


def test_an_hf_export_whose_special_tokens_change_the_rendering_says_so(tiny_data_dir: Path, tmp_path: Path) -> None:
    # dlm's vocabulary has no <s>: the hf export declares only dlm's own special tokens (transformers
    # would add a declared <s> as token 512, past the embedding), so {{ bos_token }} renders empty there.
    (tmp_path / "tok").mkdir()
    shutil.copyfile(tiny_data_dir / "tokenizer.json", tmp_path / "tok" / "tokenizer.json")
    settings = {"chat_template": "{{ bos_token }}" + TEMPLATE, "bos_token": "<s>"}
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(settings))
    run = train_tiny_run(tiny_data_dir, tmp_path / "run", f"training.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = export_model(run, tmp_path / "plain")  # the same file: the same rendering
    assert chat_prompt(plain / "tokenizer.json", "hi") == "<s><<user>> hi\n<<assistant>> "
    with pytest.warns(UserNote, match=r"renders otherwise with the export's special tokens .*'<s><<user>> hi"):
        hf = export_hf(run, tmp_path / "hf")
    assert chat_prompt(hf / "tokenizer.json", "hi") == "<<user>> hi\n<<assistant>> "
