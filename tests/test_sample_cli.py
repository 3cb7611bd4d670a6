"""`dlm sample`: one checked request feeds plain sampling, `--chat` and `--prompt-file` alike, and an
option the others would make do nothing is refused."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import test_sampling
import torch
from tokenizers import Tokenizer

import dlm.sampling.generation
from dlm.cli.sample_cmd import SampleRequest
from dlm.config.schema import ModelConfig
from dlm.data.chat import chat_prompt, reply
from dlm.diffusion.distillation import attach_distilled_steps
from dlm.model.transformer import DiffusionTransformer
from dlm.sampling.generation import generate
from dlm.sampling.options import SamplingOptions

tokenizer = pytest.fixture(scope="module")(test_sampling.tokenizer.__wrapped__)  # the sampler tests' tokenizer
QUESTION = "say be"
# Every sampling option away from its default, as flags and as `SamplingOptions`.
FLAGS = [
    "--steps",
    "6",
    "--temperature",
    "0.5",
    "--top-k",
    "40",
    "--top-p",
    "0.95",
    "--remasking",
    "confidence",
    "--block-length",
    "4",
    "--threshold",
    "0.05",
    "--cache",
    "dual",
    "--reveal-split",
    "even",
]
OPTIONS = SamplingOptions(
    steps=6,
    temperature=0.5,
    top_k=40,
    top_p=0.95,
    remasking="confidence",
    block_length=4,
    threshold=0.05,
    cache="dual",
    reveal_split="even",
)
SETTINGS = ["--length", "8", "--num-samples", "2", "--seed", "3", "--device", "cpu"]


def test_every_sampling_option_is_a_flag_and_a_generate_argument() -> None:
    """A new `SamplingOptions` field needs a `dlm sample` flag and a `generate` argument, or this fails."""

    import typer.main

    from dlm.cli import app

    command = typer.main.get_command(app).commands["sample"]  # type: ignore[attr-defined]
    flags = {flag for param in command.params for flag in param.opts}
    accepted = inspect.signature(generate).parameters
    for field in dataclasses.fields(SamplingOptions):
        assert "--" + field.name.replace("_", "-") in flags, field.name
        assert field.name in accepted, field.name
        assert getattr(OPTIONS, field.name) != field.default, field.name  # FLAGS move every field


@dataclasses.dataclass
class Loaded:
    model: DiffusionTransformer
    calls: list[dict[str, Any]]  # the keyword arguments of every `generate` call
    loads: list[str]  # the loader of every model load
    dtypes: list[torch.dtype | None]  # the dtype every load asked for (None: the model's own choice)


@pytest.fixture()
def loaded(monkeypatch: pytest.MonkeyPatch, tokenizer: Tokenizer, tmp_path: Path) -> Loaded:
    """A tiny transformer behind both of the CLI's loaders, and a record of the sampler's calls."""

    config = ModelConfig(
        vocab_size=tokenizer.get_vocab_size(), max_seq_len=48, d_model=32, n_layers=2, n_heads=2, pad_vocab_multiple=64
    )
    torch.manual_seed(0)
    model = DiffusionTransformer(config).double().eval()  # float64: equal to a direct call on any CPU
    info = SimpleNamespace(tokenizer_path=tmp_path / "tokenizer.json")  # no tokenizer_config.json: default template
    loads: list[str] = []
    dtypes: list[torch.dtype | None] = []

    def load_model(path: object, device: str, dtype: torch.dtype | None) -> tuple[DiffusionTransformer, Tokenizer]:
        loads.append("export")
        dtypes.append(dtype)
        return model, tokenizer

    def load_model_with_info(path: object, device: str, dtype: torch.dtype | None) -> SimpleNamespace:
        loads.append("chat")
        dtypes.append(dtype)
        return SimpleNamespace(model=model, tokenizer=tokenizer, info=info)

    monkeypatch.setattr("dlm.artifacts.loading.load_model", load_model)
    monkeypatch.setattr("dlm.artifacts.loading.load_model_with_info", load_model_with_info)
    calls: list[dict[str, Any]] = []
    real = dlm.sampling.generation.generate
    monkeypatch.setattr(
        dlm.sampling.generation, "generate", lambda *args, **kwargs: calls.append(kwargs) or real(*args, **kwargs)
    )
    return Loaded(model, calls, loads, dtypes)


def sampled_options(kwargs: dict[str, Any]) -> SamplingOptions:
    return SamplingOptions(**{field.name: kwargs[field.name] for field in dataclasses.fields(SamplingOptions)})


@pytest.mark.parametrize("mode", ["plain", "chat", "prompt-file"])
def test_every_mode_hands_the_sampler_every_option(mode: str, loaded: Loaded, run_cli: Any, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\nTo be\n", encoding="utf-8")
    extra = {"plain": ["--prompt", "ROMEO:"], "chat": ["--chat", QUESTION], "prompt-file": ["--prompt-file", prompts]}
    result = run_cli("sample", "model", *FLAGS, *SETTINGS, "--stop-at-end", "--json", *extra[mode])
    assert result.exit_code == 0, result.stderr
    [call] = loaded.calls
    assert sampled_options(call) == OPTIONS
    settings = {name: call[name] for name in ("length", "num_samples", "seed", "stop_at_end", "device")}
    assert settings == {"length": 8, "num_samples": 2, "seed": 3, "stop_at_end": True, "device": "cpu"}


@pytest.mark.parametrize("mode", ["plain", "chat", "prompt-file"])
def test_dtype_reaches_the_load_in_every_mode(mode: str, loaded: Loaded, run_cli: Any, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\n", encoding="utf-8")
    extra = {"plain": ["--prompt", "ROMEO:"], "chat": ["--chat", QUESTION], "prompt-file": ["--prompt-file", prompts]}
    assert run_cli("sample", "model", *SETTINGS, "--json", *extra[mode]).exit_code == 0
    assert run_cli("sample", "model", *SETTINGS, "--json", "--dtype", "bfloat16", *extra[mode]).exit_code == 0
    assert loaded.dtypes == [None, torch.bfloat16]  # auto: the load decides (`inference_dtype`)
    run_cli("sample", "model", "--dtype", "float16", *extra[mode]).assert_refused("--dtype")


def test_the_request_carries_every_field() -> None:
    request = SampleRequest(OPTIONS, length=8, num_samples=2, seed=3, stop_at_end=False, device="cpu")
    assert sampled_options(request.generate_kwargs()) == OPTIONS


@pytest.mark.parametrize(
    ("flags", "options"),
    [
        (["--threshold", "0.05"], {"threshold": 0.05}),
        (["--remasking", "confidence", "--reveal-split", "even"], {"remasking": "confidence", "reveal_split": "even"}),
    ],
)
def test_a_chat_reply_is_what_generate_gives_the_templated_prompt(
    flags: list[str], options: dict[str, Any], loaded: Loaded, run_cli: Any, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    # (Every option reaches the sampler, above; these two also change this model's tokens, so a
    # reply that dropped them would differ.)
    result = run_cli(
        "sample",
        "model",
        "--chat",
        QUESTION,
        "--length",
        "12",
        "--steps",
        "8",
        "--seed",
        "4",
        "--num-samples",
        "2",
        "--device",
        "cpu",
        "--json",
        *flags,
    )
    assert result.exit_code == 0, result.stderr
    prompt = chat_prompt(tmp_path / "tokenizer.json", QUESTION)
    common = {"prompt": prompt, "length": 12, "steps": 8, "seed": 4, "num_samples": 2, "stop_at_end": True}
    expected = generate(loaded.model, tokenizer, **common, **options)
    length = len(tokenizer.encode(prompt, add_special_tokens=False).ids)
    assert json.loads(result.stdout)["replies"] == [reply(tokenizer, ids, length, 0) for ids in expected.token_ids]
    last = list(options)[-1]  # without the option under test: other tokens
    without = generate(loaded.model, tokenizer, **common, **{k: v for k, v in options.items() if k != last})
    assert without.token_ids != expected.token_ids


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--chat", QUESTION, "--prompt", "ROMEO:"], ["--chat cannot be combined with --prompt"]),
        (["--chat", QUESTION, "--text", "A [MASK] B"], ["--chat cannot be combined with --text"]),
        (["--chat", QUESTION, "--prompt-file", "p.txt"], ["--prompt-file cannot be combined"]),
        (["--text", "A [MASK*3] B", "--length", "8"], ["--length does nothing with --text"]),
        (["--temperature", "0", "--top-k", "5"], ["--top-k does nothing at --temperature 0"]),
        (["--temperature", "0", "--top-p", "0.5"], ["--top-p does nothing at --temperature 0"]),
        (["--chat", QUESTION, "--remasking", "random", "--reveal-split", "even"], ["--reveal-split even"]),
    ],
)
def test_an_option_that_would_do_nothing_is_refused(
    args: list[str], fragments: list[str], loaded: Loaded, run_cli: Any
) -> None:
    run_cli("sample", "model", "--device", "cpu", *args).assert_refused(*fragments)
    assert loaded.loads == [] and loaded.calls == []  # refused before a model loaded


def test_chat_json_reports_what_plain_sampling_json_reports(
    loaded: Loaded, run_cli: Any, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    args = ["--length", "12", "--steps", "8", "--seed", "4", "--num-samples", "2", "--device", "cpu", "--json"]
    chat = json.loads(run_cli("sample", "model", "--chat", QUESTION, *args).stdout)
    plain = json.loads(run_cli("sample", "model", "--prompt", "ROMEO:", *args).stdout)
    assert set(chat) == {"replies", *plain}
    prompt = chat_prompt(tmp_path / "tokenizer.json", QUESTION)
    expected = generate(
        loaded.model, tokenizer, prompt=prompt, length=12, steps=8, seed=4, num_samples=2, stop_at_end=True
    )
    for key in ("texts", "token_ids", "steps", "forward_passes", "forward_tokens", "lengths", "prompt_tokens"):
        assert chat[key] == getattr(expected, key), key
    assert chat["forward_passes"] > 0 and len(chat["lengths"]) == 2


def test_a_too_long_chat_question_is_named_as_chat(loaded: Loaded, run_cli: Any) -> None:
    result = run_cli("sample", "model", "--chat", "be " * 60, "--length", "8", "--device", "cpu")
    result.assert_refused(
        "--chat (",
        "tokens, the question in the chat template) plus --length (8)",
        "more than the model's max_seq_len (48)",
    )
    assert "--prompt" not in result.stderr and loaded.calls == []


def test_a_chat_question_spelling_the_mask_token_is_named_as_chat(loaded: Loaded, run_cli: Any) -> None:
    from dlm.data.tokenizer import SPECIAL_TOKENS

    result = run_cli("sample", "model", "--chat", f"say {SPECIAL_TOKENS['mask']}", "--device", "cpu")
    result.assert_refused("--chat contains the mask token itself")
    assert loaded.calls == []


def test_a_reveal_split_beside_the_models_own_order_is_checked_against_that_order(loaded: Loaded, run_cli: Any) -> None:
    args = ["--device", "cpu", "--length", "8", "--reveal-split", "even", "--json"]
    # A plain model samples in ancestral steps, which draw how many positions they reveal: refused once loaded.
    run_cli("sample", "model", *args).assert_refused("--reveal-split even", "--remasking random")
    assert loaded.loads == ["export"]
    # A student distilled for the dilated order samples in it, where the split is what it says.
    attach_distilled_steps(loaded.model, 4, "dilated")
    result = json.loads(run_cli("sample", "model", *args).stdout)
    assert result["steps"] == 4 and result["forward_passes"] == 4
    assert loaded.calls[-1]["remasking"] is None and loaded.calls[-1]["reveal_split"] == "even"
