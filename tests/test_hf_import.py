"""`dlm import` of causal LMs built with transformers' own classes (the `hf` extra; skipped without it).

Each tiny random Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms, its own head width) and Mistral model,
with grouped-query attention, is saved sharded by `save_pretrained`; imported, it gives
`AutoModelForCausalLM`'s logits in causal mode, then trains 20 steps as a diffusion model
(`dlm train --init-from`, which takes the shape from it), exports and samples.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_SEQ_LEN, CliResult, tiny_train_files, tiny_val_files
from helpers import ROOT

import dlm
from dlm.artifacts.checkpoint import load_checkpoint
from dlm.artifacts.export_layout import read_export_config
from dlm.artifacts.import_model import import_model
from dlm.data.chat import ChatTemplate, Turn
from dlm.data.pack import pack_corpus
from dlm.data.tokenizer import load_tokenizer, never_sampled_ids, special_token_id
from dlm.errors import UserError, UserNote

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf_extra

VOCAB = 512
TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.1's frequency scaling, an untied head; within a short context its low band is divided.
    "llama": (
        "Llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "qwen2": ("Qwen2", {"tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen3": ("Qwen3", {"head_dim": 16, "rms_norm_eps": 1e-5}),
    "mistral": ("Mistral", {"sliding_window": None, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
}


def hf_style_tokenizer(dlm_tokenizer: Path, directory: Path) -> None:
    """dlm's tiny byte-level BPE renamed as a causal LM's: </s> <s> <unk> at ids 0-2 and no mask token."""

    data = json.loads(dlm_tokenizer.read_text(encoding="utf-8"))
    names = {"<|endoftext|>": "</s>", "<|mask|>": "<s>", "<|pad|>": "<unk>"}
    for token in data["added_tokens"]:
        token["content"] = names[token["content"]]
    data["model"]["vocab"] = {names.get(k, k): v for k, v in data["model"]["vocab"].items()}
    (directory / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    settings = {"eos_token": "</s>", "bos_token": "<s>", "chat_template": TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")


def build_hf_model(family: str, directory: Path, tokenizer: Path, **shape: Any) -> torch.nn.Module:
    prefix, extra = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**{**SHAPE, **shape}, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():  # away from the init's zeros and ones, so biases and norms all count
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2) if parameter.dim() > 1 else parameter.uniform_(-0.5, 1.5)
    model.save_pretrained(directory, max_shard_size="40KB")
    hf_style_tokenizer(tokenizer, directory)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(
    request: pytest.FixtureRequest, tiny_tokenizer_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path, torch.nn.Module]:
    family = str(request.param)
    source = tmp_path_factory.mktemp(f"hf-{family}") / family
    model = build_hf_model(family, source, tiny_tokenizer_path)
    output = import_model(source, source.parent / "imported", add_mask_token=True, dtype="float32")
    return family, source, output, model


def test_the_source_is_sharded_safetensors(imported: tuple[str, Path, Path, torch.nn.Module]) -> None:
    _, source, _, _ = imported
    assert (source / "model.safetensors.index.json").is_file()
    assert len(list(source.glob("model-*.safetensors"))) > 1 and not list(source.glob("*.bin"))


def test_causal_logits_equal_transformers(imported: tuple[str, Path, Path, torch.nn.Module]) -> None:
    family, source, output, _ = imported
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    model, _ = dlm.load(output)
    assert model.config.attention == "causal" and model.config.vocab_size == VOCAB + 1
    tokens = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        logits = model(tokens)
    assert logits.dtype == torch.float32 and logits.shape == (2, 40, VOCAB + 1)
    assert (logits[..., :VOCAB] - expected).abs().max().item() < 1e-5, family


def test_the_added_mask_token_is_recorded(imported: tuple[str, Path, Path, torch.nn.Module]) -> None:
    family, _, output, hf_model = imported
    config = read_export_config(output)
    assert config["source"] == {"kind": "hf-import", "file": family, "model_type": family, "added_mask_token": True}
    tokenizer = load_tokenizer(output / "tokenizer.json")
    assert special_token_id(tokenizer, "mask") == VOCAB == config["model"]["mask_token_id"]
    assert special_token_id(tokenizer, "eos") == 0  # </s>, named by the source's tokenizer_config.json
    card = (output / "README.md").read_text(encoding="utf-8")
    assert f"imported by dlm {dlm.__version__} from the Hugging Face directory `{family}`" in card
    assert "4 heads (2 key / value heads)" in card and "adapt it before sampling" in card
    model, _ = dlm.load(output)
    embedding = hf_model.get_input_embeddings().weight
    assert torch.allclose(model.token_embedding.weight[VOCAB], embedding.mean(dim=0), atol=1e-6)


def test_the_source_chat_template_travels(imported: tuple[str, Path, Path, torch.nn.Module]) -> None:
    _, _, output, _ = imported
    template = ChatTemplate.for_tokenizer(output / "tokenizer.json")
    assert template.prompt([Turn("user", "Who?")]) == "[user] Who?\n[assistant] "


def _packed(output: Path, directory: Path) -> Path:
    pack_corpus(
        tiny_train_files()[:2],
        output / "tokenizer.json",
        TINY_SEQ_LEN,
        directory,
        val_inputs=tiny_val_files(),
        overwrite=True,
    )
    return directory


def test_trains_20_steps_as_diffusion_exports_and_samples(
    imported: tuple[str, Path, Path, torch.nn.Module], tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    family, _, output, _ = imported
    data = _packed(output, tmp_path / "data")
    sets = [
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}",
        f"training.output_dir={tmp_path / 'run'}",
        "training.max_steps=20",
        "training.warmup_steps=2",
        "training.eval_interval=20",
        "training.save_interval=20",
    ]
    args = [item for value in sets for item in ("--set", value)]
    result = run_cli("train", "--config", ROOT / "configs" / "tiny.toml", *args, "--init-from", output, "--json")
    assert result.exit_code == 0, result.stderr
    assert load_checkpoint(tmp_path / "run" / "latest.pt")["step"] == 20
    assert "taken from it" in result.stderr and "d_model = 32" in result.stderr
    run_config = json.loads((tmp_path / "run" / "config.json").read_text(encoding="utf-8"))["model"]
    assert run_config["attention"] == "bidirectional" and run_config["d_model"] == 32
    assert run_config["n_kv_heads"] == 2 and run_config["vocab_size"] == VOCAB + 1
    assert run_cli("export", tmp_path / "run", "--output", tmp_path / "export", "--json").exit_code == 0
    evaluated = run_cli("eval", tmp_path / "export", "--data", data / "val.bin", "--batches", "2", "--json")
    assert evaluated.exit_code == 0, evaluated.stderr
    assert json.loads(evaluated.stdout.splitlines()[-1])["bits_per_byte"] > 0
    sampled = run_cli("sample", tmp_path / "export", "--prompt", "ROMEO:", "--length", "16", "--steps", "4", "--json")
    assert sampled.exit_code == 0, sampled.stderr
    assert json.loads(sampled.stdout.splitlines()[-1])["texts"][0].startswith("ROMEO:"), family


def test_a_contradicting_set_is_refused(
    imported: tuple[str, Path, Path, torch.nn.Module], tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    _, _, output, _ = imported
    result = run_cli(
        "train",
        "--config",
        ROOT / "configs" / "tiny.toml",
        "--init-from",
        output,
        "--set",
        "model.d_model=64",
        "--set",
        f"training.output_dir={tmp_path / 'run'}",
    )
    result.assert_refused("--set model.d_model", "contradicts --init-from", "d_model = 32")
    assert not (tmp_path / "run").exists()


def test_the_causal_source_itself_names_the_mask_token_fix(
    imported: tuple[str, Path, Path, torch.nn.Module], run_cli: Callable[..., CliResult]
) -> None:
    _, source, _, _ = imported
    run_cli("sample", source, "--prompt", "A").assert_refused("has no mask token", "--add-mask-token")
    with pytest.raises(UserError, match="pass --add-mask-token"):
        import_model(source, source.parent / "again")


def test_a_causal_model_is_not_sampled(
    imported: tuple[str, Path, Path, torch.nn.Module], run_cli: Callable[..., CliResult]
) -> None:
    _, _, output, _ = imported
    run_cli("sample", output, "--prompt", "A").assert_refused("causal model", "model.attention = bidirectional")


def test_init_from_notes_what_it_replaced(imported: tuple[str, Path, Path, torch.nn.Module], tmp_path: Path) -> None:
    from dlm.config.schema import load_config
    from dlm.train.init_from import adopt_source_model

    _, _, output, _ = imported
    experiment = load_config(ROOT / "configs" / "tiny.toml", [f"training.init_from={output}"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adopted = adopt_source_model(experiment, [f"training.init_from={output}"])
    notes = [str(w.message) for w in caught if issubclass(w.category, UserNote)]
    assert len(notes) == 2 and "n_layers" not in notes[0] and "d_model = 32" in notes[0]
    assert notes[1].endswith("was trained with causal attention; this run trains it with bidirectional attention")
    assert adopted.model.n_layers == 2 and adopted.model.d_model == 32 and adopted.model.mask_token_id == VOCAB
    assert adopted.training.tokenizer == output / "tokenizer.json"
    assert adopted.model.max_seq_len == experiment.model.max_seq_len  # the run's choice, not the source's


def test_chat_data_is_packed_in_the_source_template(
    imported: tuple[str, Path, Path, torch.nn.Module], tmp_path: Path
) -> None:
    from dlm.data.chat_pack import pack_chat
    from dlm.data.dataset import load_packed_dataset

    _, _, output, _ = imported
    examples = tmp_path / "chat.jsonl"
    examples.write_text(json.dumps({"prompt": "Who is there?", "response": "Nay, answer me."}) + "\n", encoding="utf-8")
    pack_chat([examples], output / "tokenizer.json", TINY_SEQ_LEN, tmp_path / "packed")
    tokenizer = load_tokenizer(output / "tokenizer.json")
    block, loss_mask = load_packed_dataset(tmp_path / "packed", TINY_SEQ_LEN)[0]
    ids = block.tolist()
    prompt = tokenizer.encode("[user] Who is there?\n[assistant] ", add_special_tokens=False).ids
    reply = tokenizer.encode("Nay, answer me.\n", add_special_tokens=False).ids  # the template ends a turn so
    assert ids[: len(prompt) + len(reply) + 1] == [*prompt, *reply, 0]  # 0: </s>, the source's end token
    assert not loss_mask[: len(prompt)].any() and loss_mask[len(prompt) : len(prompt) + len(reply) + 1].all()


def test_a_hugging_face_export_of_an_imported_variant_is_refused(
    imported: tuple[str, Path, Path, torch.nn.Module], tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    _, _, output, _ = imported
    result = run_cli("export", output, "--format", "hf", "--output", tmp_path / "hf")
    result.assert_refused("implements dlm's own variant only", "grouped_query = True", "omit --format hf")


def test_embedding_rows_past_the_tokenizer_are_never_sampled(
    tiny_tokenizer_path: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """A checkpoint padded past its tokenizer (Qwen's 151936 rows for 151665 tokens): the mask token
    takes the first spare row, validation accepts the tokenizer, sampling never produces a spare id."""

    build_hf_model("qwen2", tmp_path / "padded", tiny_tokenizer_path, vocab_size=576)
    output = import_model(tmp_path / "padded", tmp_path / "imported", add_mask_token=True, dtype="float32")
    model, tokenizer = dlm.load(output)
    assert model.config.vocab_size == 576 and model.config.mask_token_id == VOCAB  # no new row
    data = _packed(output, tmp_path / "data")
    sets = [
        f"training.train_data={data / 'train.bin'}",
        f"training.val_data={data / 'val.bin'}",
        f"training.init_from={output}",
    ]
    args = [item for value in sets for item in ("--set", value)]
    checked = run_cli("validate", "--config", ROOT / "configs" / "tiny.toml", *args, "--json")
    assert checked.exit_code == 0, checked.stdout
    assert "within the imported model's 576 embedding rows" in checked.stdout
    assert never_sampled_ids(tokenizer, 576) == list(range(VOCAB + 1, 576))
    model.config.attention = "bidirectional"  # as a run trains it; the logits below are all equal anyway
    with torch.no_grad():
        model.token_embedding.weight.zero_()  # every logit 0: a uniform draw over the ids allowed
    result = dlm.sample(model, tokenizer, prompt="ROMEO:", length=40, steps=4, seed=1, num_samples=4)
    generated = [token for row in result.token_ids for token in row[result.prompt_tokens[0] :]]
    assert len(generated) == 160 and max(generated) < VOCAB  # 63 of 575 ids spare: 1e-8 to miss them by chance


@pytest.mark.lora
def test_lora_on_an_imported_model_exports_adapters_that_load_alone(
    tiny_tokenizer_path: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    """LoRA with --init-from an imported Llama (grouped-query attention, an untied head, llama3 rope
    scaling): the adapters-only export carries the tokenizer_config.json that names the imported
    tokenizer's special tokens, so it loads and samples as the merged export does."""

    pytest.importorskip("peft")
    build_hf_model("llama", tmp_path / "llama", tiny_tokenizer_path)
    output = import_model(tmp_path / "llama", tmp_path / "imported", add_mask_token=True, dtype="float32")
    data = _packed(output, tmp_path / "data")
    sets = [
        f"training.train_data={data / 'train.bin'}",
        "training.val_data=none",
        "training.max_steps=2",
        f"training.output_dir={tmp_path / 'run'}",
        "training.warmup_steps=1",
        "training.save_interval=2",
        "training.lora.rank=4",
    ]
    args = [item for value in sets for item in ("--set", value)]
    trained = run_cli("train", "--config", ROOT / "configs" / "tiny.toml", *args, "--init-from", output, "--json")
    assert trained.exit_code == 0, trained.stderr
    for name, extra in (("merged", ["--dtype", "float32"]), ("adapters", ["--adapters-only"])):
        exported = run_cli("export", tmp_path / "run", "--output", tmp_path / name, *extra)
        assert exported.exit_code == 0, exported.stderr
    settings = (tmp_path / "adapters" / "tokenizer_config.json").read_bytes()
    assert settings == (output / "tokenizer_config.json").read_bytes()
    (merged, _), (adapted, tokenizer) = dlm.load(tmp_path / "merged"), dlm.load(tmp_path / "adapters")
    assert adapted.config.tie_embeddings is False and special_token_id(tokenizer, "eos") == 0
    tokens = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(adapted.eval()(tokens), merged.eval()(tokens), rtol=0, atol=1e-5)
    sampled = run_cli("sample", tmp_path / "adapters", "--prompt", "ROMEO:", "--length", "8", "--steps", "4")
    assert sampled.exit_code == 0, sampled.stderr
