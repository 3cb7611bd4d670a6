"""A pack carries its tokenizer's chat template: whatever loads the tokenizer from the pack (a run whose
`training.tokenizer` is the pack's copy, then `dlm sample --chat`) renders conversations as the pack did."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dlm.data.chat import ChatTemplate, Turn
from dlm.data.chat_pack import pack_chat
from dlm.data.pack import pack_corpus
from dlm.errors import UserError

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
CONFIG = {"chat_template": TEMPLATE, "bos_token": "<s>"}
TURNS = [Turn("system", "brief"), Turn("user", "hi"), Turn("assistant", "hello")]


def tokenizer_with_template(directory: Path, tokenizer: Path) -> Path:
    directory.mkdir(parents=True)
    shutil.copyfile(tokenizer, directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(CONFIG), encoding="utf-8")
    return directory / "tokenizer.json"


def chat_data(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"say {w}", "response": w}) + "\n" for w in ("to", "be", "or")))
    return path


def test_the_packs_tokenizer_renders_with_the_same_template(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    tokenizer = tokenizer_with_template(tmp_path / "tok", tiny_tokenizer_path)
    pack_chat([chat_data(tmp_path / "chat.jsonl")], tokenizer, 32, tmp_path / "pack")
    original = ChatTemplate.for_tokenizer(tokenizer)
    copied = ChatTemplate.for_tokenizer(tmp_path / "pack/tokenizer.json")
    assert copied.name == "tokenizer_config.json chat_template"
    assert copied.split(TURNS) == original.split(TURNS) == ("<s>[system] brief\n[user] hi\n[assistant] ", "hello\n")
    assert json.loads((tmp_path / "pack/train.json").read_text())["chat"]["template"] == copied.name


def test_a_pack_with_a_tokenizer_without_config_drops_the_old_one(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    """Re-packing with a tokenizer that has no config must not leave the previous template beside it."""

    pack_chat(
        [chat_data(tmp_path / "chat.jsonl")],
        tokenizer_with_template(tmp_path / "tok", tiny_tokenizer_path),
        32,
        tmp_path / "pack",
    )
    pack_chat([tmp_path / "chat.jsonl"], tiny_tokenizer_path, 32, tmp_path / "pack", overwrite=True)
    assert not (tmp_path / "pack/tokenizer_config.json").exists()
    assert ChatTemplate.for_tokenizer(tmp_path / "pack/tokenizer.json").name == "default"


def test_a_plain_pack_copies_the_config_too(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    tokenizer = tokenizer_with_template(tmp_path / "tok", tiny_tokenizer_path)
    (tmp_path / "text.txt").write_text("to be or not to be " * 20, encoding="utf-8")
    pack_corpus([tmp_path / "text.txt"], tokenizer, 16, tmp_path / "pack")
    config = (tmp_path / "tok/tokenizer_config.json").read_bytes()
    assert (tmp_path / "pack/tokenizer_config.json").read_bytes() == config


def test_packing_beside_the_tokenizer_keeps_its_config(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    tokenizer = tokenizer_with_template(tmp_path / "tok", tiny_tokenizer_path)
    pack_chat([chat_data(tmp_path / "chat.jsonl")], tokenizer, 32, tmp_path / "tok")
    assert json.loads((tmp_path / "tok/tokenizer_config.json").read_text()) == CONFIG


def test_an_output_holding_another_config_needs_overwrite(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack/tokenizer_config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(UserError, match=r"output already holds tokenizer_config\.json"):
        pack_chat([chat_data(tmp_path / "chat.jsonl")], tiny_tokenizer_path, 32, tmp_path / "pack")
    assert sorted(p.name for p in (tmp_path / "pack").iterdir()) == ["tokenizer_config.json"]
