"""Exporting a chat fine-tuned run: the model card reads the chat pack's metadata (its sources are paths)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CliResult
from helpers import train_tiny_run

from dlm.artifacts.export import export_model
from dlm.data.chat_pack import pack_chat
from dlm.errors import UserError


@pytest.fixture(scope="module")
def chat_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step fine-tune of a 4-step run on a `dlm pack --chat` pack (its sources are plain paths)."""

    root = tmp_path_factory.mktemp("chat-export")
    examples = [{"prompt": f"say {word} {i}", "response": f"{word} {i}"} for i in range(40) for word in ("one", "two")]
    (root / "sft.jsonl").write_text("".join(json.dumps(example) + "\n" for example in examples))
    pack_chat([root / "sft.jsonl"], tiny_data_dir / "tokenizer.json", 64, root / "sft", val_fraction=0.1)
    base = train_tiny_run(tiny_data_dir, root / "base")
    return train_tiny_run(root / "sft", root / "run", f"training.init_from={base}")


def test_a_chat_run_exports_with_its_sources_in_the_card(
    chat_run: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    metadata = json.loads((chat_run.parent / "sft" / "train.json").read_text())
    assert all(isinstance(source, str) for source in metadata["sources"])
    for source, name in ((chat_run, "from-dir"), (chat_run / "latest.pt", "from-latest")):
        result = run_cli("export", source, "--output", tmp_path / name)
        assert result.exit_code == 0, result.stderr
        card = (tmp_path / name / "README.md").read_text()
        examples = metadata["chat"]["examples"]
        assert (
            f"- training: {metadata['num_tokens']:,} tokens in {metadata['num_blocks']:,} blocks of 64, "
            f"{examples:,} chat examples, from `sft.jsonl`" in card
        )
        assert "bytes of text" not in card


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("sources", [3], "a source as 3, not a path"),
        ("sources", [{"bytes": 5}], 'a source as {"bytes": 5}'),
        ("sources", {"path": "a.txt"}, "its sources as no list"),
        ("num_tokens", "many", 'num_tokens as "many"'),
        ("chat", {"examples": True}, "chat.examples as true, not an integer"),
    ],
)
def test_metadata_in_no_shape_a_packer_writes_is_refused(
    chat_run: Path, tmp_path: Path, field: str, value: object, message: str
) -> None:
    meta = chat_run.parent / "sft" / "train.json"
    original = meta.read_text()
    try:
        meta.write_text(json.dumps({**json.loads(original), field: value}))
        with pytest.raises(UserError, match=re.escape(message)) as caught:
            export_model(chat_run, tmp_path / "model")
    finally:
        meta.write_text(original)
    assert str(meta) in str(caught.value) and not (tmp_path / "model").exists()
