"""A model's parameters from its config alone, without torch: each parameter's name and shape, the
count, and the count as people read it.

`dlm tokenizer train`, `dlm validate` and the memory estimate all size a model before any weight
exists; a test holds `parameter_shapes` to the built network's `named_parameters()`.
"""

from __future__ import annotations

import math

from dlm.config.schema import ModelConfig


def parameter_shapes(model: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Name and shape of every parameter `DiffusionTransformer(model)` has, without building it.

    Names follow `named_parameters()`; a tied head is the embedding, so it has no entry.
    """

    d, ffn, head = model.d_model, model.ffn_size, model.head_dim
    queries, qkv = model.n_heads * head, (model.n_heads + 2 * model.kv_heads) * head
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embedding.weight", (model.padded_vocab_size, d))]
    for index in range(model.n_layers):
        prefix = f"blocks.{index}"
        shapes += [(f"{prefix}.attention_norm.weight", (d,)), (f"{prefix}.attention.qkv.weight", (qkv, d))]
        shapes += [(f"{prefix}.attention.qkv.bias", (qkv,))] if model.qkv_bias else []
        shapes += [(f"{prefix}.attention.{name}.weight", (head,)) for name in ("q_norm", "k_norm") if model.qk_norm]
        shapes += [
            (f"{prefix}.attention.out.weight", (d, queries)),
            (f"{prefix}.mlp_norm.weight", (d,)),
            (f"{prefix}.mlp.gate_up.weight", (2 * ffn, d)),
            (f"{prefix}.mlp.down.weight", (d, ffn)),
        ]
    shapes.append(("norm.weight", (d,)))
    shapes += [] if model.tie_embeddings else [("head.weight", (model.padded_vocab_size, d))]
    return shapes


def count_parameters(model: ModelConfig) -> int:
    """What `DiffusionTransformer(model).num_parameters` will be, from the config alone."""

    return sum(math.prod(shape) for _, shape in parameter_shapes(model))


def format_parameter_count(n: int) -> str:
    """Human-readable count: 512.0K, 110.9M, 1.28B (billions get one more digit)."""

    if n < 1000:
        return str(n)
    for scale, suffix, digits in ((1e12, "T", 2), (1e9, "B", 2), (1e6, "M", 1)):
        text = f"{n / scale:.{digits}f}"
        # Round first, then pick the unit, so 999_960 prints as 1.0M rather than 1000.0K.
        if float(text) >= 1.0:
            return f"{text}{suffix}"
    return f"{n / 1e3:.1f}K"
