"""An `dlm export --format hf` directory in transformers (the `hf` extra; skipped without it).

The logits equal dlm's, a seeded `generate` gives `dlm.sample`'s tokens (block diffusion models too:
block-causal attention, block-by-block sampling), and the directory loads in a Python where dlm
cannot be imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import train_tiny_run

import dlm

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf_extra

from dlm.artifacts.hf_export import HF_SCHEDULES, export_hf  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_data_dir, tmp_path_factory.mktemp("hf-run") / "run")


@pytest.fixture(scope="module")
def hf_dir(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf(run_dir, tmp_path_factory.mktemp("hf-export") / "tiny-hf", dtype="float32")


@pytest.fixture(scope="module")
def hf_model(hf_dir: Path) -> torch.nn.Module:
    model = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, trust_remote_code=True)
    return model.float().eval()


def sample_tokens(masked: bool) -> torch.Tensor:
    tokens = torch.randint(3, 512, (3, 64), generator=torch.Generator().manual_seed(7))
    if masked:
        tokens[:, 1::3] = 1
        tokens[1, 40:] = 1  # a masked tail, as generation starts
    return tokens


@pytest.mark.parametrize(
    ("dtype", "temperature", "top_k", "top_p"),
    [
        (torch.float32, 1.0, None, 0.9),
        (torch.bfloat16, 1.0, None, 0.5),
        (torch.float64, 0.7, None, 0.95),
        (torch.float32, 1.3, 20, 0.8),
        (torch.float32, 1.0, None, None),
        (torch.float32, 0.0, None, 0.9),
    ],
)
def test_the_bundled_draw_gives_dlm_s_tokens_and_probabilities(
    dtype: torch.dtype, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    # Hard rows for the draw: confident, flat, tied (bfloat16-like), cut by -inf, one finite token,
    # over a vocabulary that is not a multiple of the draw's blocks of 64.
    from dlm.artifacts.hf import modeling_dlm
    from dlm.sampling.tokens import sample_with_probabilities

    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(64, 300, generator=generator) * 3).bfloat16().float()
    logits[:8, 5] += 15
    logits[8:16] = 0.0
    logits[16:24, ::2] = float("-inf")
    logits[24:28] = float("-inf")
    logits[24:28, 7] = 1.0
    logits = logits.to(dtype)
    options = modeling_dlm._Options(1, temperature, top_k, top_p, "random", None)
    bundled, probabilities = modeling_dlm.sample_tokens(logits, options, torch.Generator().manual_seed(3), True)
    expected = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    tokens, own = sample_with_probabilities(logits, generator=torch.Generator().manual_seed(3), **expected)
    assert torch.equal(bundled, tokens)
    assert probabilities is not None and torch.equal(probabilities, own)


@pytest.mark.parametrize("masked", [False, True])
def test_logits_equal_dlm_s(hf_model: torch.nn.Module, run_dir: Path, masked: bool) -> None:
    model, _ = dlm.load(run_dir)
    tokens = sample_tokens(masked)
    with torch.no_grad():
        expected = model(tokens)
        output = hf_model(input_ids=tokens)
    assert output.logits.shape == (3, 64, 512) and output.logits.dtype == torch.float32
    assert (output.logits - expected).abs().max() < 1e-5
    # A full attention mask is no mask; labels give the masked cross-entropy.
    labels = torch.where(tokens == 1, sample_tokens(False), -100) if masked else sample_tokens(False)
    with torch.no_grad():
        again = hf_model(input_ids=tokens, attention_mask=torch.ones_like(tokens), labels=labels)
    assert torch.equal(again.logits, output.logits)
    expected_loss = torch.nn.functional.cross_entropy(expected.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert abs(again.loss.item() - expected_loss.item()) < 1e-5


def test_tokenizer_declares_the_special_tokens(hf_dir: Path, run_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert (tokenizer.mask_token, tokenizer.mask_token_id) == ("<|mask|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|endoftext|>", 0)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|pad|>", 2)
    _, dlm_tokenizer = dlm.load(run_dir)
    text = "ROMEO: But soft, what light\nthrough yonder window breaks?"
    assert tokenizer(text).input_ids == dlm_tokenizer.encode(text).ids
    assert tokenizer.decode(dlm_tokenizer.encode(text).ids) == text


SETTINGS = [
    {"remasking": "confidence"},
    {"remasking": "margin", "block_length": 8, "temperature": 0.7, "top_k": 20},
    {"remasking": "random", "top_p": 0.9},
    {"remasking": "random", "block_length": 6, "steps": 7},
    {"remasking": "confidence", "temperature": 0.0, "steps": 5},
    {"remasking": "confidence", "reveal_split": "even", "steps": 12},
    {"remasking": "dilated", "steps": 9},
    {"remasking": "dilated", "block_length": 8, "reveal_split": "even", "steps": 6},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_seeded_generation_equals_dlm_sample(
    hf_model: torch.nn.Module, hf_dir: Path, run_dir: Path, settings: dict
) -> None:
    model, tokenizer = dlm.load(run_dir)
    options = {"steps": 12, **settings}
    expected = dlm.sample(model, tokenizer, prompt="ROMEO:", length=20, num_samples=3, seed=11, **options)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompt = hf_tokenizer("ROMEO:", return_tensors="pt").input_ids
    ids = hf_model.generate(prompt, max_new_tokens=20, num_samples=3, seed=11, **options)
    assert ids.tolist() == expected.token_ids
    assert not (ids == 1).any() and not (ids == 2).any()  # no mask left, padding never generated
    assert len({tuple(row) for row in ids.tolist()}) > 1 or settings.get("temperature") == 0.0


@pytest.mark.parametrize("remasking", ["random", "confidence"])
def test_cosine_schedule_generation_equals_dlm_sample(hf_dir: Path, run_dir: Path, remasking: str) -> None:
    model, tokenizer = dlm.load(run_dir)
    expected = dlm.sample(model, tokenizer, length=24, steps=10, seed=2, remasking=remasking, schedule="cosine")
    # A config keyword of from_pretrained overrides config.json: the same weights, the cosine schedule.
    hf_model = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, trust_remote_code=True, schedule="cosine")
    assert hf_model.config.schedule == "cosine"
    ids = hf_model.generate(None, max_new_tokens=24, steps=10, seed=2, remasking=remasking)
    assert ids.tolist() == expected.token_ids


def test_infilling_matches_dlm_templates(hf_model: torch.nn.Module, run_dir: Path) -> None:
    model, tokenizer = dlm.load(run_dir)
    expected = dlm.sample(model, tokenizer, text="ROMEO: [MASK*6] fair Verona[MASK*4]", steps=8, seed=3)
    prefix = tokenizer.encode("ROMEO: ").ids
    middle = tokenizer.encode(" fair Verona").ids
    ids = torch.tensor([prefix + [1] * 6 + middle + [1] * 4])
    assert hf_model.generate(ids, max_new_tokens=0, steps=8, seed=3).tolist() == expected.token_ids


def test_trains_after_generating(hf_dir: Path) -> None:
    model = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, trust_remote_code=True).float()
    model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, steps=4)
    model.train()
    tokens = sample_tokens(masked=True)
    loss = model(input_ids=tokens, labels=torch.where(tokens == 1, sample_tokens(False), -100)).loss
    loss.backward()
    assert model.training and model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_generation_refusals(hf_model: torch.nn.Module) -> None:
    ragged = torch.tensor([[5, 1, 1], [5, 5, 1]])
    with pytest.raises(ValueError, match="same columns"):
        hf_model.generate(ragged, max_new_tokens=0)
    with pytest.raises(ValueError, match="fewer than the 4 blocks"):
        hf_model.generate(torch.tensor([[5]]), max_new_tokens=8, block_length=2, steps=3)
    with pytest.raises(ValueError, match="remasking"):
        hf_model.generate(torch.tensor([[5]]), max_new_tokens=8, remasking="lowest")
    with pytest.raises(ValueError, match="reveal_split"):
        hf_model.generate(torch.tensor([[5]]), max_new_tokens=8, reveal_split="even")  # random remasking
    with pytest.raises(ValueError, match="exceed"):
        hf_model.generate(torch.tensor([[5]]), max_new_tokens=64)


@pytest.fixture(scope="module")
def block_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A block diffusion run (block_size 16 of 64 positions) and its float32 export in transformers."""

    root = tmp_path_factory.mktemp("hf-block")
    run_dir = train_tiny_run(tiny_data_dir, root / "run", "model.block_size=16")
    hf_dir = export_hf(run_dir, root / "hf", dtype="float32")
    model = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, trust_remote_code=True)
    return run_dir, model.float().eval()


