"""LLaDA and Dream directories written with their published tensor names and config fields, checked
against a reference forward pass written here from the published equations; Dream's shifted logits
against a hand-computed case; the refusals of `dlm import`; the model variant properties."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import CliResult
from helpers import check_resume_is_exact
from safetensors.torch import save_file
from torch import Tensor

import dlm
from dlm.artifacts.hf.families import LLADA_MASK_ID
from dlm.artifacts.import_model import import_model
from dlm.config.schema import ModelConfig
from dlm.config.shapes import parameter_shapes
from dlm.errors import UserError
from dlm.model.attention import AttentionAnneal
from dlm.model.transformer import DiffusionTransformer

D, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 32, 4, 2, 48, 2, 40


def word_tokenizer(directory: Path, specials: dict[int, str], settings: dict[str, str]) -> None:
    """A word-level tokenizer of `VOCAB` ids: letters and filler words, `specials` at their ids."""

    from tokenizers import AddedToken, Tokenizer, models

    words = [f"w{index}" for index in range(VOCAB)]
    for index, token in specials.items():
        words[index] = token
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="w3"))
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials.values()])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")


def random_tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=generator) * (0.3 if len(shape) > 1 else 0.2) + (len(shape) == 1))
        for name, shape in shapes.items()
    }


def layer_shapes(prefix: str, names: dict[str, str], bias: bool) -> dict[str, tuple[int, ...]]:
    head = D // HEADS
    shapes = {
        names["attn_norm"]: (D,),
        names["ff_norm"]: (D,),
        names["q"] + ".weight": (D, D),
        names["k"] + ".weight": (KV_HEADS * head, D),
        names["v"] + ".weight": (KV_HEADS * head, D),
        names["o"]: (D, D),
        names["gate"]: (FFN, D),
        names["up"]: (FFN, D),
        names["down"]: (D, FFN),
    }
    if bias:
        shapes.update({names[p] + ".bias": (D if p == "q" else KV_HEADS * head,) for p in "qkv"})
    return {prefix + name: shape for name, shape in shapes.items()}


LLADA = {
    "attn_norm": "attn_norm.weight",
    "ff_norm": "ff_norm.weight",
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "attn_out.weight",
    "gate": "ff_proj.weight",
    "up": "up_proj.weight",
    "down": "ff_out.weight",
}
QWEN = {
    "attn_norm": "input_layernorm.weight",
    "ff_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}


def write_llada(directory: Path, mask_id: int = 37) -> dict[str, Tensor]:
    directory.mkdir(parents=True)
    shapes = {
        "model.transformer.wte.weight": (VOCAB, D),
        "model.transformer.ln_f.weight": (D,),
        "model.transformer.ff_out.weight": (VOCAB, D),
    }
    for n in range(LAYERS):
        shapes.update(layer_shapes(f"model.transformer.blocks.{n}.", LLADA, bias=False))
    tensors = random_tensors(shapes, 1)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "model_type": "llada",
        "architectures": ["LLaDAModelLM"],
        "d_model": D,
        "n_heads": HEADS,
        "n_kv_heads": KV_HEADS,
        "n_layers": LAYERS,
        "mlp_hidden_size": FFN,
        "vocab_size": VOCAB,
        "embedding_size": VOCAB,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_sequence_length": 64,
        "weight_tying": False,
        "include_bias": False,
        "block_type": "llama",
        "layer_norm_type": "rms",
        "activation_type": "silu",
        "rope": True,
        "alibi": False,
        "mask_token_id": mask_id,
    }
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    word_tokenizer(directory, {0: "<|endoftext|>", mask_id: "<|mdm_mask|>"}, {"eos_token": "<|endoftext|>"})
    return tensors


def write_dream(directory: Path, tensors: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    directory.mkdir(parents=True)
    shapes = {"model.embed_tokens.weight": (VOCAB, D), "model.norm.weight": (D,), "lm_head.weight": (VOCAB, D)}
    for n in range(LAYERS):
        shapes.update(layer_shapes(f"model.layers.{n}.", QWEN, bias=True))
    tensors = tensors if tensors is not None else random_tensors(shapes, 2)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "model_type": "Dream",
        "architectures": ["DreamModel"],
        "hidden_size": D,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "vocab_size": VOCAB,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "mask_token_id": 38,
        "eos_token_id": 0,
    }
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    word_tokenizer(directory, {0: "<|endoftext|>", 38: "<|mask|>"}, {"eos_token": "<|endoftext|>"})
    return tensors


# ------------------------------------------------------------------------------------ the reference


def rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: Tensor, theta: float) -> Tensor:
    """RoPE with the rotate-half pairing (i, i + D/2) both layouts use; x is [L, H, head]."""

    length, _, head = x.shape
    frequencies = theta ** (-torch.arange(0, head, 2, dtype=torch.float64) / head)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * frequencies
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None].float(), torch.cat([angles.sin()] * 2, -1)[:, None].float()
    rotated = torch.cat([-x[..., head // 2 :], x[..., : head // 2]], -1)
    return x * cos + rotated * sin


def reference_logits(
    t: dict[str, Tensor],
    tokens: Tensor,
    top: dict[str, str],
    prefix: str,
    names: dict[str, str],
    theta: float,
    eps: float,
    bias: bool,
) -> Tensor:
    """Logits [L, V] of one sequence: pre-norm blocks, bidirectional attention, SwiGLU, untied head."""

    head = D // HEADS
    x = t[top["embed"]][tokens]
    for n in range(LAYERS):
        p = prefix.format(n=n)
        h = rms(x, t[p + names["attn_norm"]], eps)
        q, k, v = (h @ t[p + names[m] + ".weight"].T + (t[p + names[m] + ".bias"] if bias else 0) for m in "qkv")
        q, k, v = q.view(-1, HEADS, head), k.view(-1, KV_HEADS, head), v.view(-1, KV_HEADS, head)
        q, k = rope(q, theta), rope(k, theta)
        group = HEADS // KV_HEADS
        out = []
        for index in range(HEADS):
            kv = index // group  # query head index shares key / value head index // group
            scores = q[:, index] @ k[:, kv].T / math.sqrt(head)
            out.append(torch.softmax(scores, -1) @ v[:, kv])
        x = x + torch.cat(out, -1) @ t[p + names["o"]].T
        h = rms(x, t[p + names["ff_norm"]], eps)
        x = x + (F.silu(h @ t[p + names["gate"]].T) * (h @ t[p + names["up"]].T)) @ t[p + names["down"]].T
    return rms(x, t[top["norm"]], eps) @ t[top["head"]].T


TOKENS = torch.tensor([[5, 9, 37, 37, 12, 3, 37, 20, 21, 7], [1, 2, 3, 4, 37, 37, 37, 37, 8, 9]])


def test_llada_logits_equal_the_reference(tmp_path: Path) -> None:
    tensors = write_llada(tmp_path / "llada")
    model, _ = dlm.load(tmp_path / "llada")
    assert model.config.mask_token_id == 37 and model.config.attention == "bidirectional"
    top = {
        "embed": "model.transformer.wte.weight",
        "norm": "model.transformer.ln_f.weight",
        "head": "model.transformer.ff_out.weight",
    }
    with torch.no_grad():
        logits = model(TOKENS)
    for row in range(2):
        expected = reference_logits(
            tensors, TOKENS[row], top, "model.transformer.blocks.{n}.", LLADA, 500000.0, 1e-5, bias=False
        )
        assert (logits[row] - expected).abs().max().item() < 1e-5


def test_llada_mask_id_defaults_to_the_published_one(tmp_path: Path) -> None:
    from dlm.artifacts.hf.families import FAMILIES

    config = json.loads(json.dumps({"d_model": D, "n_heads": HEADS, "n_layers": 1, "vocab_size": 126464}))
    assert FAMILIES["llada"].model_fields(config, tmp_path)["mask_token_id"] == LLADA_MASK_ID == 126336


def test_dream_logits_equal_the_shifted_reference(tmp_path: Path) -> None:
    tensors = write_dream(tmp_path / "dream")
    model, _ = dlm.load(tmp_path / "dream")
    assert model.config.shift_logits and model.config.qkv_bias and model.config.mask_token_id == 38
    top = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
    with torch.no_grad():
        logits = model(TOKENS)
    for row in range(2):
        plain = reference_logits(tensors, TOKENS[row], top, "model.layers.{n}.", QWEN, 1e6, 1e-6, bias=True)
        expected = torch.cat([plain[:1], plain[:-1]])  # Dream: position i predicts from the output at i - 1
        assert (logits[row] - expected).abs().max().item() < 1e-5


def test_dream_shift_by_hand(tmp_path: Path) -> None:
    """Blocks that add nothing, one-hot embeddings and an identity head: each position's output is its
    own token, so after the shift position i predicts token i - 1 and position 0 its own."""

    shapes = {}
    for n in range(LAYERS):
        shapes.update(layer_shapes(f"model.layers.{n}.", QWEN, bias=True))
    tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
    tensors["model.embed_tokens.weight"] = torch.eye(VOCAB, D) * 10
    tensors["model.norm.weight"] = torch.ones(D)
    tensors["lm_head.weight"] = torch.eye(VOCAB, D)
    write_dream(tmp_path / "dream", tensors)
    model, _ = dlm.load(tmp_path / "dream")
    tokens = torch.tensor([[4, 17, 9, 30, 31, 2]])  # ids below D, which have one-hot embeddings
    with torch.no_grad():
        predicted = model(tokens).argmax(-1)
    assert predicted.tolist() == [[4, 4, 17, 9, 30, 31]]


def test_import_writes_a_dlm_model_with_the_mask_token_named(tmp_path: Path) -> None:
    write_llada(tmp_path / "llada")
    output = import_model(tmp_path / "llada", tmp_path / "out", dtype="float32")
    settings = json.loads((output / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert settings["mask_token"] == "<|mdm_mask|>" and settings["eos_token"] == "<|endoftext|>"
    a, _ = dlm.load(tmp_path / "llada")
    b, _ = dlm.load(output)
    with torch.no_grad():
        assert torch.equal(a(TOKENS), b(TOKENS))


def test_dlm_import_on_the_command_line(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    write_dream(tmp_path / "dream")
    result = run_cli("import", tmp_path / "dream", "--output", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["dtype"] == "bfloat16" and set(summary["files"]) == {
        "README.md",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    run_cli("import", tmp_path / "dream", "--output", tmp_path / "out").assert_refused("already exists", "--overwrite")
    run_cli("import", tmp_path / "dream", "--output", tmp_path / "again", "--add-mask-token").assert_refused(
        "already has a mask token (<|mask|>)", "omit --add-mask-token"
    )


# ------------------------------------------------------------------------------------ refusals


def test_refusals_name_the_fix(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    write_llada(tmp_path / "llada")
    config = json.loads((tmp_path / "llada" / "config.json").read_text(encoding="utf-8"))
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}), encoding="utf-8")
    run_cli("import", tmp_path / "gpt", "--output", tmp_path / "o1").assert_refused(
        "model_type 'gpt2'", "llama, mistral, qwen2, qwen3, dream, llada"
    )
    (tmp_path / "llada" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.transformer.wte.weight": "model-00002-of-00002.safetensors"}}),
        encoding="utf-8",
    )
    run_cli("import", tmp_path / "llada", "--output", tmp_path / "o2").assert_refused(
        "model-00002-of-00002.safetensors, which is missing", "download every shard"
    )
    (tmp_path / "llada" / "model.safetensors.index.json").unlink()
    (tmp_path / "llada" / "model.safetensors").rename(tmp_path / "llada" / "pytorch_model.bin")
    run_cli("import", tmp_path / "llada", "--output", tmp_path / "o3").assert_refused("only pickled weights")
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3"))


def test_a_missing_field_or_tokenizer_is_named(tmp_path: Path) -> None:
    write_llada(tmp_path / "llada")
    path = tmp_path / "llada" / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**config, "d_model": "4096"}), encoding="utf-8")
    with pytest.raises(UserError, match="the field d_model is missing or not an integer"):
        import_model(tmp_path / "llada", tmp_path / "out")
    path.write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "llada" / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=r"no tokenizer\.json"):
        import_model(tmp_path / "llada", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_rope_scaling_is_refused(tmp_path: Path) -> None:
    write_dream(tmp_path / "dream")
    path = tmp_path / "dream" / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}), encoding="utf-8")
    with pytest.raises(UserError, match="rope scaling 'yarn' is not supported"):
        dlm.load(tmp_path / "dream")


# ------------------------------------------------------------------------------------ the variant properties


VARIANTS = {
    "gqa, biases, norms, untied, scaled": {
        "n_kv_heads": 1,
        "qkv_bias": True,
        "qk_norm": True,
        "tie_embeddings": False,
        "attention_head_dim": 16,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    },
    "causal, shifted, unpadded": {"attention": "causal", "shift_logits": True, "pad_vocab_multiple": 1},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_memory_estimate_counts_every_variant_parameter(variant: str) -> None:
    config = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, **VARIANTS[variant])
    model = DiffusionTransformer(config)
    assert parameter_shapes(config) == [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def test_defaults_keep_the_fused_projection_and_tied_head() -> None:
    model = DiffusionTransformer(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16))
    names = {name for name, _ in model.named_parameters()}
    assert "blocks.0.attention.qkv.weight" in names and "head.weight" not in names
    assert not any("bias" in name or "q_norm" in name for name in names)


def test_causal_attention_ignores_later_positions() -> None:
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, attention="causal")
    model = DiffusionTransformer(config).eval()
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 8:] = 5
    with torch.no_grad():
        assert torch.equal(model(tokens)[0, :8], model(changed)[0, :8])
        assert not torch.equal(model(tokens)[0, 8:], model(changed)[0, 8:])


def test_the_anneal_opens_causal_attention_to_bidirectional() -> None:
    causal = AttentionAnneal(0.0, seed=3).mask(8, torch.device("cpu")).mask
    assert torch.equal(causal, torch.ones(8, 8, dtype=torch.bool).tril())
    assert AttentionAnneal(1.0, seed=3).mask(8, torch.device("cpu")).mask.all()
    half = AttentionAnneal(0.5, seed=3).mask(64, torch.device("cpu")).mask
    assert torch.equal(half, AttentionAnneal(0.5, seed=3).mask(64, torch.device("cpu")).mask)  # seeded
    future = half.triu(1).sum().item() / (64 * 63 / 2)
    assert 0.4 < future < 0.6 and half[torch.ones(64, 64, dtype=torch.bool).tril()].all()


def test_the_anneal_runs_in_training_only_and_ends_at_its_step() -> None:
    from dlm.config.schema import TrainingConfig
    from dlm.train.step import attention_anneal

    training = TrainingConfig(attention_anneal_steps=10)
    assert attention_anneal(0, training) == AttentionAnneal(0.0, 1337 * 1_000_003)
    assert attention_anneal(5, training).fraction == 0.5  # type: ignore[union-attr]
    assert attention_anneal(10, training) is None
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=16)
    model = DiffusionTransformer(config)
    model.attention_anneal = AttentionAnneal(0.0, 1)
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    causal = DiffusionTransformer(config.model_copy(update={"attention": "causal"}))
    causal.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model.train()(tokens), causal.train()(tokens))  # fraction 0: causal
        evaluated = model.eval()(tokens)  # evaluation sees the attention the run anneals to
        model.attention_anneal = None
        assert torch.equal(evaluated, model(tokens)) and not torch.equal(evaluated, causal.eval()(tokens))


def test_the_benchmark_scorer_runs_on_a_dream_directory(tmp_path: Path) -> None:
    """`python -m dlm.harness` scores through `Scorer`: ELBO log-likelihoods, rolling windows and
    generation on an imported shifted-logits model, its end token from the source's tokenizer_config.json."""

    from dlm.evaluation.scoring import Scorer

    write_dream(tmp_path / "dream")
    model, tokenizer = dlm.load(tmp_path / "dream")
    scorer = Scorer(model, tokenizer, mc_samples=2, batch_size=4, steps=4)
    assert scorer.eos_id == 0 and scorer.forbidden == []  # no pad token: nothing else forbidden
    [score] = scorer.loglikelihood([([5, 9, 12], [20, 21])])
    assert math.isfinite(score.logprob) and score.logprob < 0 and score.is_greedy in (True, False)
    [rolling] = scorer.rolling([[5, 9, 12, 20, 21, 7, 8]])
    assert math.isfinite(rolling) and rolling < 0
    assert isinstance(scorer.generate([5, 9, 12], max_tokens=4), str)


