"""`dlm serve` of an imported Hugging Face model: refused while causal, and once adapted (`dlm train
--init-from`, exported) served with its own tokenizer's end token and chat template.

The tokenizer's end token is `<unk>` (id 2) here, not id 0 where dlm's own tokenizer keeps it, so a
server that fell back to dlm's ids would not stop where the model ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import CliResult
from helpers import ROOT

pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[serve-test]')")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install -e '.[serve-test]')")
openai = pytest.importorskip("openai", reason="openai is not installed (pip install -e '.[serve-test]')")
from test_hf_import import _packed, build_hf_model  # noqa: E402 (skips without transformers)
from test_serve import start_in_thread  # noqa: E402

from dlm.artifacts.import_model import import_model  # noqa: E402
from dlm.data.tokenizer import load_tokenizer, special_token_id  # noqa: E402
from dlm.serving.server import Server, ServeSettings, load_served  # noqa: E402

pytestmark = [pytest.mark.serve_extra, pytest.mark.hf_extra]
WAIT = 60.0
END = 2  # `<unk>`, named the end token below


@pytest.fixture(scope="module")
def imported(tiny_tokenizer_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("serve-import") / "qwen2"
    build_hf_model("qwen2", source, tiny_tokenizer_path)
    settings = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    (source / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": "<unk>"}), encoding="utf-8")
    return import_model(source, source.parent / "imported", add_mask_token=True, dtype="float32")


@pytest.fixture(scope="module")
def adapted(imported: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dlm.cli import main

    root = tmp_path_factory.mktemp("serve-adapted")
    data = _packed(imported, root / "data")
    sets = [
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}",
        f"training.output_dir={root / 'run'}",
        "training.max_steps=4",
        "training.warmup_steps=1",
        "training.eval_interval=4",
        "training.save_interval=4",
    ]
    args = [item for value in sets for item in ("--set", value)]
    for command in (
        ["train", "--config", str(ROOT / "configs" / "tiny.toml"), *args, "--init-from", str(imported)],
        ["export", str(root / "run"), "--output", str(root / "export")],
    ):
        with pytest.raises(SystemExit) as finished:
            main([*command, "--json"])
        assert finished.value.code == 0
    return root / "export"


@contextmanager
def serving(model: Path) -> Iterator[openai.OpenAI]:
    served = load_served(model, dtype="float64", name="model")
    # Every position's logits favour the end token: each reply must stop at once, on the imported model's id.
    served.model.register_forward_hook(
        lambda module, args, logits: logits.index_add(
            -1, torch.tensor([END]), torch.full((*logits.shape[:-1], 1), 100.0, dtype=logits.dtype)
        )
    )
    server = Server(served, ServeSettings(port=0))
    thread = start_in_thread(server)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=WAIT)
    try:
        yield client
    finally:
        server.stop()
        thread.join(WAIT)


def test_an_imported_causal_model_is_refused_before_serving(
    imported: Path, run_cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Refused as the model loads, before the server would listen (and, were it not refused, serve forever).
    monkeypatch.setattr(Server, "run", lambda self, **_: pytest.fail("the server started"))
    run_cli("serve", imported, "--port", "0").assert_refused("causal model", "dlm train --init-from MODEL")


def test_an_adapted_import_is_served_with_its_own_end_token_and_chat_template(adapted: Path) -> None:
    tokenizer = load_tokenizer(adapted / "tokenizer.json")
    assert special_token_id(tokenizer, "eos") == END
    with serving(adapted) as client:
        completion = client.completions.create(model="model", prompt="ROMEO:", max_tokens=8, seed=1)
        assert completion.choices[0].finish_reason == "stop" and completion.choices[0].text == ""
        chat = client.chat.completions.create(
            model="model", messages=[{"role": "user", "content": "Who?"}], max_tokens=8, seed=1
        )
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.content == ""
    prompt = tokenizer.encode("[user] Who?\n[assistant] ", add_special_tokens=False).ids  # the source's template
    assert chat.usage is not None and chat.usage.prompt_tokens == len(prompt)