@pytest.mark.parametrize("length", [64, 37, 9])
def test_block_model_logits_equal_dlm_s_block_causal_inference(block_run: tuple, length: int) -> None:
    run_dir, hf_model = block_run
    model, _ = dlm.load(run_dir)
    tokens = sample_tokens(masked=True)[:, :length]
    with torch.no_grad():
        expected = model(tokens)  # no clean copy: dlm's inference pass, block b sees blocks <= b
        logits = hf_model(input_ids=tokens).logits
        # Changing a later block leaves every earlier block's logits as they were: causal across blocks.
        changed = tokens.clone()
        changed[:, 32:] = 5
        later = hf_model(input_ids=changed).logits
    assert hf_model.config.block_size == 16
    assert (logits - expected).abs().max() < 1e-5
    assert torch.equal(later[:, :32], logits[:, :32])
    if length > 32:
        assert not torch.equal(later[:, 32:], logits[:, 32:])


def test_subs_model_logits_equal_dlm_s_and_old_exports_stay_plain(tiny_data_dir: Path, tmp_path: Path) -> None:
    run_dir = train_tiny_run(tiny_data_dir, tmp_path / "run", "model.mask_logit=subs")
    hf_dir = export_hf(run_dir, tmp_path / "hf", dtype="float32")
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["mask_logit"] == "subs" and config["dlm"]["model"]["mask_logit"] == "subs"
    hf_model = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, trust_remote_code=True).float().eval()
    model, _ = dlm.load(run_dir)
    back, _ = dlm.load(hf_dir)  # and back into dlm, with the parameterisation
    tokens = sample_tokens(masked=True)
    with torch.no_grad():
        expected, logits = model(tokens), hf_model(input_ids=tokens).logits
    assert back.config.mask_logit == "subs" and bool((expected[tokens == 1][:, 1] == float("-inf")).all())
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)  # -inf where dlm has it, close elsewhere
    # An export made before the setting existed was trained plain, and is read so by both sides.
    del config["mask_logit"], config["dlm"]["model"]["mask_logit"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    old = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, trust_remote_code=True).float().eval()
    with torch.no_grad():
        assert bool(torch.isfinite(old(input_ids=tokens).logits).all())
    assert dlm.load(hf_dir)[0].config.mask_logit == "plain"


