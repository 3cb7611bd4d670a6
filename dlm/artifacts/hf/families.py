"""The Hugging Face model families dlm imports: each one's config fields and tensor names, read as data.

Nothing here runs code from a model directory: `config.json` is JSON and the names are the public
ones of each family's modeling file.

- `llama`, `mistral`, `qwen2`, `qwen3`: causal language models (`model.layers.N.self_attn.q_proj`,
  ...), imported with `attention = "causal"` for adaptation; Qwen2 has q/k/v biases, Qwen3 per-head
  q/k norms and its own head width.
- `dream`: a Qwen2 network trained as a masked diffusion model whose position i predicts token
  i + 1 (`shift_logits`), with bidirectional attention.
- `llada`: an OLMo-style layout (`model.transformer.blocks.N.q_proj`, `attn_out`, `ff_proj` (the
  gate), `up_proj`, `ff_out`) with bidirectional attention; mask id 126336 unless the config says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.errors import UserError

LLADA_MASK_ID = 126336
_MAX_SEQ_LEN = 1 << 17  # ModelConfig's bound; longer contexts are cut to it


@dataclass(frozen=True)
class Family:
    """How one family's config.json reads as dlm `[model]` fields and where its tensors are."""

    name: str
    model_fields: Callable[[dict[str, Any], Path], dict[str, Any]]
    top: dict[str, str]  # dlm name -> the family's name, outside the blocks
    block_prefix: str  # the family's prefix of block N's tensors, with {n}
    block: dict[str, str]  # dlm role -> the family's name inside a block


def _refuse(path: Path, problem: str, fix: str) -> UserError:
    return UserError(problem, path=path / "config.json", fix=fix)


def _field(config: dict[str, Any], name: str, path: Path) -> int:
    """A required integer field of config.json."""

    value = config.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _refuse(
            path, f"the field {name} is missing or not an integer", "restore the config.json the model was saved with"
        )
    return value