def test_a_run_with_an_anneal_resumes_exactly_and_differs_from_one_without(tiny_data_dir: Path, tmp_path: Path) -> None:
    settings = (
        "training.max_steps=6",
        "training.warmup_steps=1",
        "training.save_interval=100",
        "training.eval_interval=100",
        "training.log_interval=1",
    )
    anneal = (*settings, "training.attention_anneal_steps=4")
    annealed = check_resume_is_exact(tiny_data_dir, tmp_path / "anneal", anneal, pause_at=2)
    plain = check_resume_is_exact(tiny_data_dir, tmp_path / "plain", settings, pause_at=2)
    assert annealed[0] != plain[0] and len(annealed) == len(plain) == 6


def test_a_shifted_model_samples_without_a_cache_and_refuses_one(
    tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    write_dream(tmp_path / "dream")
    sampled = run_cli("sample", tmp_path / "dream", "--prompt", "w5", "--length", "6", "--steps", "3", "--json")
    assert sampled.exit_code == 0, sampled.stderr
    result = json.loads(sampled.stdout.splitlines()[-1])
    assert result["token_ids"][0][0] == 5 and len(result["token_ids"][0]) == 7
    refused = run_cli(
        "sample", tmp_path / "dream", "--prompt", "w5", "--length", "6", "--cache", "prefix", "--threshold", "0.9"
    )
    refused.assert_refused("--cache prefix cannot serve a shifted-logits model", "omit --cache")