BLOCK_SETTINGS = [
    {"remasking": "random"},
    {"remasking": "confidence", "steps": 5},
    {"remasking": "margin", "temperature": 0.7, "top_k": 20, "block_length": 16},
    {"remasking": "confidence", "reveal_split": "even", "steps": 7},
]


@pytest.mark.parametrize("settings", BLOCK_SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_block_model_generation_equals_dlm_sample(block_run: tuple, settings: dict) -> None:
    run_dir, hf_model = block_run
    model, tokenizer = dlm.load(run_dir)
    options = {"steps": 12, **settings}
    # The prompt ends inside the first block; 40 new tokens reach into the fourth.
    expected = dlm.sample(model, tokenizer, prompt="ROMEO:", length=40, num_samples=3, seed=5, **options)
    prompt = torch.tensor([tokenizer.encode("ROMEO:").ids])
    ids = hf_model.generate(prompt, max_new_tokens=40, num_samples=3, seed=5, **options)
    assert ids.tolist() == expected.token_ids
    assert not (ids == 1).any()


def test_block_model_infilling_and_refusals(block_run: tuple) -> None:
    run_dir, hf_model = block_run
    model, tokenizer = dlm.load(run_dir)
    expected = dlm.sample(model, tokenizer, text="ROMEO: [MASK*20] fair Verona[MASK*4]", steps=8, seed=3)
    ids = torch.tensor([tokenizer.encode("ROMEO: ").ids + [1] * 20 + tokenizer.encode(" fair Verona").ids + [1] * 4])
    assert hf_model.generate(ids, max_new_tokens=0, steps=8, seed=3).tolist() == expected.token_ids
    with pytest.raises(ValueError, match="block_length 8 differs from the model's block_size 16"):
        hf_model.generate(torch.tensor([[5]]), max_new_tokens=8, block_length=8)
    with pytest.raises(ValueError, match="fewer than the 3 blocks"):
        hf_model.generate(torch.tensor([[5]]), max_new_tokens=40, steps=2)


def test_bundled_sampler_knows_the_schedules_the_export_accepts() -> None:
    from dlm.artifacts.hf.configuration_dlm import SCHEDULES

    assert tuple(SCHEDULES) == HF_SCHEDULES


_ISOLATED_LOAD = """
import json, sys
sys.modules["dlm"] = None  # `import dlm` now fails, whatever is installed
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer
directory, tokens, report = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = AutoModelForMaskedLM.from_pretrained(directory, trust_remote_code=True).float().eval()
tokenizer = AutoTokenizer.from_pretrained(directory)
with torch.no_grad():
    logits = model(input_ids=torch.tensor(tokens)).logits
ids = model.generate(tokenizer("ROMEO:", return_tensors="pt").input_ids, max_new_tokens=10, steps=10, seed=5)
loaded = sorted(name for name, module in sys.modules.items() if module is not None and name.split(".")[0] == "dlm")
with open(report, "w") as file:
    json.dump({"logits": logits.tolist(), "ids": ids.tolist(), "dlm_modules": loaded,
               "model_module": type(model).__module__, "mask": tokenizer.mask_token_id}, file)
"""


def test_export_loads_where_dlm_cannot_be_imported(hf_dir: Path, run_dir: Path, tmp_path: Path) -> None:
    tokens = sample_tokens(masked=True)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # -I: no PYTHONPATH, no user site, no current directory on sys.path; the script runs from elsewhere.
    # Without trust_remote_code, transformers 5 asks whether to run the config's code before loading
    # the tokenizer; with no terminal to answer it declines, and the stock fast tokenizer loads anyway.
    arguments = [str(hf_dir), json.dumps(tokens.tolist()), str(tmp_path / "report.json")]
    result = subprocess.run(
        [sys.executable, "-I", "-c", _ISOLATED_LOAD, *arguments],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["dlm_modules"] == [] and "modeling_dlm" in report["model_module"] and report["mask"] == 1
    model, tokenizer = dlm.load(run_dir)
    with torch.no_grad():
        assert (torch.tensor(report["logits"]) - model(tokens)).abs().max() < 1e-5
    expected = dlm.sample(model, tokenizer, prompt="ROMEO:", length=10, steps=10, seed=5)
    assert report["ids"] == expected.token_ids


def test_document_attention_travels_to_the_export(tiny_data_dir: Path, tmp_path: Path) -> None:
    run_dir = train_tiny_run(tiny_data_dir, tmp_path / "run", "model.document_separator_id=0")
    hf_dir = export_hf(run_dir, tmp_path / "hf", dtype="float32")
    assert json.loads((hf_dir / "config.json").read_text())["document_separator_id"] == 0
    hf_model = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, trust_remote_code=True).float().eval()
    model, _ = dlm.load(run_dir)
    assert dlm.load(hf_dir)[0].config.document_separator_id == 0
    from dlm.model.attention import document_ids
    from dlm.model.denoiser import masked_logits

    clean = sample_tokens(masked=False)
    clean[:, [20, 43]] = 0  # three documents a row
    noisy = clean.clone()
    noisy[:, 1::3] = 1  # the separator at 43 is masked: only the clean row's documents split there
    everywhere = torch.ones_like(clean, dtype=torch.bool)
    with torch.no_grad():
        expected = masked_logits(model, noisy, everywhere, clean).view(3, 64, -1)
        logits = hf_model(input_ids=noisy, document_ids=document_ids(clean, 0)).logits
        from_input = hf_model(input_ids=noisy).logits  # the separator it can see: the one at 20
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(from_input, expected, atol=1e-4)
    torch.testing.assert_close(from_input[:, :21], expected[:, :21], rtol=0, atol=1e-5)