_KINDS: dict[type, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _optional(config: dict[str, Any], name: str, kind: type, default: Any, path: Path) -> Any:
    """An optional field of config.json: `default` where it is absent or null, else a value of `kind` (a
    number may be written as an integer), refused otherwise: "no" is not false, and read as a truth value
    it would import another model."""

    value = config.get(name)
    if value is None:
        return default
    numbers = (int, float) if kind is float else kind
    fits = kind is bool if isinstance(value, bool) else isinstance(value, numbers)  # a bool is no number in JSON
    if not fits:
        problem = f"the field {name} is {value!r}, not {_KINDS[kind]}"
        raise _refuse(path, problem, "restore the config.json the model was saved with")
    return float(value) if kind is float else value


def _required_number(config: dict[str, Any], name: str, path: Path) -> float:
    value = _optional(config, name, float, None, path)
    if value is None:
        raise _refuse(path, f"the field {name} is missing", "restore the config.json the model was saved with")
    return float(value)


def rope_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """rope_theta and rope_scaling from `rope_parameters` (transformers 5) or `rope_theta` and
    `rope_scaling` (earlier files); scalings other than linear and llama3 are refused."""

    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(parameters, dict):
        raise _refuse(path, f"rope_parameters is {parameters!r}, not an object", "restore the config.json")
    theta = _optional(parameters, "rope_theta", float, None, path)
    theta = _optional(config, "rope_theta", float, 10000.0, path) if theta is None else theta
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    if kind not in ("linear", "llama3"):
        raise _refuse(
            path,
            f"rope scaling {kind!r} is not supported (dlm has linear and llama3)",
            "use a checkpoint without it, or one with linear or llama3 scaling",
        )
    scaling: dict[str, Any] = {"type": kind, "factor": _required_number(parameters, "factor", path)}
    if kind == "llama3":
        original = _optional(parameters, "original_max_position_embeddings", int, None, path)
        if original is None:
            raise _refuse(path, "the field original_max_position_embeddings is missing", "restore the config.json")
        scaling.update(
            low_freq_factor=_required_number(parameters, "low_freq_factor", path),
            high_freq_factor=_required_number(parameters, "high_freq_factor", path),
            original_max_seq_len=original,
        )
    return {"rope_theta": theta, "rope_scaling": scaling}


def _causal_fields(config: dict[str, Any], path: Path, family: str) -> dict[str, Any]:
    """The fields of the transformers-style families (llama, mistral, qwen2, qwen3, dream)."""

    if _optional(config, "hidden_act", str, "silu", path) != "silu":
        raise _refuse(
            path,
            f"hidden_act {config.get('hidden_act')!r}: dlm's MLP is SwiGLU (silu)",
            "import a model with hidden_act silu",
        )
    if _optional(config, "mlp_bias", bool, False, path):
        raise _refuse(path, "mlp_bias is true: dlm's MLP has no biases", "import a model without MLP biases")
    width, heads = _field(config, "hidden_size", path), _field(config, "num_attention_heads", path)
    head_dim = _optional(config, "head_dim", int, None, path) or width // heads
    kv_heads = _optional(config, "num_key_value_heads", int, None, path) or heads
    max_len = _field(config, "max_position_embeddings", path)
    window = _optional(config, "sliding_window", int, None, path)
    if window and (family == "mistral" or _optional(config, "use_sliding_window", bool, False, path)):
        max_len = min(max_len, window)  # within the window, sliding attention is full attention
    return {
        "vocab_size": _field(config, "vocab_size", path),
        "d_model": width,
        "n_layers": _field(config, "num_hidden_layers", path),
        "n_heads": heads,
        "n_kv_heads": None if kv_heads == heads else kv_heads,
        "attention_head_dim": None if head_dim * heads == width else head_dim,
        "ffn_hidden_size": _field(config, "intermediate_size", path),
        "norm_eps": _optional(config, "rms_norm_eps", float, 1e-6, path),
        "max_seq_len": min(max_len, _MAX_SEQ_LEN),
        "qkv_bias": family in ("qwen2", "dream") or _optional(config, "attention_bias", bool, False, path),
        "qk_norm": family == "qwen3",
        "tie_embeddings": _optional(config, "tie_word_embeddings", bool, False, path),
        "attention": "bidirectional" if family == "dream" else "causal",
        "shift_logits": family == "dream",
        "pad_vocab_multiple": 1,
        **rope_fields(config, path),
    }


_LLADA_REQUIRED = {
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "rope": True,
    "alibi": False,
    "include_bias": False,
    "input_emb_norm": False,
    "scale_logits": False,
}


def _llada_fields(config: dict[str, Any], path: Path) -> dict[str, Any]:
    for name, expected in _LLADA_REQUIRED.items():
        if name in config and config[name] != expected:
            raise _refuse(
                path,
                f"LLaDA with {name} = {config[name]!r} is not supported (dlm reads {expected!r})",
                "import a LLaDA checkpoint of the published layout",
            )
    width, heads = _field(config, "d_model", path), _field(config, "n_heads", path)
    kv_heads = _optional(config, "n_kv_heads", int, None, path) or heads
    hidden = _optional(config, "mlp_hidden_size", int, None, path) or int(
        _optional(config, "mlp_ratio", float, 4.0, path) * width
    )
    rows = _optional(config, "embedding_size", int, None, path) or _field(config, "vocab_size", path)
    return {
        "vocab_size": rows,
        "d_model": width,
        "n_layers": _field(config, "n_layers", path),
        "n_heads": heads,
        "n_kv_heads": None if kv_heads == heads else kv_heads,
        "ffn_hidden_size": hidden,
        "norm_eps": _optional(config, "rms_norm_eps", float, 1e-5, path),
        "max_seq_len": min(_optional(config, "max_sequence_length", int, 4096, path), _MAX_SEQ_LEN),
        "qkv_bias": _optional(config, "include_qkv_bias", bool, False, path),
        "tie_embeddings": _optional(config, "weight_tying", bool, False, path),
        "mask_token_id": _optional(config, "mask_token_id", int, LLADA_MASK_ID, path),
        "rope_theta": _optional(config, "rope_theta", float, 10000.0, path),
        "pad_vocab_multiple": 1,
    }


# dlm name -> the transformers families' (Llama's layout), which dlm's own format shares outside its fused matmuls
TRANSFORMERS_TOP = {
    "token_embedding.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
TRANSFORMERS_BLOCK = {
    "attention_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "out": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
_LLADA_TOP = {
    "token_embedding.weight": "model.transformer.wte.weight",
    "norm.weight": "model.transformer.ln_f.weight",
    "head.weight": "model.transformer.ff_out.weight",
}
_LLADA_BLOCK = {
    "attention_norm": "attn_norm.weight",
    "mlp_norm": "ff_norm.weight",
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "out": "attn_out.weight",
    "gate": "ff_proj.weight",
    "up": "up_proj.weight",
    "down": "ff_out.weight",
}


def _transformers_family(name: str) -> Family:
    return Family(
        name,
        lambda config, path: _causal_fields(config, path, name),
        TRANSFORMERS_TOP,
        "model.layers.{n}.",
        TRANSFORMERS_BLOCK,
    )


FAMILIES: dict[str, Family] = {
    **{name: _transformers_family(name) for name in ("llama", "mistral", "qwen2", "qwen3", "dream")},
    "llada": Family("llada", _llada_fields, _LLADA_TOP, "model.transformer.blocks.{n}.", _LLADA_BLOCK),
}


def family_of(config: dict[str, Any], path: Path) -> Family:
    """The family of a config.json's `model_type` (Dream writes "Dream"), refused naming the supported ones."""

    model_type = str(config.get("model_type", "")).lower()
    if model_type not in FAMILIES:
        raise _refuse(
            path,
            f"model_type {config.get('model_type')!r} is not a family dlm imports",
            f"import one of: {', '.join(FAMILIES)}",
        )
    return FAMILIES[model_type]
